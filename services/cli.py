"""The ``flowgrpo`` command line. Subcommands import their heavy modules lazily, so ``--help``
and the torch-free commands start fast and work where torch is not installed."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from flowgrpo import PROTOCOL_VERSION, __version__
from flowgrpo.services.cli_common import DEBUG_HELP, UsageError, add_debug, read_prompt_file
from flowgrpo.services.cli_data import add_data_commands

if TYPE_CHECKING:
    from flowgrpo.models.bagel.policy import PolicyUpdate

DESCRIPTION = """\
FlowGRPO: online RL fine-tuning of image generators (BAGEL-7B-MoT) with separate rollout,
reward, trainer and coordinator services talking gRPC and moving tensors over a ZeroMQ bus.
"""

EPILOG = """\
examples:
  flowgrpo train examples/tiny_demo.yaml        the CPU demo: a tiny BAGEL learns prompt following
  flowgrpo train examples/bagel_pickscore_lora.yaml model.checkpoint=/ckpt/BAGEL-7B-MoT data.dataset=/data/ps
  flowgrpo sft examples/sft_compose.yaml   teach a BAGEL to draw from (prompt, image) pairs (flow matching)
  flowgrpo status runs/tiny-demo  the run state, the last metrics, every replica (live while it runs)
  flowgrpo report runs/tiny-demo  runs/tiny-demo/report.html: the reward, every metric, grids, config diff
  flowgrpo report runs/a runs/a-control   two runs overlaid (the one with lr=0: the control)
  flowgrpo compare runs/a runs/b  did two runs train the same? (the first step where they part)
  flowgrpo trace runs/tiny-demo --step 3   one step as a waterfall across the four services
  flowgrpo serve rollout --recipe RECIPE coordinator=HOST:50050   a replica that joins a running run
  flowgrpo probe HOST:50051       the gRPC health of a service (exit 0 when SERVING)
  flowgrpo bench bus              data-bus throughput (ipc, tcp, shared memory; plain and CURVE) vs memcpy
  flowgrpo bench bus --json b.json --sizes-mib 1 64
  flowgrpo bench reward           images/s of every reward scorer (JPEG, OCR, PickScore, plug-ins)
  flowgrpo bench trainer          FlowGRPO LoRA / full gen-path training MFU (bench/trainer_gpu.sh)
  flowgrpo bench rollout          BAGEL-7B sampling images/s and MFU on a GPU (bench/rollout_gpu.sh)
  flowgrpo bench fp8              FP8 rollouts against bf16: images/s, MFU of both peaks, the log-prob gap
  flowgrpo bench schedule         async vs sync images/s and their overlap (the CPU demo, or --recipe)
  flowgrpo bench system           images/s vs the FLOP limit, time split, MFU per --variant (system_gpu.sh)
  flowgrpo bench consistency      do rollout and trainer compute the same log-probs? (consistency_gpu.sh)
  flowgrpo bench scale --replicas 1 8 64 256   the coordinator's cost per step against the replica count
  flowgrpo bench paths            launchers, replica counts, schedules: do they train the same?
  flowgrpo bench relay            weight publication, star vs relay, N replicas behind capped links
  flowgrpo bench learning --isa default avx2 --threads 1 2   the demo against its lr=0 control, per seed
  flowgrpo bench algos --plot a.png   FlowGRPO, GRPO-Guard, DiffusionNFT: held-out gain per image, per second
  flowgrpo columns                the column schema every service checks its data against
  flowgrpo make-tiny-bagel /tmp/tiny   a tiny random BAGEL checkpoint in the published layout
  flowgrpo data prepare ocr --model-path /tmp/tiny --input-dir examples/data/tiny_ocr --output-dir /tmp/ocr
                                  prompt files -> train/test.parquet + meta.json (see data prepare --help)
  flowgrpo data compose-prompts examples/data/compose   the compose task's prompts, split by combination
  flowgrpo data compose-images /tmp/pairs   rendered (prompt, image) pairs of the training prompts, for sft
  flowgrpo data compose-verifier  the compose verifier's accuracy per category (docs/compose_task.md)
  flowgrpo serve rollout rollout.checkpoint=/tmp/tiny server.port=50051
  flowgrpo generate --checkpoint /ckpt/BAGEL-7B-MoT --prompt "a red fox" --out images/
