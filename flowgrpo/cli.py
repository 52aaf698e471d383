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
  flowgrpo bench reward           images/s of every reward scorer (JPEG, OCR, PickScore, plug-ins)
  flowgrpo bench trainer          FlowGRPO LoRA / full gen-path training MFU (bench/trainer_gpu.sh)
  flowgrpo bench rollout          BAGEL-7B sampling images/s and MFU on a GPU (bench/rollout_gpu.sh)
  flowgrpo columns                the column schema every service checks its data against
  flowgrpo make-tiny-bagel /tmp/tiny   a tiny random BAGEL checkpoint in the published layout
  flowgrpo serve rollout rollout.checkpoint=/tmp/tiny server.port=50051
  flowgrpo generate --checkpoint /ckpt/BAGEL-7B-MoT --prompt "a red fox" --out images/
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


SERVICE_MAINS = {
    "reward": "flowgrpo.services.reward.main",
    "rollout": "flowgrpo.services.rollout.main",
    "trainer": "flowgrpo.services.trainer.main",
}


def _cmd_serve(args: argparse.Namespace) -> int:
    import importlib

    from flowgrpo.config import ConfigError, load_config

    main_module = importlib.import_module(SERVICE_MAINS[args.role])
    try:
        config = load_config(main_module.CONFIG, args.config, args.overrides)
    except ConfigError as error:
        print(f"flowgrpo serve {args.role}: {error}", file=sys.stderr)
        return 2
    if args.print_config:
        import yaml

        from flowgrpo.config import to_dict

        print(yaml.safe_dump(to_dict(config), sort_keys=False), end="")
        return 0
    main_module.run(config)
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from flowgrpo.generate import GenerateOptions, generate_images

    prompts = list(args.prompt) + _read_prompt_file(args.prompt_file)
    if not prompts:
        print("flowgrpo generate: give at least one --prompt or a --prompt-file", file=sys.stderr)
        return 2
    options = GenerateOptions(
        num_images=args.num_images, num_points=args.steps + 1, cfg_text_scale=args.cfg,
        noise_level=args.noise_level, height=args.height, width=args.width, seed=args.seed,
        device=args.device, dtype=args.dtype, batch_size=args.batch_size,
    )  # fmt: skip
    written = generate_images(args.checkpoint, prompts, args.out, options, lora=args.lora)
    print(f"wrote {len(written)} images and images.jsonl to {args.out}")
    return 0


def _read_prompt_file(path: str | None) -> list[str]:
    if path is None:
        return []
    with open(path, encoding="utf-8") as f:
        return [line.strip() for line in f if line.strip()]


def _cmd_make_tiny_bagel(args: argparse.Namespace) -> int:
    from flowgrpo.models.bagel.checkpoint import make_tiny_bagel

    path = make_tiny_bagel(args.dir, seed=args.seed)
    print(f"wrote a tiny random BAGEL checkpoint (published layout) to {path}")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    import importlib

    bench = importlib.import_module(f"flowgrpo.bench.{args.target}")
    code: int = bench.main(args.bench_args)
    return code


def _has_cuda() -> bool:
    """Whether a GPU is visible, without importing torch (``--help`` stays fast)."""
    import os

    return os.path.exists("/dev/nvidia0") or bool(os.environ.get("CUDA_VISIBLE_DEVICES"))


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
    serve = add(
        "serve",
        "run one service until SIGTERM (graceful drain); what compose, Kubernetes and the local "
        "launcher start",
        _cmd_serve,
    )
    serve.add_argument("role", choices=sorted(SERVICE_MAINS), help="the service to run")
    serve.add_argument("--config", help="YAML file with the service's config (overrides apply on top)")
    serve.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    serve.epilog = (
        "Every config key can be overridden as KEY=VALUE, e.g. rollout.checkpoint=/ckpt server.port=50051"
    )
    serve.set_defaults(takes_overrides=True)
    tiny = add(
        "make-tiny-bagel",
        "write a tiny random BAGEL checkpoint in the published layout (ema.safetensors, ae.safetensors, "
        "llm_config.json, tokenizer) for tests and the CPU demo",
        _cmd_make_tiny_bagel,
    )
    tiny.add_argument("dir", help="output folder (created; existing files are replaced)")
    tiny.add_argument("--seed", type=int, default=0, help="the same seed writes byte-identical files")
    gen = add(
        "generate", "generate images with a BAGEL checkpoint (and a LoRA adapter) as PNG files", _cmd_generate
    )
    gen.add_argument("--checkpoint", required=True, help="BAGEL folder in the published layout")
    gen.add_argument("--lora", help="a PEFT LoRA adapter folder (as the trainer saves it)")
    gen.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    gen.add_argument("--prompt-file", help="a text file, one prompt per line")
    gen.add_argument("--out", required=True, help="output folder for <prompt>_<sample>.png and images.jsonl")
    gen.add_argument("--num-images", type=int, default=1, help="images per prompt")
    gen.add_argument("--steps", type=int, default=49, help="denoising steps (schedule points - 1)")
    gen.add_argument("--cfg", type=float, default=4.0, help="text CFG scale")
    gen.add_argument("--noise-level", type=float, default=0.0, help="SDE noise level; 0 = deterministic ODE")
    gen.add_argument("--height", type=int, default=512)
    gen.add_argument("--width", type=int, default=512)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--device", default="cuda" if _has_cuda() else "cpu")
    gen.add_argument(
        "--dtype", choices=["bfloat16", "float32"], default="bfloat16" if _has_cuda() else "float32"
    )
    gen.add_argument("--batch-size", type=int, default=4, help="samples per forward batch")
    bench = add(
        "bench",
        "run a benchmark and print ratios against a baseline measured in the same run",
        _cmd_bench,
    )
    bench.add_argument(
        "target",
        choices=["bus", "reward", "rollout", "trainer"],
        help="bus: the ZeroMQ data bus against memcpy; reward: images/s per scorer; rollout: BAGEL "
        "sampling images/s and MFU against the matmul peak (GPU); trainer: FlowGRPO training "
        "throughput and MFU (GPU)",
    )
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="options of the benchmark (see --help)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # dotted overrides (section.key=value) may come anywhere after the subcommand
    args.overrides = [a for a in extra if "=" in a and not a.startswith("-")]
    unknown = [a for a in extra if a not in args.overrides]
    if unknown or (args.overrides and not getattr(args, "takes_overrides", False)):
        parser.error(f"unrecognized arguments: {' '.join(unknown or args.overrides)}")
    result: int = args.fn(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
