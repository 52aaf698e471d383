"""FlowGRPO trainer step throughput, MFU, memory and weight publication (``flowgrpo bench trainer``).

The real 7B geometry with random bf16 weights (meta device, ``to_empty``, ``init_weights``: no
checkpoint needed), the policy of the recipe (LoRA r 64 / alpha 128 on the default gen-path
targets, fp32 A/B and AdamW state; or ``--policy full``: every ``moe_gen`` parameter in fp32,
sharded with FSDP2 when started under torchrun), 512px (1024 latent tokens), text CFG 4, an SDE
window of 2 steps on a 15-point schedule. The batch is drawn by ``BagelSampler.generate`` with
the same model (so the logp_old recompute is measured against real behaviour log-probs), moved
to the host as the service receives it, then trained by ``FlowGRPOStep.run``: one logp_old
recompute pass (no gradients) and ``mini_batches`` optimizer steps over micro-batches.

Each configuration (micro-batch size, activation checkpointing on/off, LoRA matmuls in bf16
autocast or in fp32) runs one warm-up step (its rollout/trainer log-prob gap is the sync-mode
gap: the policy is reset to the sampled weights first) and ``--reps`` timed steps; reported:
trajectories/s (= images/s; per GPU), the two passes' times, MFU of each, peak memory.

FLOPs (SPEC section 7, matmuls actually executed), per row = one CFG branch of one trajectory at
one window step, T = N + 2 query tokens, K = T + the row's context (prompt length; 0 for the
empty text-unconditional context), P = gen-expert matmul parameters (6.525e9), L layers,
r = LoRA rank, S = sum over the adapted modules of one layer of (in + out):

- forward            F  = 2 P T + 4 T K d H L  (the SPEC count) + 2 T r S L  (the LoRA matmuls);
- activation grads   Fa = 2 T (P - P_qkv0) + 2 x 4 T K d H L (dQ, dK, dV: four matmuls the size of
                         the forward's two) + LoRA: 2 T r S L - 2 T r S_qkv (layer 0's q/k/v take
                         an input without gradient: no dX there, for the base or the LoRA A);
- weight grads       Fw = 2 T r S L (LoRA dA, dB) | 2 T P (full gen path).

logp_old pass: rows x F; update pass: rows x (F + Fa + Fw); rows = trajectories x 2 (CFG) x W.
The recompute of activation checkpointing (the forward's matmuls without attention, again) and
the prompt prefill are not counted (``hfu`` adds the recompute). MFU = FLOPs / time / the bf16
matmul peak measured in this run (8192^3).

Publication: the trainable tensors gathered and published into a bus TensorStore exactly as the
service does (``publish``: one shared-memory segment per tensor), fetched by a consumer in
another process (shared memory, then to its GPU), and, for comparison, one pinned bucket copy.
Without pyzmq / OpenTelemetry (the bus needs them) only the gather and host copies are timed.

``--model tiny --device cpu`` runs every code path on the tiny model in seconds (a smoke test;
its figures mean nothing).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from flowgrpo.models.bagel.checkpoint import EMA_FILE, save_bagel_checkpoint, tiny_tokenizer
from flowgrpo.models.bagel.config import BagelConfig, SpecialTokens, bagel_7b, flux_vae, tiny, tiny_vae
from flowgrpo.models.bagel.model import BagelModel
from flowgrpo.models.bagel.parallelize import (
    checkpoint_query_layers,
    compile_query_layers,
    parallelize_bagel,
    uncheckpoint_query_layers,
    uncompile_query_layers,
)
from flowgrpo.models.bagel.sampling import BagelSampler, SampleRequest, token_grid
from flowgrpo.models.bagel.vae import AutoEncoder
from flowgrpo.sampler_math import shifted_schedule
from flowgrpo.sampler_params import SamplerParams
from flowgrpo.services.bench.rollout import (
    SPECIAL_7B,
    SPECIAL_TINY,
    gen_matmul_params,
    matmul_peak_tflops,
    random_bagel,
    sync,
)
from flowgrpo.services.trainer.config import (
    DEFAULT_LORA_TARGETS,
    LossConfig,
    OptimConfig,
    PolicyConfig,
)
from flowgrpo.services.trainer.distributed import Dist, close_distributed, init_distributed
from flowgrpo.services.trainer.load import load_policy
from flowgrpo.services.trainer.policy import TrainablePolicy
from flowgrpo.services.trainer.step import FlowGRPOStep, Trajectory, compute_autocast

GiB = 1 << 30


# --- FLOPs (SPEC section 7) -------------------------------------------------------------------


def module_shapes(cfg: BagelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of every gen-path linear of one layer, by LoRA target name."""
    q_dim, kv_dim = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    return {
        "self_attn.q_proj_moe_gen": (cfg.hidden, q_dim),
        "self_attn.k_proj_moe_gen": (cfg.hidden, kv_dim),
        "self_attn.v_proj_moe_gen": (cfg.hidden, kv_dim),
        "self_attn.o_proj_moe_gen": (q_dim, cfg.hidden),
        "mlp_moe_gen.gate_proj": (cfg.hidden, cfg.intermediate),
        "mlp_moe_gen.up_proj": (cfg.hidden, cfg.intermediate),
        "mlp_moe_gen.down_proj": (cfg.intermediate, cfg.hidden),
    }


