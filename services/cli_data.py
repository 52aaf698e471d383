"""``flowgrpo data``: prompt datasets (``prepare``) and the compose task's files (``compose-prompts``,
``compose-images``, ``compose-verifier``). Their modules are imported when a command runs."""

from __future__ import annotations

import argparse
import sys

from flowgrpo.services.cli_common import UsageError, add_debug, read_prompt_file

DATA_PREPARE_DESCRIPTION = """\
Turn flow_grpo-style prompt files into the prepared dataset that training reads.

input:  INPUT_DIR/train.txt and INPUT_DIR/test.txt, UTF-8, one prompt per line (the layout of
        flow_grpo's dataset/pickscore and dataset/ocr; choose files with --splits).
output: OUTPUT_DIR/train.parquet, OUTPUT_DIR/test.parquet and OUTPUT_DIR/meta.json, each written
        atomically. One row per prompt: data_source, split, index, line, prompt_uid, prompt,
        prompt_ids, truncated, ground_truth. prompt_ids = <|im_start|> + the tokens of the prompt
        + <|im_end|>, made once here with the checkpoint's tokenizer (every service uses these
        ids); a longer prompt is cut to --max-length with both markers kept and is counted as
        truncated. meta.json names the tokenizer (sha256 of tokenizer.json, checked when a run
        loads the dataset with its checkpoint) and the counts below.

kinds:  pickscore  the ground truth is the prompt itself (the caption PickScore scores against)
        ocr        the ground truth is the text between the first pair of double quotes
                   ("..."), which the image should show
        compose    a prompt of the compose grammar (coloured blobs: docs/compose_task.md); the
                   ground truth is its canonical form, which the compose reward verifies

lines:  surrounding whitespace is stripped; empty lines are skipped; a repeated line is dropped
        (the first one is kept); a bad line (ocr: without a double-quoted span, or with an empty
        one; compose: outside the grammar, with the word it could not read) is reported with its
        file and line number and dropped (or fails the command with --on-bad-line fail). Each is
        counted in the summary and in meta.json.

prompt_uid = <split>-<16 hex digits of sha256(prompt)>: it depends on the text only, so it
stays the same when lines are added, removed or reordered, and runs compare prompt by prompt.

exit status: 0 when written; 2 on bad input (a one-line message says what and how to fix it).
"""

DATA_PREPARE_EPILOG = """\
examples:
  flowgrpo train examples/tiny_demo.yaml        the CPU demo: a tiny BAGEL learns prompt following
  flowgrpo train examples/bagel_pickscore_lora.yaml model.checkpoint=/ckpt/BAGEL-7B-MoT data.dataset=/data/ps
  flowgrpo make-tiny-bagel /tmp/tiny
  flowgrpo data prepare pickscore --model-path /tmp/tiny --input-dir examples/data/tiny \\
      --output-dir /tmp/tiny-data
  flowgrpo data prepare ocr --model-path /ckpt/BAGEL-7B-MoT --input-dir flow_grpo/dataset/ocr \\
      --output-dir data/ocr --on-bad-line fail
  flowgrpo data prepare ocr --model-path /ckpt/BAGEL-7B-MoT --input-dir ocr/ --splits test \\
      --output-dir data/ocr-test
  flowgrpo data prepare compose --model-path /tmp/tiny --input-dir examples/data/compose \\
      --output-dir /tmp/compose-data --on-bad-line fail
"""


def _cmd_data_prepare(args: argparse.Namespace) -> int:
    try:
        from flowgrpo.data.format import DatasetError
        from flowgrpo.data.prepare import PrepareOptions, prepare_dataset, report
    except ImportError as error:
        if error.name not in ("pyarrow", "tqdm"):
            raise
        print(f"flowgrpo data prepare: needs {error.name}: pip install 'flowgrpo[data]'", file=sys.stderr)
        return 2
    options = PrepareOptions(
        kind=args.kind, max_length=args.max_length, splits=tuple(args.splits),
        on_bad_line=args.on_bad_line, data_source=args.data_source, progress=not args.no_progress,
    )  # fmt: skip
    try:
        meta = prepare_dataset(args.model_path, args.input_dir, args.output_dir, options)
    except (DatasetError, OSError) as error:
        print(f"flowgrpo data prepare: {error}", file=sys.stderr)
        return 2
    warnings, summary = report(meta, args.output_dir)
    for line in warnings:
        print(line, file=sys.stderr)
    print("\n".join(summary))
    return 0