"""


BENCHMARKS = [
    "algos",
    "bus",
    "consistency",
    "fp8",
    "learning",
    "paths",
    "relay",
    "reward",
    "rollout",
    "scale",
    "schedule",
    "system",
    "trainer",
]


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

    from flowgrpo.config import ConfigError, apply_overrides, load_config

    main_module = importlib.import_module(SERVICE_MAINS[args.role])
    try:
        if args.recipe:
            config = apply_overrides(_recipe_role_config(args.recipe, args.role), args.overrides)
        else:
            config = load_config(main_module.CONFIG, args.config, args.overrides)
    except (ConfigError, OSError) as error:
        raise UsageError(str(error)) from error
    if args.print_config:
        _print_config(config)
        return 0
    if names := _join_credentials(config):  # a credentials file refused: one line at the boundary
        print(f"flowgrpo serve {args.role}: {' and '.join(names)} from the run's credentials file "
              f"{config.run_dir}/credentials.json", file=sys.stderr)  # fmt: skip
    main_module.run(config)  # a bind, plug-in or checkpoint error: one line at main()'s boundary
    from flowgrpo.runtime.launch import end_process

    end_process()  # stopped cleanly: exit 0 without the finalization, which can abort


def _join_credentials(config: Any) -> list[str]:
    """A replica that joins a local run on this host (``run_dir=RUN_DIR``) and was given no
    credentials takes the run's own from ``RUN_DIR/credentials.json`` (the environment and the
    config win)."""
    from flowgrpo.runtime.credentials import use_run_credentials

    if not config.run_dir:
        return []
    need_token = not config.server.token
    need_secret = config.bus.resolve_secret() is None  # also reads the environment
    return use_run_credentials(config.run_dir, need_token, need_secret)


def _print_config(config: Any) -> None:
    """The resolved config as YAML: every key with its value (it loads back as a file)."""
    import yaml

    from flowgrpo.config import redacted, to_dict

    print(yaml.safe_dump(to_dict(redacted(config)), sort_keys=False), end="")  # secrets emptied


def _recipe_role_config(recipe: str, role: str) -> Any:
    """``role``'s service config from a run recipe (the section the coordinator would give it)."""
    from flowgrpo.configs.run import read_recipe_sections
    from flowgrpo.services.coordinator.launch import role_config

    return role_config(read_recipe_sections(recipe), role)


def _cmd_train(args: argparse.Namespace) -> int:
    import logging
    import shlex

    from flowgrpo.config import ConfigError
    from flowgrpo.configs.run import load_run_config

    try:  # before the run's heavy modules: a bad recipe fails small and fast
        config = load_run_config(args.recipe, args.overrides)
    except (ConfigError, OSError) as error:
        raise UsageError(str(error)) from error
    if args.print_config:
        _print_config(config)
        return 0
    from flowgrpo.services.coordinator.lifecycle import RunInterrupted
    from flowgrpo.services.coordinator.runmeta import Invocation
    from flowgrpo.services.coordinator.summary import end_summary
    from flowgrpo.services.coordinator.train import train

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:  # the recipe without the overrides: what the report diffs the run's config against
        recipe = load_run_config(args.recipe)
    except ConfigError:  # a recipe that is complete only with its overrides: none to diff against
        recipe = None
    invocation = Invocation(args.recipe, tuple(args.overrides), recipe)
    try:
        history = train(config, invocation=invocation)
    except RunInterrupted as stop:  # SIGTERM / SIGINT: saved and drained (a second one: forced)
        print(f"flowgrpo train: {stop.line()}", file=sys.stderr)
        again = shlex.join(["flowgrpo", "train", args.recipe, *args.overrides])  # what resumes it
        print("\n".join(end_summary(config.run_dir, config.schedule.steps, resume=again)), file=sys.stderr)
        return 130 if stop.forced else 0
    except KeyboardInterrupt:  # before the run's own handlers were installed
        print("flowgrpo train: interrupted before the run started; nothing was trained", file=sys.stderr)
        return 130
    if history:  # else the run was finished before: it said so in one line
        print("\n".join(end_summary(config.run_dir, config.schedule.steps)), file=sys.stderr)
    return 0  # any other error: one line at main()'s boundary