QKV = ("self_attn.q_proj_moe_gen", "self_attn.k_proj_moe_gen", "self_attn.v_proj_moe_gen")


def lora_parameters(cfg: BagelConfig, rank: int, targets: list[str]) -> int:
    shapes = module_shapes(cfg)
    return cfg.layers * rank * sum(sum(shapes[t]) for t in targets)


@dataclass(frozen=True)
class RowFlops:
    """FLOPs of one row (one CFG branch of one trajectory at one window step)."""

    forward: float  # F: base + attention + LoRA forward matmuls
    act_grad: float  # Fa
    weight_grad: float  # Fw
    recompute: float  # activation checkpointing's second forward (no attention), not in MFU


def row_flops(
    cfg: BagelConfig, latent_tokens: int, context: int, *, kind: str, rank: int, targets: list[str]
) -> RowFlops:
    t = latent_tokens + 2
    k = context + t
    p = gen_matmul_params(cfg)
    shapes = module_shapes(cfg)
    p_qkv = sum(shapes[m][0] * shapes[m][1] for m in QKV)
    attn = 4.0 * t * k * cfg.head_dim * cfg.heads * cfg.layers
    lora_s = sum(sum(shapes[m]) for m in targets) if kind == "lora" else 0
    lora_s_qkv = sum(shapes[m][0] for m in targets if m in QKV) if kind == "lora" else 0  # A's input dims
    lora = 2.0 * t * rank * lora_s * cfg.layers
    forward = 2.0 * p * t + attn + lora
    act = 2.0 * t * (p - p_qkv) + 2.0 * attn + (lora - 2.0 * t * rank * lora_s_qkv)
    weight = lora if kind == "lora" else 2.0 * p * t
    return RowFlops(forward, act, weight, recompute=2.0 * p * t + lora)


def pass_flops(
    cfg: BagelConfig,
    latent_tokens: int,
    prompt_lengths: list[int],
    window: int,
    *,
    kind: str,
    rank: int,
    targets: list[str],
) -> dict[str, float]:
    """FLOPs of one training step over trajectories whose prompts have ``prompt_lengths`` tokens:
    both CFG branches (conditional: the prompt as context; unconditional: none) at every window step."""
    old = update = recompute = 0.0
    for length in prompt_lengths:
        for context in (length, 0):
            f = row_flops(cfg, latent_tokens, context, kind=kind, rank=rank, targets=targets)
            old += window * f.forward
            update += window * (f.forward + f.act_grad + f.weight_grad)
            recompute += window * f.recompute
    return {"old": old, "update": update, "recompute": recompute}


# --- batch --------------------------------------------------------------------------------------


def make_requests(batch: int, group: int, prompt_len: int, special: SpecialTokens) -> list[SampleRequest]:
    """``batch`` samples, ``group`` per prompt; prompt j has prompt_len + 8 j tokens."""
    g = torch.Generator().manual_seed(0)
    out = []
    for j in range(math.ceil(batch / group)):
        body = torch.randint(0, special.im_start, (prompt_len + 8 * j - 2,), generator=g)
        ids = torch.cat([torch.tensor([special.im_start]), body, torch.tensor([special.im_end])])
        out += [SampleRequest(f"p{j}", s, ids) for s in range(min(group, batch - j * group))]
    return out


