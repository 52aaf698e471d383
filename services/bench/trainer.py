"""FlowGRPO trainer step throughput, MFU, memory and weight publication (``flowgrpo bench trainer``).

The real 7B geometry with random bf16 weights (meta device, ``to_empty``, ``init_weights``: no
checkpoint needed), the policy of the recipe (LoRA r 64 / alpha 128 on the default gen-path
targets, fp32 A/B and AdamW state; or ``--policy full``: every ``moe_gen`` parameter in fp32,
sharded with FSDP2 when started under torchrun), 512px (1024 latent tokens), text CFG 4, an SDE
window of 2 steps on a 15-point schedule. The batch is drawn by ``BagelSampler.generate`` with
the same model (so the logp_old recompute is measured against real behaviour log-probs), moved
to the host as the service receives it, then trained by ``TrainStep.run``: one logp_old
recompute pass (no gradients) and ``mini_batches`` optimizer steps over micro-batches.

Each configuration (micro-batch size, activation checkpointing on/off, LoRA matmuls in bf16
autocast or in fp32) runs one warm-up step (its rollout/trainer log-prob gap is the sync-mode
gap: the policy is reset to the sampled weights first) and ``--reps`` (>= 3) timed steps;
reported, each as the median with its range (services/bench/stats.py): trajectories/s
(= images/s; per GPU), the two passes' times, MFU of each, peak memory.

MFU = FLOPs (trainer_flops.py: the matmuls actually executed) / time / the bf16 matmul peak
measured in this run (8192^3) after a warm-up, before and after the timed steps; the larger of
the two is used (``MatmulPeak.used`` says why). Publication: publication.py.

``--profile``: each variant one more step under torch.profiler (``bench.kernels``): its kernel
time by kind (GEMMs, attention, the compiled fused kernels, the optimizer's, NCCL's, the rest),
the top kernels by name, and the kernels' share of the step's median time (what is left is the
GPU waiting on the host).

``--model tiny --device cpu`` runs every code path on the tiny model in seconds (a smoke test;
its figures mean nothing).
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from flowgrpo.algorithms.objective import recomputed_rows
from flowgrpo.configs.trainer import DEFAULT_LORA_TARGETS, NftConfig, PolicyConfig
from flowgrpo.models.bagel.checkpoint import EMA_FILE, save_bagel_checkpoint, tiny_tokenizer
from flowgrpo.models.bagel.config import BagelConfig, bagel_7b, flux_vae, tiny, tiny_vae
from flowgrpo.models.bagel.parallelize import parallelize_bagel, uncheckpoint_query_layers
from flowgrpo.models.bagel.vae import AutoEncoder
from flowgrpo.sampler_params import SamplerParams
from flowgrpo.services.bench.common import (
    DTYPES,
    SPECIAL_7B,
    SPECIAL_TINY,
    GiB,
    MatmulPeak,
    device_name,
    free,
    make_requests,
    open_device,
    random_bagel,
    sync,
)
from flowgrpo.services.bench.kernels import print_profile
from flowgrpo.services.bench.publication import measure_publication
from flowgrpo.services.bench.stats import MIN_REPEATS, repeats_arg, write_json
from flowgrpo.services.bench.trainer_checkpoint import measure_checkpoint_cost
from flowgrpo.services.bench.trainer_flops import (
    counted_flops,
    lora_parameters,
    nft_pass_flops,
    pass_flops,
    spec_flops_per_sample,
)
from flowgrpo.services.bench.trainer_step import (
    StepBench,
    add_mfu,
    measure_variant,
    parse_variants,
    random_batch,
    sampled_batch,
)
from flowgrpo.services.trainer.distributed import Dist, close_distributed, end_rank, init_distributed
from flowgrpo.services.trainer.load import load_policy
from flowgrpo.services.trainer.policy import TrainablePolicy

Say = Callable[..., None]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.write_checkpoint:
        return write_random_checkpoint(args)
    started = time.perf_counter()
    dist = init_distributed(args.device)
    device = open_device(args.device, "trainer")
    if device is None:
        return 2
    report = run(args, dist, device, started)
    if dist.rank == 0:
        write_json(args.json, report)
        _print_table(report)
    close_distributed()
    end_rank()
    return 0


def run(args: argparse.Namespace, dist: Dist, device: torch.device, started: float) -> dict[str, Any]:
    """Build, draw a batch, measure every variant, the peak again, then publication."""
    say: Say = print if dist.rank == 0 else (lambda *a, **k: None)
    report = _header(args, dist, device)
    peak = report["matmul_peak"] = MatmulPeak.measure(device)
    say(f"{report['device']} x{dist.world}: {peak.line()}", flush=True)
    policy = _build_policy(args, dist, device, report, say)
    bench = _step_bench(args, policy, dist, report, say)
    cfg = policy.model.config
    _measure_variants(args, bench, report, started, say)
    if args.checkpoint_every_step:
        variant = parse_variants(args.variants)[0]
        report["checkpoint_every_step"] = measure_checkpoint_cost(
            bench, variant, Path(args.checkpoint_every_step), say
        )
    peak.measure_after(device)
    say(f"{peak.line()}; MFU against {peak.used:.4g} TFLOP/s (the larger)", flush=True)
    for row in report["rows"]:
        _add_row_mfu(args, cfg, row, peak.used)
    if not dist.enabled:
        uncheckpoint_query_layers(policy.model)
    if args.publish and time.perf_counter() - started < args.deadline_s:
        free(device)
        report["publication"] = measure_publication(policy, dist, args.publish_reps, args.store_gib)
        say("publication:", json.dumps(_publication_medians(report["publication"])), flush=True)
    return report


def _header(args: argparse.Namespace, dist: Dist, device: torch.device) -> dict[str, Any]:
    report: dict[str, Any] = {"args": vars(args), "torch": torch.__version__, "world": dist.world}
    report["device"] = device_name(device)
    try:
        import peft

        report["peft"] = peft.__version__
    except ImportError:
        pass
    report["once_s"] = {}
    return report


def _build_policy(
    args: argparse.Namespace, dist: Dist, device: torch.device, report: dict[str, Any], say: Say
) -> TrainablePolicy:
    """The policy on random weights, or loaded from --checkpoint through the trainer's loader
    (meta device, FSDP2, each rank reads its rows); sharded under torchrun."""
    cfg, dtype = bagel_7b() if args.model == "7b" else tiny(), DTYPES[args.dtype]
    begin = time.perf_counter()
    policy_cfg = PolicyConfig(kind=args.policy, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha)
    if args.checkpoint:
        policy = load_policy(args.checkpoint, policy_cfg, dist, dtype=dtype, device=str(device),
                             param_dtype=dtype, activation_checkpointing=dist.enabled,
                             compile=dist.enabled and args.compile)  # fmt: skip
        report["once_s"]["load"], report["load"] = _load_figures(dist, device, time.perf_counter() - begin)
        say("loaded through the trainer's loader:", json.dumps(report["load"]), flush=True)
    else:
        policy = TrainablePolicy(random_bagel(cfg, dtype, device), policy_cfg)
        if dist.enabled:
            # compile, checkpoint, then shard: FSDP's hooks around the recompute
            parallelize_bagel(policy.model, dist.mesh(args.device), compile=args.compile,
                              activation_checkpointing=True, param_dtype=dtype)  # fmt: skip
    sync(device)
    report["once_s"]["build"] = time.perf_counter() - begin
    report["trainable_params"] = sum(p.numel() for p in policy.trainable().values())  # DTensors: global
    if args.policy == "lora":
        targets = list(DEFAULT_LORA_TARGETS)
        report["lora_params_formula"] = lora_parameters(policy.model.config, args.lora_rank, targets)
    if device.type == "cuda":
        report["model_gib"] = torch.cuda.memory_allocated(device) / GiB
    say(f"model built in {report['once_s']['build']:.1f} s, "
        f"{report['trainable_params'] / 1e6:.1f}M trainable parameters", flush=True)  # fmt: skip
    return policy


def _step_bench(
    args: argparse.Namespace, policy: TrainablePolicy, dist: Dist, report: dict[str, Any], say: Say
) -> StepBench:
    """The batch every variant trains on (drawn by the sampler, or random) and its FLOPs."""
    special = SPECIAL_7B if args.model == "7b" else SPECIAL_TINY
    cfg = policy.model.config  # what was built or loaded: a --checkpoint may have fewer layers
    params = SamplerParams(
        num_points=args.num_points,
        height=args.resolution,
        width=args.resolution,
        decode_images=False,
        cfg_text_scale=args.cfg_scale,
        window_size=args.window,
        window_range=(0, min(7, args.num_points - 1)),
    )
    requests = make_requests(args.batch, args.prompt_len, special, group=args.group)
    begin = time.perf_counter()
    if args.trajectories == "sampler":
        batch = sampled_batch(policy.model, special, requests, params)
    else:
        batch = random_batch(cfg, requests, params)
    sync(policy.model.vae2llm.weight.device)
    report["once_s"]["draw_batch"] = time.perf_counter() - begin
    say(
        f"{len(batch)} trajectories ({args.trajectories}) in {report['once_s']['draw_batch']:.1f} s",
        flush=True,
    )
    n_tokens = (args.resolution // 16) ** 2
    prompts = [t.prompt_ids.numel() for t in batch]
    lora = {"kind": args.policy, "rank": args.lora_rank, "targets": list(DEFAULT_LORA_TARGETS)}
    report["flops"] = pass_flops(cfg, n_tokens, prompts, args.window, **lora)
    # the logp_old pass recomputes the rows after the first mini-batch (FlowGRPO's objective)
    later = [prompts[row] for row in recomputed_rows(len(batch), args.mini_batches)]
    report["flops"]["old"] = pass_flops(cfg, n_tokens, later, args.window, **lora)["old"]
    times = NftConfig(timestep_fraction=args.nft_fraction).trained_times(args.num_points - 1)
    report["flops_nft"] = nft_pass_flops(cfg, n_tokens, prompts, times, kind=args.policy, rank=args.lora_rank,
                                         targets=list(DEFAULT_LORA_TARGETS))  # fmt: skip
    report["nft_times_per_sample"] = times
    report["spec_step_flops_per_sample"] = spec_flops_per_sample(cfg, n_tokens, args.prompt_len)
    initial = None
    if args.policy == "lora":
        initial = {n: t.detach().clone() for n, t in policy.published().items()}
    return StepBench(
        policy,
        initial,
        batch,
        params,
        special,
        dist,
        args.reps,
        args.mini_batches,
        args.compile,
        args.nft_fraction,
        args.profile,
    )


def _measure_variants(
    args: argparse.Namespace, bench: StepBench, report: dict[str, Any], started: float, say: Say
) -> None:
    report["rows"] = []
    for variant in parse_variants(args.variants):
        if time.perf_counter() - started > args.deadline_s:
            say(f"deadline: {variant.name} not measured", flush=True)
            report["rows"].append({"variant": variant.name, "error": "skipped: deadline"})
            continue
        row = measure_variant(variant, bench)
        if bench.dist.enabled and "peak_gib" in row:
            peaks: list[Any] = [None] * bench.dist.world
            torch.distributed.all_gather_object(peaks, row["peak_gib"])
            row["peak_gib_per_rank"] = peaks
        report["rows"].append(row)
        # against the peak measured before: a call cut off later keeps every measured row's MFU
        # (rewritten against the larger of before and after once the run ends)
        _add_row_mfu(args, bench.policy.model.config, row, report["matmul_peak"].used)
        say(_row_line(row), flush=True)
        if "kernels" in row and bench.dist.rank == 0:
            busy = row["kernels"]["busy_share"]
            print_profile(f"{variant.name}: one step's kernels ({busy:.0%} of its time)", row["kernels"])
        if bench.dist.rank == 0:
            write_json(args.json, report)


def _add_row_mfu(args: argparse.Namespace, cfg: BagelConfig, row: dict[str, Any], peak_tflops: float) -> None:
    """The row's MFU and HFU from the forwards its warm-up step ran (``counted_flops``)."""
    if "error" in row:
        return
    counted = {(phase, grad, context): n for phase, grad, context, n in row["forwards"]["rows"]}
    flops = counted_flops(
        cfg,
        counted,
        row["forwards"]["latent_tokens"],
        kind=args.policy,
        rank=args.lora_rank,
        targets=list(DEFAULT_LORA_TARGETS),
    )
    add_mfu(row, flops, peak_tflops)