def _cmd_sft(args: argparse.Namespace) -> int:
    from flowgrpo.config import ConfigError, load_config
    from flowgrpo.services.trainer.sft_config import SftConfig

    try:  # before torch: a bad recipe fails small and fast
        config = load_config(SftConfig, args.recipe, args.overrides)
    except (ConfigError, OSError) as error:
        raise UsageError(str(error)) from error
    if not config.run_dir:
        config.run_dir = f"runs/{config.name}"
    if args.print_config:
        _print_config(config)
        return 0
    from flowgrpo.services.trainer.distributed import end_rank
    from flowgrpo.services.trainer.sft import run_sft

    run_sft(config)
    end_rank()
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    from flowgrpo.services.coordinator.status import live_status, status

    if bool(args.run_dir) == bool(args.address):
        print("flowgrpo status: give a run folder or --address HOST:PORT of a coordinator", file=sys.stderr)
        return 2
    try:
        print(status(args.run_dir) if args.run_dir else live_status(args.address))
    except FileNotFoundError as error:
        print(f"flowgrpo status: {error}", file=sys.stderr)
        return 2
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from flowgrpo.services.coordinator.report import write_report

    try:
        path = write_report(args.run_dirs, out=args.out)
    except (FileNotFoundError, ValueError) as error:
        print(f"flowgrpo report: {error}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    from flowgrpo.services.coordinator.compare import (
        compare_runs,
        format_comparison,
        plot_comparison,
    )

    try:
        result = compare_runs(args.run_dirs, atol=args.atol, rtol=args.rtol, clock=args.clock)
    except (FileNotFoundError, ValueError) as error:
        print(f"flowgrpo compare: {error}", file=sys.stderr)
        return 2
    print(format_comparison(result))
    if args.plot:
        print(f"wrote {plot_comparison(result, args.plot)}")
    return 1 if args.fail_on_difference and not result.identical else 0


def _cmd_trace(args: argparse.Namespace) -> int:
    from flowgrpo.services.coordinator.trace import step_spans, waterfall

    spans = step_spans(args.run_dir, args.step)
    if not spans:
        print(f"flowgrpo trace: no spans of step {args.step} under {args.run_dir}/traces", file=sys.stderr)
        return 1
    print(waterfall(spans))
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from flowgrpo.config import ConfigError
    from flowgrpo.generate import GenerateError, GenerateOptions, generate_images
    from flowgrpo.models.bagel.checkpoint import CheckpointError as ModelFolderError
    from flowgrpo.models.bagel.policy import PolicyUpdateError
    from flowgrpo.services.trainer.checkpoint import CheckpointError

    if args.step is not None and args.run is None:
        print("flowgrpo generate: --step picks a checkpoint of a --run", file=sys.stderr)
        return 2
    if args.run is not None and args.lora is not None:
        print("flowgrpo generate: --lora goes with --checkpoint (a --run has its weights)", file=sys.stderr)
        return 2
    errors = (GenerateError, CheckpointError, ModelFolderError, PolicyUpdateError, ConfigError, OSError)
    try:
        prompts = list(args.prompt) + read_prompt_file(args.prompt_file)
        if not prompts:
            print("flowgrpo generate: give at least one --prompt or a --prompt-file", file=sys.stderr)
            return 2
        checkpoint, update, default_size = _generate_weights(args)
        options = GenerateOptions(
            num_images=args.num_images, num_points=args.steps + 1, cfg_text_scale=args.cfg,
            noise_level=args.noise_level, height=args.height, width=args.width,
            default_size=default_size, seed=args.seed, device=args.device, dtype=args.dtype,
            batch_size=args.batch_size,
        )  # fmt: skip
        written = generate_images(checkpoint, prompts, args.out, options, update)
    except errors as error:  # what the user gave is wrong: one line, no traceback
        print(f"flowgrpo generate: {error}", file=sys.stderr)
        return 1
    print(f"wrote {len(written)} images and images.jsonl to {args.out}")
    return 0