def sampled_batch(
    model: BagelModel, special: SpecialTokens, requests: list[SampleRequest], params: SamplerParams
) -> list[Trajectory]:
    """Trajectories drawn by the sampler with ``model`` (host tensors, as the service gets them)."""
    sampler = BagelSampler(model, None, special)
    with compute_autocast(model):
        out = sampler.generate(requests, params, seed=0, step=0)
    g = torch.Generator().manual_seed(1)
    advantages = torch.randn(len(requests), generator=g).clamp(-5, 5).tolist()
    return [
        Trajectory(
            r.prompt_uid,
            r.sample_index,
            0,
            a,
            r.prompt_ids,
            out.latents[i].cpu(),
            out.log_probs[i].cpu(),
            out.sigmas[i].cpu(),
        )
        for i, (r, a) in enumerate(zip(requests, advantages, strict=True))
    ]


def random_batch(cfg: BagelConfig, requests: list[SampleRequest], params: SamplerParams) -> list[Trajectory]:
    """Random latents at a fixed window (begin 3) and zero behaviour log-probs: enough for timing."""
    g = torch.Generator().manual_seed(2)
    rows, cols = token_grid(params)
    schedule = shifted_schedule(params.num_points, params.timestep_shift)
    w = params.window_size
    out = []
    for r in requests:
        latents = torch.randn(w + 1, rows * cols, cfg.latent_token_dim, generator=g)
        a = float(torch.randn((), generator=g).clamp(-5, 5))
        out.append(
            Trajectory(
                r.prompt_uid,
                r.sample_index,
                0,
                a,
                r.prompt_ids,
                latents,
                torch.zeros(w),
                schedule[3 : 4 + w].clone(),
            )
        )
    return out


# --- configurations -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    name: str
    micro: int
    checkpointing: bool
    autocast: bool = True
    addmm: bool = False  # an experiment, not the trainer's path: see addmm_lora
    compile: bool = False  # the query path compiled (compile_query_layers), under autograd


def parse_variants(text: str) -> list[Variant]:
    """'ac4,ac8,none2,ac4-fp32' -> variants: activation checkpointing ('ac') or not ('none'), the
    micro-batch size, '-fp32': LoRA matmuls in fp32 (no autocast: peft's own dtype handling),
    '-addmm': the experiment of :func:`addmm_lora`, '-compile': the query path compiled."""
    out = []
    for item in filter(None, text.split(",")):
        head, *flags = item.split("-")
        ac = head.startswith("ac")
        micro = int(head.removeprefix("ac").removeprefix("none"))
        out.append(
            Variant(item, micro, ac, "fp32" not in flags, addmm="addmm" in flags, compile="compile" in flags)
        )
    return out


def addmm_lora(model: torch.nn.Module) -> list[torch.nn.Module]:
    """EXPERIMENT (bench only): every peft LoRA Linear computes base(x) + s B (A x) as
    addmm(base(x), A x, B^T, alpha=s), one GEMM whose epilogue adds the base output, instead of
    peft's B output, its scaling and the add as three passes over [tokens, out] (autocast only).
    Returns the patched layers; deleting their instance ``forward`` undoes it."""
    import torch.nn.functional as F
    from peft.tuners.lora.layer import Linear as LoraLinear

    patched: list[torch.nn.Module] = []
    for layer in model.modules():
        if not isinstance(layer, LoraLinear):
            continue

        def forward(x: Tensor, *args: Any, _layer: Any = layer, **kwargs: Any) -> Tensor:
            result: Tensor = _layer.base_layer(x, *args, **kwargs)
            if _layer.disable_adapters or _layer.merged:
                return result
            name = _layer.active_adapters[0]
            h = F.linear(x, _layer.lora_A[name].weight)
            flat = result.reshape(-1, result.shape[-1])
            b = _layer.lora_B[name].weight
            out = torch.addmm(flat, h.reshape(-1, h.shape[-1]), b.t(), alpha=_layer.scaling[name])
            return out.view(result.shape)

        vars(layer)["forward"] = forward
        patched.append(layer)
    return patched


