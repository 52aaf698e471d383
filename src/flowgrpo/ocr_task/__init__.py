"""A text-rendering task for the OCR reward: prompts in flow_grpo's OCR style whose quoted target
is drawn as one line of text; small enough for the tiny BAGEL (64 x 128 px images).

- :mod:`~flowgrpo.ocr_task.words`: the vocabulary, extracted from flow_grpo's OCR prompts and
  shipped in ``data/words.txt`` (source and licence: ``data/SOURCE.md``);
- :mod:`~flowgrpo.ocr_task.split`: targets, prompts and the train / test split by tier;
- :mod:`~flowgrpo.ocr_task.render`: images of a target (PIL, DejaVu fonts);
- :mod:`~flowgrpo.ocr_task.measure`: the offline OCR reward's accuracy per tier.

The reward is the ``ocr`` scorer (:mod:`flowgrpo.rewards.ocr`) with ``engine: offline``.
Importing this package imports nothing heavy; the modules that need numpy or Pillow import them.
"""