def _generate_weights(args: argparse.Namespace) -> tuple[str, PolicyUpdate | None, int]:
    """(base checkpoint, policy update to apply, default image side) of ``--checkpoint
    [--lora]``, or of ``--run [--step]``: the run's base, the checkpoint's weights and the run's
    sampling resolution."""
    from flowgrpo.generate import USUAL_SIZE
    from flowgrpo.models.bagel.peft_format import load_peft_adapter
    from flowgrpo.services.trainer.checkpoint import find_run_checkpoint, read_policy_update

    if args.run is None:
        return args.checkpoint, load_peft_adapter(args.lora) if args.lora else None, USUAL_SIZE
    found = find_run_checkpoint(args.run, args.step)
    update = read_policy_update(found.path)
    kind = "LoRA" if update.kind == "lora" else "full gen-path"
    print(f"{args.run}: the {kind} policy of step {found.step}, on {found.base}")
    return found.base, update, found.resolution


def _add_generate(add: Callable[..., argparse.ArgumentParser]) -> None:
    gen = add(
        "generate",
        "generate images as PNG files with a BAGEL checkpoint (and a LoRA adapter), or with any "
        "checkpoint of a training run (LoRA or the full gen path, on the run's base model)",
        _cmd_generate,
    )
    weights = gen.add_mutually_exclusive_group(required=True)
    weights.add_argument("--checkpoint", help="BAGEL folder in the published layout")
    weights.add_argument(
        "--run", metavar="RUN_DIR", help="a training run's folder (its config.yaml names the base)"
    )
    gen.add_argument("--step", type=int, help="with --run: the checkpoint of this step (default: the latest)")
    gen.add_argument("--lora", help="with --checkpoint: a PEFT LoRA adapter folder (as the trainer saves it)")
    gen.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    gen.add_argument("--prompt-file", help="a text file, one prompt per line")
    gen.add_argument(
        "--out", required=True,
        help="output folder for <prompt>_<sample>.png (<prompt>: the prompt as a file-name slug, "
        "'a-red-fox_0.png'; a repeated slug gets -2, -3, ...) and images.jsonl",
    )  # fmt: skip
    gen.add_argument("--num-images", type=int, default=1, help="images per prompt")
    gen.add_argument("--steps", type=int, default=49, help="denoising steps (schedule points - 1)")
    gen.add_argument("--cfg", type=float, default=4.0, help="text CFG scale")
    gen.add_argument("--noise-level", type=float, default=0.0, help="SDE noise level; 0 = deterministic ODE")
    size = (
        "px, a multiple of 16, at most the checkpoint's limit (max_latent_size x 16: 1024 for "
        "BAGEL-7B-MoT); default: that limit capped at 1024 (with --run: at the run's sampling.resolution)"
    )
    gen.add_argument("--height", type=int, help=size)
    gen.add_argument("--width", type=int, help=size)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--device", default="cuda" if _has_cuda() else "cpu")
    gen.add_argument(
        "--dtype", choices=["bfloat16", "float32"], default="bfloat16" if _has_cuda() else "float32"
    )
    gen.add_argument("--batch-size", type=int, default=4, help="samples per forward batch")


def _cmd_make_tiny_bagel(args: argparse.Namespace) -> int:
    from flowgrpo.models.bagel.checkpoint import make_tiny_bagel, make_tiny_drawer
    from flowgrpo.models.bagel.config import DRAWER_SIZES

    if args.drawer:
        if args.complete or args.flux_ae:
            raise UsageError("--drawer writes its own VAE and layout: drop --complete and --flux-ae")
        corpus = read_prompt_file(args.drawer)
        if not corpus:
            raise UsageError(f"--drawer {args.drawer}: the prompt file holds no prompt")
        geometry = DRAWER_SIZES[args.drawer_size]()
        path = make_tiny_drawer(args.dir, corpus, seed=args.seed, geometry=geometry)
        print(
            f"wrote an untrained drawing BAGEL ({args.drawer_size}: {geometry.layers} layers of "
            f"{geometry.hidden}; the cell codec, a tokenizer of {args.drawer}) to {path}"
        )
        return 0
    if args.drawer_size != "tiny":
        raise UsageError("--drawer-size sizes the drawing model: give --drawer PROMPT_FILE too")
    path = make_tiny_bagel(args.dir, seed=args.seed, complete=args.complete, flux_ae=args.flux_ae)
    layout = "the complete published layout" if args.complete else "published layout"
    print(f"wrote a tiny random BAGEL checkpoint ({layout}) to {path}")
    return 0