def timed_step(
    trainer: FlowGRPOStep, batch: list[Trajectory], params: SamplerParams, device: torch.device
) -> dict[str, float]:
    """One ``FlowGRPOStep.run`` on a sync batch (policy_version = the trainer's version), timed
    on the wall clock with the device synchronised; its metrics plus ``wall_s`` and peak memory."""
    batch = [replace(t, policy_version=trainer.version) for t in batch]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sync(device)
    begin = time.perf_counter()
    metrics: dict[str, float] = trainer.run(batch, params)
    sync(device)
    metrics["wall_s"] = time.perf_counter() - begin
    if device.type == "cuda":
        metrics["peak_gib"] = torch.cuda.max_memory_allocated(device) / GiB
    return metrics


def measure_variant(  # noqa: PLR0917
    variant: Variant,
    policy: TrainablePolicy,
    initial: dict[str, Tensor] | None,
    batch: list[Trajectory],
    params: SamplerParams,
    args: argparse.Namespace,
    special: SpecialTokens,
    dist: Dist,
    flops: dict[str, float],
    peak_tflops: float,
) -> dict[str, Any]:
    device = policy.model.vae2llm.weight.device
    model = policy.model
    row: dict[str, Any] = {
        "variant": variant.name,
        "micro_batch": variant.micro,
        "checkpointing": variant.checkpointing,
        "autocast": variant.autocast,
    }
    if dist.enabled and not variant.checkpointing:  # applied once, before sharding (main)
        return row | {"error": "skipped: sharded runs always use activation checkpointing"}
    if dist.enabled and variant.compile != args.compile:
        return row | {"error": "skipped: sharded runs compile (--compile) or not, before sharding"}
    if not dist.enabled:  # compile first, checkpoint around it (the order load_policy applies)
        uncheckpoint_query_layers(model)
        uncompile_query_layers(model)
        if variant.compile:
            compile_query_layers(model)
        if variant.checkpointing:
            checkpoint_query_layers(model)
    row["compiled"] = variant.compile
    if initial is not None:  # back to the sampled weights: the warm-up step is a sync step
        policy.load_published(initial)
    loss = LossConfig(mini_batches=args.mini_batches, micro_batch_size=variant.micro)
    trainer = FlowGRPOStep(policy, special, OptimConfig(), loss, dist)
    trainer.mixed_precision = variant.autocast
    runs: list[dict[str, float]] = []
    patched = addmm_lora(model) if variant.addmm else []
    try:
        warm = timed_step(trainer, batch, params, device)
        row["warmup_s"] = warm["wall_s"]
        row["sync_logp_gap_max"] = warm.get("actor/rollout_logp_gap/max", math.nan)
        row["sync_logp_gap_mean"] = warm.get("actor/rollout_logp_gap/mean", math.nan)
        runs = [timed_step(trainer, batch, params, device) for _ in range(args.reps)]
    except torch.OutOfMemoryError as e:
        row["error"] = "out of memory: " + str(e).splitlines()[0][:300]
    except Exception as e:  # report it and go on with the next variant
        row["error"] = repr(e)[:1000]
    for layer in patched:
        vars(layer).pop("forward", None)
    trainer.optimizer.zero_grad(set_to_none=True)
    del trainer
    if "error" in row:
        _free(device)
        return row
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0] if isinstance(runs[0][k], float)}
    world = dist.world
    step_s, old_s, update_s = med["wall_s"], med["timing_s/old_log_prob"], med["timing_s/update_actor"]
    peak = peak_tflops * 1e12
    per_gpu = {k: v / world for k, v in flops.items()}  # every rank runs 1/world of the rows
    row |= {
        "trajectories": len(batch),
        "step_s": step_s,
        "old_log_prob_s": old_s,
        "update_s": update_s,
        "traj_per_s_per_gpu": len(batch) / step_s / world,
        "mfu_old_log_prob": per_gpu["old"] / old_s / peak,
        "mfu_update": per_gpu["update"] / update_s / peak,
        "mfu_step": (per_gpu["old"] + per_gpu["update"]) / step_s / peak,
        "hfu_update": (per_gpu["update"] + (per_gpu["recompute"] if variant.checkpointing else 0))
        / update_s
        / peak,
        "peak_gib": max(r.get("peak_gib", math.nan) for r in runs),
        "loss": med.get("actor/pg_loss", math.nan),
        "grad_norm": med.get("actor/grad_norm", math.nan),
        "step_s_all": [r["wall_s"] for r in runs],
    }
    return row


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