def _load_figures(dist: Dist, device: torch.device, seconds: float) -> tuple[float, dict[str, Any]]:
    """The load time (the slowest rank's), and every rank's peak host memory (resident set) and
    device memory."""
    mine = torch.tensor(
        [
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,  # KiB -> GiB
            torch.cuda.max_memory_allocated(device) / GiB if device.type == "cuda" else 0.0,
            seconds,
        ],
        dtype=torch.float64,
    )
    rows = [mine.clone() for _ in range(dist.world)]
    if dist.enabled:
        on = mine.to(device) if device.type == "cuda" else mine
        gathered = [torch.empty_like(on) for _ in range(dist.world)]
        torch.distributed.all_gather(gathered, on)
        rows = [g.cpu() for g in gathered]
    return max(float(r[2]) for r in rows), {
        "peak_host_rss_gib_per_rank": [round(float(r[0]), 2) for r in rows],
        "peak_device_gib_per_rank": [round(float(r[1]), 2) for r in rows],
    }


def write_random_checkpoint(args: argparse.Namespace) -> int:
    """A complete random checkpoint of the geometry in the published layout (ema.safetensors, a
    FLUX-geometry ae.safetensors, configs and the tiny tokenizer, whose ids every vocabulary
    holds), for the loader's figures and for whole runs of the services (bench/coordinator_gpu.sh)."""
    cfg = bagel_7b() if args.model == "7b" else tiny()
    cfg = replace(cfg, layers=args.layers or cfg.layers)
    begin = time.perf_counter()
    model = random_bagel(cfg, DTYPES[args.dtype], torch.device(args.device))
    torch.manual_seed(0)
    vae = AutoEncoder(flux_vae() if args.model == "7b" else tiny_vae())
    tokenizer, special = tiny_tokenizer()
    save_bagel_checkpoint(model, vae, args.write_checkpoint, tokenizer=tokenizer, special_tokens=special)
    size = (Path(args.write_checkpoint) / EMA_FILE).stat().st_size
    print(json.dumps({"checkpoint": args.write_checkpoint, "ema_gib": size / GiB,
                      "once_s": {"write": time.perf_counter() - begin}}), flush=True)  # fmt: skip
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flowgrpo bench trainer", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["7b", "tiny"], default="7b", help="geometry (random weights)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16", help="frozen weights (fp32: CPU smoke)")
    p.add_argument("--policy", choices=["lora", "full"], default="lora")
    p.add_argument("--lora-rank", type=int, default=64)
    p.add_argument("--lora-alpha", type=float, default=128.0)
    p.add_argument("--resolution", type=int, default=512)
    p.add_argument("--num-points", type=int, default=15)
    p.add_argument("--window", type=int, default=2, help="SDE window size (trained steps per trajectory)")
    p.add_argument("--cfg-scale", type=float, default=4.0)
    p.add_argument("--batch", type=int, default=16, help="trajectories per training step (all ranks)")
    p.add_argument("--group", type=int, default=8, help="samples per prompt")
    p.add_argument("--prompt-len", type=int, default=48, help="tokens of the first prompt (the next +8 each)")
    p.add_argument("--mini-batches", type=int, default=2, help="optimizer steps per training step")
    p.add_argument(
        "--variants",
        default="none2,none2-compile,ac8-compile",
        help="'ac<micro>' (activation checkpointing) or 'none<micro>', '-fp32': no autocast, "
        "'-everyN': checkpoint every N-th layer, '-compile'; another algorithm's step than FlowGRPO's: "
        "'-nft' (DiffusionNFT, CFG-free, --nft-fraction of the schedule's times per trajectory), "
        "'-awm', '-dgpo', '-guard' (GRPO-Guard), each as its recipe runs it",
    )
    p.add_argument(
        "--nft-fraction",
        type=float,
        default=0.99,
        help="DiffusionNFT rows: trainer.algorithm.timestep_fraction",
    )
    p.add_argument("--reps", type=repeats_arg, default=MIN_REPEATS,
                   help=f"timed steps per variant, after one warm-up (>= {MIN_REPEATS})")  # fmt: skip
    p.add_argument("--trajectories", choices=["sampler", "random"], default="sampler")
    p.add_argument(
        "--profile", action="store_true", help="each variant: one more step under torch.profiler, by kind"
    )
    p.add_argument("--no-publish", dest="publish", action="store_false")
    p.add_argument("--publish-reps", type=repeats_arg, default=MIN_REPEATS,
                   help=f"timed publications per path, after one warm-up (>= {MIN_REPEATS})")  # fmt: skip
    p.add_argument("--store-gib", type=int, default=8, help="the bus store's capacity")
    p.add_argument("--deadline-s", type=float, default=1e9, help="skip what would start after this")
    p.add_argument("--json", metavar="PATH", help="write every figure as JSON (rewritten as rows come in)")
    p.add_argument(
        "--compile", action="store_true", help="sharded runs: compile the query path (variants '-compile')"
    )
    p.add_argument("--checkpoint", metavar="DIR", help="load this checkpoint through the trainer's loader")
    p.add_argument(
        "--checkpoint-every-step",
        metavar="DIR",
        help="also time a step followed by its checkpoint in DIR, without, synchronous and asynchronous "
        "(trainer.async_save), with the first --variants row (trainer_checkpoint.py)",
    )
    p.add_argument("--write-checkpoint", metavar="DIR", help="write a random checkpoint of --model and exit")
    p.add_argument("--layers", type=int, default=0, metavar="N",
                   help="--write-checkpoint: N decoder layers (each of the geometry's shapes)")  # fmt: skip
    return p