def add_data_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    data = sub.add_parser(
        "data",
        help="prepare prompt datasets (train.txt / test.txt -> parquet with prompt ids)",
        description="Prompt datasets. `flowgrpo data prepare --help` explains the format.",
    )
    actions = data.add_subparsers(dest="action", metavar="ACTION", required=True)
    prep = actions.add_parser(
        "prepare",
        help="tokenise flow_grpo-style prompt files once into train/test.parquet + meta.json",
        description=DATA_PREPARE_DESCRIPTION,
        epilog=DATA_PREPARE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    prep.set_defaults(fn=_cmd_data_prepare)
    add_debug(prep)
    prep.add_argument(
        "kind", choices=["pickscore", "ocr", "compose"], help="what the reward compares with (see kinds)"
    )
    prep.add_argument(
        "--model-path", required=True, metavar="DIR",
        help="the BAGEL checkpoint folder the dataset is for (its tokenizer.json is used)",
    )  # fmt: skip
    prep.add_argument("--input-dir", required=True, metavar="DIR", help="folder with train.txt / test.txt")
    prep.add_argument(
        "--output-dir", required=True, metavar="DIR", help="folder for the parquet files and meta.json "
        "(created; files of the same names are replaced)",
    )  # fmt: skip
    prep.add_argument(
        "--max-length", type=int, default=256, metavar="N",
        help="tokens per prompt including both markers; longer prompts are cut (default: %(default)s)",
    )  # fmt: skip
    prep.add_argument(
        "--splits", nargs="+", choices=["train", "test"], default=["train", "test"],
        help="which of INPUT_DIR/<split>.txt to prepare; each must exist; meta.json then lists only "
        "these (default: train test)",
    )  # fmt: skip
    prep.add_argument(
        "--on-bad-line", choices=["drop", "fail"], default="drop",
        help="a bad line (ocr: no usable quoted span; compose: outside the grammar): drop it and "
        "report it (default), or fail",
    )  # fmt: skip
    prep.add_argument(
        "--data-source", default="", metavar="NAME",
        help="the data set's name in its data_source column (default: the kind)",
    )  # fmt: skip
    prep.add_argument(
        "--no-progress", action="store_true", help="no progress bar (it shows only on a terminal)"
    )
    _add_compose_commands(actions)


COMPOSE_PROMPTS_DESCRIPTION = """\
Write the compose task's prompt files: OUTPUT_DIR/train.txt and OUTPUT_DIR/test.txt, one prompt
per line, every prompt of the grammar in one of them. The split is by combination: a test
prompt's pair of colours, (colour, count) or (colour, side) never appears in a training prompt
(docs/compose_task.md). examples/data/compose holds this command's output. Prepare the files
with `flowgrpo data prepare compose`.
"""

COMPOSE_VERIFIER_DESCRIPTION = """\
Measure the compose verifier: for every prompt of the grammar and SEEDS seeds, the share of
images judged correct (and the mean partial credit) per category, on the prompt's own images
(sharp; through 2, 4 and 8 px cells averaged and upsampled bilinearly; through the tiny drawing
model's cell codec, and faded), on noise, on smooth colour fields and on another prompt's image.
Prints a markdown table (the one in docs/compose_task.md is --seeds 10, about a minute of CPU).
"""


def _cmd_data_compose_prompts(args: argparse.Namespace) -> int:
    from flowgrpo.compose.split import summary, write_prompt_files

    written = write_prompt_files(args.output_dir)
    print("\n".join(summary()))
    print("wrote " + " and ".join(str(path) for path in written.values()))
    return 0


def _cmd_data_compose_images(args: argparse.Namespace) -> int:
    from flowgrpo.compose.images import write_rendered_folder

    prompts = read_prompt_file(args.prompts)
    if not prompts:
        raise UsageError(f"--prompts {args.prompts}: the file holds no prompt")
    if not 0.0 <= args.unmentioned <= 1.0:
        raise UsageError(f"--unmentioned {args.unmentioned}: give a share in [0, 1]")
    count = write_rendered_folder(
        args.output_dir, prompts, args.layouts, seed=args.seed, size=args.size, unmentioned=args.unmentioned
    )
    extra = f", {args.unmentioned:.0%} with a blob the prompt does not name" if args.unmentioned else ""
    what = f"{args.layouts} layouts of {len(prompts)} prompts{extra}"
    print(f"wrote {count} images ({what}) to {args.output_dir}")
    return 0


def _cmd_data_compose_verifier(args: argparse.Namespace) -> int:
    if not 1 <= args.seeds <= 1000:
        raise UsageError(f"--seeds {args.seeds}: give 1 to 1000")
    try:
        from flowgrpo.compose.measure import format_table, measure
    except ImportError as error:
        if error.name != "scipy":
            raise
        print("flowgrpo data compose-verifier: needs scipy: pip install scipy", file=sys.stderr)
        return 2
    table = measure(seeds=args.seeds)
    print(format_table(table))
    return 0


def _add_compose_commands(actions: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    prompts = actions.add_parser(
        "compose-prompts",
        help="write the compose task's train.txt / test.txt (split by combination)",
        description=COMPOSE_PROMPTS_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    prompts.set_defaults(fn=_cmd_data_compose_prompts)
    add_debug(prompts)
    prompts.add_argument(
        "output_dir", metavar="OUTPUT_DIR", help="folder for train.txt and test.txt (created)"
    )
    images = actions.add_parser(
        "compose-images",
        help="render LAYOUTS images of every prompt of a compose prompt file as an image folder "
        "(metadata.jsonl + PNGs): the data of flowgrpo sft",
    )
    images.set_defaults(fn=_cmd_data_compose_images)
    add_debug(images)
    images.add_argument("output_dir", metavar="OUTPUT_DIR", help="the image folder (replaced atomically)")
    images.add_argument("--prompts", default="examples/data/compose/train.txt", help="(default: %(default)s)")
    images.add_argument("--layouts", type=int, default=32, help="images per prompt (default: %(default)s)")
    images.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    images.add_argument("--size", type=int, default=64, help="image side in px (default: %(default)s)")
    images.add_argument(
        "--unmentioned",
        type=float,
        default=0.0,
        help="share of images that also hold a blob of a colour their prompt does not name, as web "
        "captions leave objects out (default: %(default)s)",
    )
    verifier = actions.add_parser(
        "compose-verifier",
        help="measure the compose verifier's accuracy per category (a markdown table)",
        description=COMPOSE_VERIFIER_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    verifier.set_defaults(fn=_cmd_data_compose_verifier)
    add_debug(verifier)
    verifier.add_argument(
        "--seeds",
        type=int,
        default=10,
        metavar="N",
        help="images per prompt and condition (default: %(default)s)",
    )