# --- publication -----------------------------------------------------------------------------------


def measure_publication(policy: TrainablePolicy, dist: Dist, args: argparse.Namespace) -> dict[str, Any]:
    """The gather alone, then each publication path as the service runs it (``Publisher``) and a
    consumer in another process taking the update as a rollout would (bus: fetch, then to its
    GPU; CUDA IPC: open the bucket, copy device to device onto its GPU)."""
    out: dict[str, Any] = {}
    reps = args.publish_reps
    device = next(iter(policy.trainable().values())).device

    def gather() -> None:
        for _, tensor in policy.iter_published():  # a collective under FSDP: every rank iterates
            del tensor
        sync(device)

    out["gather_s"] = _median(gather, reps)
    specs = policy.published_specs()
    out["tensors"] = len(specs)
    out["bytes_fp32"] = sum(shape.numel() * 4 for _, shape, _ in specs)
    try:
        from flowgrpo.bus import BusConfig, serve_store
        from flowgrpo.services.trainer.publish import Publisher
    except ImportError as e:
        out["bus"] = f"not measured: the bus needs pyzmq and OpenTelemetry ({e})"
        return out
    cases = [("bus", "bfloat16")] if policy.kind == "full" else [("bus", ""), ("bus", "bfloat16")]
    if device.type == "cuda":
        cases.append(("cuda_ipc", "bfloat16"))
    config = BusConfig(max_bytes=args.store_gib * GiB, transport="ipc")
    server = serve_store(config) if dist.rank == 0 else None
    version = 100
    try:
        for path, dtype in cases:
            publisher = Publisher(policy, server.store if server is not None else None, dtype,
                                  bus=path == "bus", cuda_ipc=path == "cuda_ipc")  # fmt: skip
            times, update = [], None
            for _ in range(reps):
                version += 1
                begin = time.perf_counter()
                update = publisher.publish(version)
                sync(device)
                times.append(time.perf_counter() - begin)
            key = f"{path}_{dtype or 'fp32'}"
            out[f"{key}_publish_s"] = statistics.median(times)
            if server is not None and update is not None:
                out[f"{key}_consumer"] = _consume_in_child(update.SerializeToString(), config)
            if dist.enabled:
                torch.distributed.barrier()  # rank 0's consumer is done before the next case gathers
            publisher.close()
    finally:
        if server is not None:
            server.close()
    return out


def _median(fn: Any, reps: int) -> float:
    times = []
    for _ in range(reps):
        begin = time.perf_counter()
        fn()
        times.append(time.perf_counter() - begin)
    return statistics.median(times)


def _consume_in_child(update: bytes, config: Any) -> dict[str, Any]:
    """A consumer in another process takes every tensor of ``update`` onto its GPU (the last
    one), as a rollout does before applying it: over the bus (shared memory on this host) or
    from the CUDA IPC bucket."""
    with tempfile.NamedTemporaryFile(suffix=".pb", delete=False) as f:
        f.write(update)
    try:
        done = subprocess.run(
            [sys.executable, "-c", _FETCH_CHILD, f.name, config.transport],
            capture_output=True,
            text=True,
            timeout=150,
            env=dict(os.environ),
        )
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
        if done.returncode or not lines:
            return {"error": (done.stderr or done.stdout)[-1000:]}
        result: dict[str, Any] = json.loads(lines[-1])
        return result
    except subprocess.TimeoutExpired:
        return {"error": "timed out after 150 s"}
    finally:
        os.unlink(f.name)


