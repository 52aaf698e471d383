"""A verifiable prompt-following task: GenEval's categories in miniature, over coloured blobs.

- :mod:`~flowgrpo.compose.grammar`: the prompts, their typed specs, ``parse`` / ``prompt_of``
  (pure Python: data preparation needs only this);
- :mod:`~flowgrpo.compose.palette`: the colours and the background;
- :mod:`~flowgrpo.compose.render`: images of a prompt, many layouts each (numpy);
- :mod:`~flowgrpo.compose.verify`: blob detection and the per-constraint verdict (numpy, scipy);
- :mod:`~flowgrpo.compose.measure`: the verifier's measured accuracy per category;
- :mod:`~flowgrpo.compose.split`: the train / test split by combination and its prompt files.

The task, its rules and the measured table: docs/compose_task.md. Importing this package
imports the grammar only; the modules that need numpy or scipy import them.
"""

from flowgrpo.compose.grammar import (
    CATEGORIES,
    COLOURS,
    Attribution,
    Blob,
    Counting,
    Position,
    PromptError,
    Relation,
    Single,
    Spec,
    TwoObjects,
    all_specs,
    parse,
    prompt_of,
)

__all__ = [
    "CATEGORIES",
    "COLOURS",
    "Attribution",
    "Blob",
    "Counting",
    "Position",
    "PromptError",
    "Relation",
    "Single",
    "Spec",
    "TwoObjects",
    "all_specs",
    "parse",
    "prompt_of",
]
