"""Prompt datasets: preparation from flow_grpo-style text files and the one loader.

- :mod:`~flowgrpo.data.format`: the prepared format (columns, ``meta.json``, prompt uids);
- :mod:`~flowgrpo.data.prepare`: ``train.txt`` / ``test.txt`` -> ``train.parquet`` / ``test.parquet``
  + ``meta.json`` (``flowgrpo data prepare``);
- :mod:`~flowgrpo.data.load`: the reader the coordinator uses, with schema and tokenizer checks.

Torch-free. This package needs pyarrow (the ``data`` extra); preparation also tqdm.
"""

from flowgrpo.data.format import COLUMNS, DatasetError, DatasetMeta
from flowgrpo.data.load import PromptRow, PromptSplit, check_tokenizer, load_split, read_meta

__all__ = [
    "COLUMNS",
    "DatasetError",
    "DatasetMeta",
    "PromptRow",
    "PromptSplit",
    "check_tokenizer",
    "load_split",
    "read_meta",
]