# The consumer: the bus client and torch only (no peft / trainer imports to wait for).
_FETCH_CHILD = """
import json, sys, time
from pathlib import Path
import torch
from flowgrpo.v1 import common_pb2

update = common_pb2.WeightUpdate.FromString(Path(sys.argv[1]).read_bytes())
device = torch.device("cuda", torch.cuda.device_count() - 1) if torch.cuda.is_available() else None
if device is not None:
    torch.zeros(1, device=device)  # the CUDA context before the clock
out = {}
begin = time.perf_counter()
if update.cuda_ipc:
    from flowgrpo.bus.cuda_ipc import open_bucket
    views = [v for b in update.cuda_ipc for v in open_bucket(b).values()]
    out["open_s"] = time.perf_counter() - begin
    tensors = [v.to(device, copy=True) for v in views]
    torch.cuda.synchronize(device)
else:
    from flowgrpo.bus import BusClient, BusConfig, TensorRef
    from flowgrpo.bus.torch_tensors import to_torch
    with BusClient(BusConfig(transport=sys.argv[2])) as client:
        tensors = [to_torch(f) for f in client.fetch([TensorRef.from_proto(t.ref) for t in update.tensors])]
        out["fetch_s"] = time.perf_counter() - begin
        if device is not None:
            tensors = [t.to(device) for t in tensors]
            torch.cuda.synchronize(device)
out["total_s"] = time.perf_counter() - begin
out["bytes"] = sum(t.numel() * t.element_size() for t in tensors)
out["tensors"] = len(tensors)
out["device"] = str(device)
print(json.dumps(out))
"""


# --- the run -----------------------------------------------------------------------------------------


def _load_figures(dist: Dist, device: torch.device, seconds: float) -> dict[str, Any]:
    """Load time, and every rank's peak host memory (resident set) and device memory."""
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
    return {
        "load_s": max(float(r[2]) for r in rows),
        "peak_host_rss_gib_per_rank": [round(float(r[0]), 2) for r in rows],
        "peak_device_gib_per_rank": [round(float(r[1]), 2) for r in rows],
    }