def _cmd_probe(args: argparse.Namespace) -> int:
    import asyncio

    import grpc

    from flowgrpo.runtime.client import health

    try:
        status = asyncio.run(health(args.address, args.service, args.timeout))
    except grpc.aio.AioRpcError as error:
        print(f"flowgrpo probe: {args.address}: no answer within {args.timeout:g} s "
              f"({error.code().name}: {error.details()})", file=sys.stderr)  # fmt: skip
        return 1
    print(f"{args.address} {args.service or '(server)'}: {status}")
    return 0 if status == "SERVING" else 1


def _cmd_bench(args: argparse.Namespace) -> int:
    import importlib

    bench = importlib.import_module(f"flowgrpo.services.bench.{args.target}")
    code: int = bench.main(args.bench_args)
    return code


def _has_cuda() -> bool:
    """Whether a GPU is visible, without importing torch (``--help`` stays fast)."""
    import os

    return os.path.exists("/dev/nvidia0") or bool(os.environ.get("CUDA_VISIBLE_DEVICES"))


def _add_results(add: Callable[..., argparse.ArgumentParser]) -> None:
    report = add(
        "report",
        "write RUN_DIR/report.html, one self-contained page (zoom, hover; no network): the optimised "
        "reward in its own panel, each scorer's change in %%, every metric by section with smoothing, "
        "training and validation grids with their prompts, the run's command and times, the config "
        "against its recipe; more runs are overlaid (a run with lr=0 is taken as the control)",
        _cmd_report,
    )
    report.add_argument(
        "run_dirs", nargs="+", metavar="RUN_DIR", help="run folders (a recipe's run_dir, e.g. runs/tiny-demo)"
    )
    report.add_argument("--out", default=None, help="the page to write (default: FIRST_RUN_DIR/report.html)")
    compare = add(
        "compare",
        "per-step differences of two or more runs' metrics: the largest absolute and relative "
        "difference per key and the first step where they part (did a change keep training the same?)",
        _cmd_compare,
    )
    compare.add_argument(
        "run_dirs", nargs="+", metavar="RUN_DIR", help="run folders; the first is the reference"
    )
    compare.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (default 0: bitwise)")
    compare.add_argument("--rtol", type=float, default=0.0, help="relative tolerance")
    compare.add_argument(
        "--clock", action="store_true", help="also compare wall-clock keys (time/, timing*, perf/)"
    )
    compare.add_argument("--plot", metavar="PNG", help="also plot the key metrics and their differences")
    compare.add_argument(
        "--fail-on-difference", action="store_true", help="exit 1 when the runs part (for scripts and CI)"
    )


def _add_probe(add: Callable[..., argparse.ArgumentParser]) -> None:
    probe = add(
        "probe",
        "ask a service's gRPC health (grpc.health.v1): exit 0 when SERVING, 1 otherwise (container "
        "health checks)",
        _cmd_probe,
    )
    probe.add_argument("address", help="HOST:PORT of a flowgrpo service or coordinator")
    probe.add_argument(
        "--service", default="", help="one service's name, e.g. flowgrpo.v1.Rollout (default: the server)"
    )
    probe.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for an answer")