# --- printing ---------------------------------------------------------------------------------------


def _row_line(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"{row['variant']}: {row['error']}"
    return (
        f"{row['variant']}: {row['traj_per_s_per_gpu']:.2f}, step {row['step_s']:.2f} "
        f"(logp_old {row['old_log_prob_s']:.2f}, update {row['update_s']:.2f}), "
        f"peak {row.get('peak_gib', math.nan):.1f} GiB, sync gap {row['sync_logp_gap_max']:.2e}"
        + (f", MFU step {row['mfu_step']:.1%} (update {row['mfu_update']:.1%})" if "mfu_step" in row else "")
    )


TABLE = (  # header, the row's key, the format of its median and range (None: a plain value)
    ("variant", "variant", None),
    ("traj/s/GPU", "traj_per_s_per_gpu", ".2f"),
    ("step s", "step_s", ".2f"),
    ("logp_old s", "old_log_prob_s", ".2f"),
    ("MFU logp_old", "mfu_old_log_prob", ".1%"),
    ("update s", "update_s", ".2f"),
    ("MFU update", "mfu_update", ".1%"),
    ("HFU update", "hfu_update", ".1%"),
    ("MFU step", "mfu_step", ".1%"),
    ("peak GiB", "peak_gib", ".1f"),
    ("sync gap", "sync_logp_gap_max", ".1e"),
)


def _cell(value: Any, spec: str | None) -> str:
    if spec is None:
        return str(value)
    return value.brief(spec) if hasattr(value, "brief") else format(value, spec)


def _print_table(report: dict[str, Any]) -> None:
    a, peak = report["args"], report["matmul_peak"]
    print(
        f"\n{report['device']} x{report['world']}, torch {report['torch']}, peft {report.get('peft')}, "
        f"{peak.line()} (measured in this run; MFU against {peak.used:.4g})\n"
        f"{a['model']} {a['policy']} (r {a['lora_rank']}, alpha {a['lora_alpha']}), {a['resolution']}px, "
        f"CFG {a['cfg_scale']}, window {a['window']}, {a['num_points']} points, {a['batch']} trajectories, "
        f"{a['mini_batches']} optimizer steps per step; model {report.get('model_gib', math.nan):.1f} GiB; "
        f"median (min-max) of {a['reps']} steps after a warm-up"
    )
    print(" | ".join(name for name, _, _ in TABLE))
    for r in report["rows"]:
        if "error" in r:
            print(f"{r['variant']} | {r['error'][:160]}")
        else:
            # a DiffusionNFT row has no log-prob pass ("-"): its old-policy forwards are in its update
            print(" | ".join(_cell(r[key], spec) if key in r else "-" for _, key, spec in TABLE))
    if report.get("publication"):
        print("publication:", json.dumps(_publication_medians(report["publication"])))
    if report.get("checkpoint_every_step"):
        c = report["checkpoint_every_step"]
        print(
            f"a checkpoint every step ({c['variant']}, {c['checkpoint_bytes'] / 2**20:.1f} MiB each): "
            f"step alone {c['none']['cycle_s']:.3f}; sync: cycle {c['sync']['cycle_s']:.3f}, "
            f"{c['sync']['cycle_over_none']:.3f} of the step; async: cycle {c['async']['cycle_s']:.3f}, "
            f"{c['async']['cycle_over_none']:.3f} of the step, blocking {c['async']['save_s']:.3f}"
        )


def _publication_medians(figures: dict[str, Any]) -> dict[str, Any]:
    """The publication figures with each timing as its median (the JSON has the ranges)."""
    medians: dict[str, Any] = {}
    for key, value in figures.items():
        if isinstance(value, dict):
            medians[key] = _publication_medians(value)
        else:
            medians[key] = getattr(value, "median", value)
    return medians


if __name__ == "__main__":
    raise SystemExit(main())