def write_random_checkpoint(args: argparse.Namespace) -> int:
    """A complete random checkpoint of the geometry in the published layout (ema.safetensors, a
    FLUX-geometry ae.safetensors, configs and the tiny tokenizer, whose ids every vocabulary
    holds), for the loader's figures and for whole runs of the services (bench/coordinator_gpu.sh)."""
    cfg = bagel_7b() if args.model == "7b" else tiny()
    device = torch.device(args.device)
    begin = time.perf_counter()
    model = random_bagel(cfg, {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype], device)
    torch.manual_seed(0)
    vae = AutoEncoder(flux_vae() if args.model == "7b" else tiny_vae())
    tokenizer, special = tiny_tokenizer()
    save_bagel_checkpoint(model, vae, args.write_checkpoint, tokenizer=tokenizer, special_tokens=special)
    size = (Path(args.write_checkpoint) / EMA_FILE).stat().st_size
    print(json.dumps({"checkpoint": args.write_checkpoint, "ema_gib": size / GiB,
                      "write_s": time.perf_counter() - begin}), flush=True)  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:  # noqa: PLR0915
    args = _parser().parse_args(argv)
    if args.write_checkpoint:
        return write_random_checkpoint(args)
    started = time.perf_counter()
    dist = init_distributed(args.device)
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print(
                "flowgrpo bench trainer needs a CUDA device (or --model tiny --device cpu for a smoke test)"
            )
            return 2
        device = torch.device("cuda", torch.cuda.current_device())
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 matmuls stay fp32 (the "-fp32" variant)
    torch.backends.cudnn.allow_tf32 = False
    rank0 = dist.rank == 0
    say = print if rank0 else (lambda *a, **k: None)
    report: dict[str, Any] = {
        "args": vars(args),
        "torch": torch.__version__,
        "world": dist.world,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }
    try:
        import peft

        report["peft"] = peft.__version__
    except ImportError:
        pass
    report["matmul_peak_tflops"] = matmul_peak_tflops(device, 8192 if device.type == "cuda" else 512)
    say(
        f"{report['device']} x{dist.world}: bf16 matmul peak {report['matmul_peak_tflops']:.0f} TFLOP/s",
        flush=True,
    )

    seven_b = args.model == "7b"
    cfg = bagel_7b() if seven_b else tiny()
    special = SPECIAL_7B if seven_b else SPECIAL_TINY
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    begin = time.perf_counter()
    policy_cfg = PolicyConfig(kind=args.policy, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha)
    if args.checkpoint:  # the trainer's loader: meta device, FSDP2, each rank reads its rows
        policy = load_policy(
            args.checkpoint,
            policy_cfg,
            dist,
            dtype=dtype,
            device=str(device),
            param_dtype=dtype,
            activation_checkpointing=dist.enabled,
            compile=dist.enabled and args.compile,
        )
        report["load"] = _load_figures(dist, device, time.perf_counter() - begin)
        say("loaded through the trainer's loader:", json.dumps(report["load"]), flush=True)
    else:
        policy = TrainablePolicy(random_bagel(cfg, dtype, device), policy_cfg)
        if dist.enabled:  # compile, checkpoint, then shard: FSDP's hooks around the recompute
            mesh = dist.mesh(args.device)
            parallelize_bagel(
                policy.model, mesh, compile=args.compile, activation_checkpointing=True, param_dtype=dtype
            )
    sync(device)
    report["build_s"] = time.perf_counter() - begin
    trainable = sum(p.numel() for p in policy.trainable().values())  # a DTensor's numel is global
    report["trainable_params"] = trainable
    if args.policy == "lora":
        report["lora_params_formula"] = lora_parameters(cfg, args.lora_rank, list(DEFAULT_LORA_TARGETS))
    if device.type == "cuda":
        report["model_gib"] = torch.cuda.memory_allocated(device) / GiB
    say(f"model built in {report['build_s']:.1f} s, {trainable / 1e6:.1f}M trainable parameters", flush=True)

    side = args.resolution
    params = SamplerParams(
        num_points=args.num_points,
        height=side,
        width=side,
        decode_images=False,
        cfg_text_scale=args.cfg_scale,
        window_size=args.window,
        window_range=(0, min(7, args.num_points - 1)),
    )
    requests = make_requests(args.batch, args.group, args.prompt_len, special)
    begin = time.perf_counter()
    if args.trajectories == "sampler":
        batch = sampled_batch(policy.model, special, requests, params)
    else:
        batch = random_batch(cfg, requests, params)
    sync(device)
    report["rollout_s"] = time.perf_counter() - begin
    say(f"{len(batch)} trajectories ({args.trajectories}) in {report['rollout_s']:.1f} s", flush=True)

    n_tokens = (side // 16) ** 2
    targets = list(DEFAULT_LORA_TARGETS)
    flops = pass_flops(
        cfg,
        n_tokens,
        [t.prompt_ids.numel() for t in batch],
        args.window,
        kind=args.policy,
        rank=args.lora_rank,
        targets=targets,
    )
    report["flops"] = flops
    report["spec_step_flops_per_sample"] = (
        row_flops(cfg, n_tokens, args.prompt_len, kind="lora", rank=0, targets=[]).forward
        + row_flops(cfg, n_tokens, 0, kind="lora", rank=0, targets=[]).forward
    )
    initial = None
    if args.policy == "lora":
        initial = {n: t.detach().clone() for n, t in policy.published().items()}
    report["rows"] = []
    for variant in parse_variants(args.variants):
        if time.perf_counter() - started > args.deadline_s:
            say(f"deadline: {variant.name} not measured", flush=True)
            report["rows"].append({"variant": variant.name, "error": "skipped: deadline"})
            continue
        row = measure_variant(
            variant, policy, initial, batch, params, args, special, dist, flops, report["matmul_peak_tflops"]
        )
        if dist.enabled and "peak_gib" in row:
            peaks: list[Any] = [None] * dist.world
            torch.distributed.all_gather_object(peaks, row["peak_gib"])
            row["peak_gib_per_rank"] = peaks
        report["rows"].append(row)
        say(_row_line(row), flush=True)
        if rank0:
            _write(args.json, report)
    if not dist.enabled:
        uncheckpoint_query_layers(policy.model)
    if args.publish and time.perf_counter() - started < args.deadline_s:
        _free(device)
        report["publication"] = measure_publication(policy, dist, args)
        say("publication:", json.dumps(report["publication"]), flush=True)
    if rank0:
        _write(args.json, report)
        _print_table(report)
    close_distributed()
    return 0


def _row_line(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"{row['variant']}: {row['error']}"
    return (
        f"{row['variant']}: {row['traj_per_s_per_gpu']:.2f} traj/s/GPU, step {row['step_s']:.2f} s "
        f"(logp_old {row['old_log_prob_s']:.2f} s MFU {row['mfu_old_log_prob']:.1%}, update "
        f"{row['update_s']:.2f} s MFU {row['mfu_update']:.1%}), step MFU {row['mfu_step']:.1%}, "
        f"peak {row.get('peak_gib', math.nan):.1f} GiB, sync gap {row['sync_logp_gap_max']:.2e}"
    )


TABLE = (
    ("variant", "{variant}"),
    ("traj/s/GPU", "{traj_per_s_per_gpu:.2f}"),
    ("step s", "{step_s:.2f}"),
    ("logp_old s", "{old_log_prob_s:.2f}"),
    ("MFU logp_old", "{mfu_old_log_prob:.1%}"),
    ("update s", "{update_s:.2f}"),
    ("MFU update", "{mfu_update:.1%}"),
    ("HFU update", "{hfu_update:.1%}"),
    ("MFU step", "{mfu_step:.1%}"),
    ("peak GiB", "{peak_gib:.1f}"),
    ("sync gap", "{sync_logp_gap_max:.1e}"),
)


def _print_table(report: dict[str, Any]) -> None:
    a = report["args"]
    print(
        f"\n{report['device']} x{report['world']}, torch {report['torch']}, peft {report.get('peft')}, "
        f"bf16 matmul peak {report['matmul_peak_tflops']:.0f} TFLOP/s (measured in this run)\n"
        f"{a['model']} {a['policy']} (r {a['lora_rank']}, alpha {a['lora_alpha']}), {a['resolution']}px, "
        f"CFG {a['cfg_scale']}, window {a['window']}, {a['num_points']} points, {a['batch']} trajectories, "
        f"{a['mini_batches']} optimizer steps per step; model {report.get('model_gib', math.nan):.1f} GiB"
    )
    print(" | ".join(name for name, _ in TABLE))
    for r in report["rows"]:
        if "error" in r:
            print(f"{r['variant']} | {r['error'][:160]}")
        else:
            print(" | ".join(fmt.format(**r) for _, fmt in TABLE))
    pub = report.get("publication")
    if pub:
        print("publication:", json.dumps(pub))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flowgrpo bench trainer", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["7b", "tiny"], default="7b", help="geometry (random weights)")
    p.add_argument("--device", default="cuda")
    p.add_argument(
        "--dtype", choices=["bf16", "fp32"], default="bf16", help="frozen weights (fp32: CPU smoke)"
    )
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
        help="'ac<micro>' (activation checkpointing) or 'none<micro>', '-fp32': no autocast",
    )
    p.add_argument("--reps", type=int, default=2, help="timed steps per variant (after one warm-up)")
    p.add_argument("--trajectories", choices=["sampler", "random"], default="sampler")
    p.add_argument("--no-publish", dest="publish", action="store_false")
    p.add_argument("--publish-reps", type=int, default=3)
    p.add_argument("--store-gib", type=int, default=8, help="the bus store's capacity")
    p.add_argument("--deadline-s", type=float, default=1e9, help="skip what would start after this")
    p.add_argument("--json", metavar="PATH", help="write every figure as JSON (rewritten as rows come in)")
    p.add_argument(
        "--compile", action="store_true", help="sharded runs: compile the query path (variants '-compile')"
    )
    p.add_argument("--checkpoint", metavar="DIR", help="load this checkpoint through the trainer's loader")
    p.add_argument("--write-checkpoint", metavar="DIR", help="write a random checkpoint of --model and exit")
    return p


def _write(path: str | None, report: dict[str, Any]) -> None:
    if path:
        Path(path).write_text(json.dumps(report, indent=2, default=str) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