def _add_serve(add: Callable[..., argparse.ArgumentParser]) -> None:
    serve = add(
        "serve",
        "run one service until SIGTERM (graceful drain); what compose, Kubernetes and the local "
        "launcher start",
        _cmd_serve,
    )
    serve.add_argument("role", choices=sorted(SERVICE_MAINS), help="the service to run")
    source = serve.add_mutually_exclusive_group()
    source.add_argument("--config", help="YAML file with the service's config (overrides apply on top)")
    source.add_argument(
        "--recipe",
        help="a run recipe (flowgrpo train's): this role's section of it, with model.checkpoint "
        "(overrides apply on top: coordinator=HOST:PORT server.port=N ...)",
    )
    serve.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    serve.epilog = (
        "Every config key can be overridden as KEY=VALUE, e.g. rollout.checkpoint=/ckpt server.port=50051"
    )
    serve.set_defaults(takes_overrides=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flowgrpo",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"flowgrpo {__version__}")
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def add(name: str, help_: str, fn: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(fn=fn)
        add_debug(p)
        return p

    add("version", "print the version and the wire protocol version", _cmd_version)
    _add_probe(add)
    add("columns", "print the column schema (name, dtype, shape pattern, meaning)", _cmd_columns)
    _add_serve(add)
    train = add(
        "train",
        "run a FlowGRPO training job from a recipe: starts the rollout, reward and trainer services "
        "(launch.launcher: local processes, inprocess, or remote ones) and coordinates them",
        _cmd_train,
    )
    train.add_argument("recipe", help="a recipe file, e.g. examples/tiny_demo.yaml (see examples/README.md)")
    train.add_argument("--print-config", action="store_true", help="print the resolved run config and exit")
    train.epilog = (
        "Any key of the recipe can be overridden as KEY=VALUE, e.g. trainer.optim.lr=1e-4 "
        "schedule.steps=50 launch.launcher=inprocess. Outputs go to run_dir (default runs/<name>); "
        "running the same command again resumes from the last checkpoint there."
    )
    train.set_defaults(takes_overrides=True)
    sft = add(
        "sft",
        "supervised fine-tuning of BAGEL's gen path with flow matching on (prompt, image) pairs "
        "(an image folder); full or LoRA, FSDP2 under torchrun; writes <run_dir>/model",
        _cmd_sft,
    )
    sft.add_argument("recipe", help="an sft recipe, e.g. examples/sft_compose.yaml")
    sft.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    sft.epilog = (
        "Any key can be overridden as KEY=VALUE, e.g. steps=2000 policy.kind=lora optim.lr=1e-4 "
        "data.images=/data/pairs. Several processes: torchrun --nproc-per-node N -m flowgrpo.services.cli "
        "sft RECIPE device=cuda. Running the same command again resumes from the last checkpoint."
    )
    sft.set_defaults(takes_overrides=True)
    st = add(
        "status",
        "where a run stands: run state, last metrics, its service processes, and (while it runs) "
        "every registered replica as its coordinator sees it",
        _cmd_status,
    )
    st.add_argument("run_dir", nargs="?", help="the run folder (run_dir of the recipe, e.g. runs/tiny-demo)")
    st.add_argument("--address", help="HOST:PORT of a running coordinator (instead of a run folder)")
    _add_results(add)
    tr = add("trace", "one training step as a waterfall of spans across the services", _cmd_trace)
    tr.add_argument("run_dir", help="the run folder (its traces/ holds every process's spans)")
    tr.add_argument("--step", type=int, required=True, help="the training step to show")
    tiny = add(
        "make-tiny-bagel",
        "write a tiny random BAGEL checkpoint in the published layout (ema.safetensors, ae.safetensors, "
        "llm_config.json, tokenizer) for tests and the CPU demo",
        _cmd_make_tiny_bagel,
    )
    tiny.add_argument("dir", help="output folder (created; existing files are replaced)")
    tiny.add_argument("--seed", type=int, default=0, help="the same seed writes byte-identical files")
    tiny.add_argument(
        "--complete",
        action="store_true",
        help="every file and tensor of the published folder (ViT, connector, full config.json, "
        "preprocessor_config.json) and a 512 px latent grid: what vLLM-Omni's BAGEL loader needs",
    )
    tiny.add_argument(
        "--drawer",
        metavar="PROMPT_FILE",
        help="the tiny drawing model instead: 4 layers of 128, the cell codec as its VAE, a tokenizer "
        "trained on PROMPT_FILE's prompts; untrained (flowgrpo sft teaches it to draw)",
    )
    tiny.add_argument(
        "--drawer-size",
        choices=("tiny", "300m"),
        default="tiny",
        help="the drawing model's geometry: tiny (4 layers of 128, 1.8M parameters, for CPUs) or 300m "
        "(10 layers of 1024, 306M parameters, a latent grid up to 256 px: for a GPU)",
    )
    tiny.add_argument(
        "--flux-ae",
        action="store_true",
        help="a random autoencoder in the published FLUX geometry (335 MB) instead of the tiny one",
    )
    add_data_commands(sub)
    _add_generate(add)
    bench = add(
        "bench",
        "run a benchmark and print ratios against a baseline measured in the same run",
        _cmd_bench,
    )
    bench.add_argument(
        "target",
        choices=BENCHMARKS,
        help="bus: the ZeroMQ data bus against memcpy; reward: images/s per scorer; rollout: BAGEL "
        "sampling images/s and MFU against the matmul peak (GPU); trainer: FlowGRPO training "
        "throughput and MFU (GPU); schedule: async vs sync images/s and their overlap (the CPU demo); "
        "paths: do the launchers, replica counts and schedules train the same (the CPU demo); "
        "relay: weight publication, star against relay, at N replicas each behind a capped link; "
        "learning: the demo against its lr=0 control per seed, CPU capability and thread count; "
        "algos: FlowGRPO (windows, branching), GRPO-Guard and DiffusionNFT on the compose task: held-out "
        "accuracy over lr = 0 controls, images and trainer seconds to 50%%/90%% of the best gain; "
        "system: a recipe's images/s against its FLOP limit, each step's time split and MFU, per variant; "
        "consistency: the rollout/trainer log-prob gap per window step, batched vs batch-invariant",
    )
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="options of the benchmark (see --help)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    import os

    # gRPC core writes to stderr on its own, INFO lines too ("Got goaway" when a start-up is
    # abandoned): only its errors here; GRPC_VERBOSITY=INFO or DEBUG shows the rest
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # dotted overrides (section.key=value) may come anywhere after the subcommand
    args.overrides = [a for a in extra if "=" in a and not a.startswith("-")]
    unknown = [a for a in extra if a not in args.overrides]
    if unknown or (args.overrides and not getattr(args, "takes_overrides", False)):
        parser.error(f"unrecognized arguments: {' '.join(unknown or args.overrides)}")
    return _at_the_boundary(args)


# Errors whose message is written for the user (the input, a file, a port, a replica, the run):
# printed as they are. Named, not imported: some live in modules that import torch, which the
# coordinator's image does not have. Anything else is a bug: its type and the --debug hint.
USER_ERRORS = frozenset({
    "UsageError", "ConfigError", "YamlError", "FieldError", "InsecureBindError", "InsecureBusError",
    "PluginError", "ResumeRefused", "CredentialsFileError", "ImageFolderError", "PromptError",
})  # fmt: skip
RUN_ERRORS = frozenset({
    "OSError", "TimeoutError", "CheckpointError", "DatasetError", "RunError", "RunFolderBusy",
    "ServiceStartError", "ReplicaError", "HandshakeError", "PipelineError", "GenerateError",
    "PolicyUpdateError", "BusError", "ServiceError",
})  # fmt: skip


def _at_the_boundary(args: argparse.Namespace) -> int:
    """Run the command; an error becomes one line on stderr and an exit status (2: the input,
    1: the run). ``--debug`` prints the traceback before that line."""
    try:
        result: int = args.fn(args)
    except Exception as error:
        if args.debug:
            import traceback

            traceback.print_exc()
        command = " ".join(str(getattr(args, k)) for k in ("command", "role") if getattr(args, k, None))
        print(f"flowgrpo {command}: {error_line(error)}", file=sys.stderr)
        return 2 if _kinds(error) & USER_ERRORS else 1
    return result


def error_line(error: BaseException, most: int = 2000) -> str:
    """``error`` as one line of at most ``most`` characters; an unexpected kind with its type."""
    text = " ".join(str(error).split()) or type(error).__name__
    if len(text) > most:
        text = f"{text[: most - 30]}... ({len(text):,} characters)"
    if not _kinds(error) & (USER_ERRORS | RUN_ERRORS):
        return f"{type(error).__name__}: {text} (an unexpected error: --debug shows the traceback)"
    return text


def _kinds(error: BaseException) -> set[str]:
    return {cls.__name__ for cls in type(error).__mro__}


if __name__ == "__main__":
    sys.exit(main())
