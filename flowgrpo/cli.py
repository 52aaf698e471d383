"""The ``flowgrpo`` command line. Subcommands import their heavy modules lazily, so ``--help``
and the torch-free commands start fast and work where torch is not installed."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from flowgrpo import PROTOCOL_VERSION, __version__

DESCRIPTION = """\
FlowGRPO: online RL fine-tuning of image generators (BAGEL-7B-MoT) with separate rollout,
reward, trainer and coordinator services talking gRPC and moving tensors over a ZeroMQ bus.
"""

EPILOG = """\
examples:
  flowgrpo bench bus              data-bus throughput (ipc, tcp, shared memory) vs memcpy
  flowgrpo bench bus --json b.json --sizes-mib 1 64
  flowgrpo columns                the column schema every service checks its data against
  flowgrpo make-tiny-bagel /tmp/tiny   a tiny random BAGEL checkpoint in the published layout
"""


def _cmd_version(_: argparse.Namespace) -> int:
    print(f"flowgrpo {__version__} (protocol {PROTOCOL_VERSION})")
    return 0


def _cmd_columns(_: argparse.Namespace) -> int:
    from flowgrpo.columns import COLUMNS

    width = max(len(name) for name in COLUMNS.columns)
    for spec in COLUMNS.columns.values():
        print(f"{spec.name:<{width}}  {spec.dtype:<8} {spec.pattern_str():<16} {spec.doc}")
    return 0


def _cmd_make_tiny_bagel(args: argparse.Namespace) -> int:
    from flowgrpo.models.bagel.checkpoint import make_tiny_bagel

    path = make_tiny_bagel(args.dir, seed=args.seed)
    print(f"wrote a tiny random BAGEL checkpoint (published layout) to {path}")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from flowgrpo.bench import bus

    code: int = bus.main(args.bench_args)
    return code


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flowgrpo",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"flowgrpo {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def add(name: str, help_: str, fn: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(fn=fn)
        return p

    add("version", "print the version and the wire protocol version", _cmd_version)
    add("columns", "print the column schema (name, dtype, shape pattern, meaning)", _cmd_columns)
    tiny = add(
        "make-tiny-bagel",
        "write a tiny random BAGEL checkpoint in the published layout (ema.safetensors, ae.safetensors, "
        "llm_config.json, tokenizer) for tests and the CPU demo",
        _cmd_make_tiny_bagel,
    )
    tiny.add_argument("dir", help="output folder (created; existing files are replaced)")
    tiny.add_argument("--seed", type=int, default=0, help="the same seed writes byte-identical files")
    bench = add(
        "bench",
        "run a benchmark and print ratios against a baseline measured in the same run",
        _cmd_bench,
    )
    bench.add_argument("target", choices=["bus"], help="bus: the ZeroMQ data bus against memcpy")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="options of the benchmark (see --help)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result: int = args.fn(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
