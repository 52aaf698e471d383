"""The trainer benchmark's batch and its step configurations (``flowgrpo bench trainer``): each
variant (micro-batch size, activation checkpointing, autocast, compile) runs one warm-up step,
whose rollout/trainer log-prob gap is the sync-mode gap, then ``--reps`` (>= 3) timed steps."""

from __future__ import annotations

import contextlib
import math
import statistics
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from flowgrpo.configs.trainer import AwmConfig, DgpoConfig, LossConfig, NftConfig, TrainerConfig
from flowgrpo.models.bagel.attention import KVCache
from flowgrpo.models.bagel.config import GEN_PATH_LINEARS, BagelConfig, SpecialTokens
from flowgrpo.models.bagel.fp8 import Fp8FrozenLinear, check_fp8_device
from flowgrpo.models.bagel.model import BagelModel
from flowgrpo.models.bagel.parallelize import (
    checkpoint_query_layers,
    checkpointed_layers,
    compile_query_layers,
    uncheckpoint_query_layers,
    uncompile_query_layers,
)
from flowgrpo.models.bagel.sampling import BagelSampler, SampleRequest, compute_autocast, token_grid
from flowgrpo.sampler_math import shifted_schedule
from flowgrpo.sampler_params import SamplerParams
from flowgrpo.services.bench.common import GiB, free, mfu
from flowgrpo.services.bench.kernels import kernel_profile
from flowgrpo.services.bench.stats import Figure, Runs, run_timed
from flowgrpo.services.trainer.distributed import Dist
from flowgrpo.services.trainer.policy import TrainablePolicy
from flowgrpo.services.trainer.step import TrainStep, Trajectory

# --- batch --------------------------------------------------------------------------------------


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
            out.final_latents[i].cpu(),
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
        sigmas = schedule[3 : 4 + w].clone()
        out.append(
            Trajectory(
                r.prompt_uid,
                r.sample_index,
                0,
                a,
                r.prompt_ids,
                latents,
                torch.zeros(w),
                sigmas,
                torch.randn(rows * cols, cfg.latent_token_dim, generator=g),
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
    # the step's algorithm (ALGORITHM_FLAGS), as its recipe runs it: algorithm_setup
    algorithm: str = "flow_grpo"
    checkpoint_every: int = 1  # checkpoint every this many decoder layers (with checkpointing)
    # for comparison: every micro-batch prefills its own rows (the trainer before StepPrompts)
    micro_prefill: bool = False
    # EXPERIMENT: the frozen gen-path base matmuls in FP8, forward and input gradient (fp8_bases)
    fp8: bool = False

    @property
    def nft(self) -> bool:
        return self.algorithm == "diffusion_nft"


# a variant's flag -> trainer.algorithm (grpo_guard: FlowGRPO's step with GRPO-Guard's loss)
ALGORITHM_FLAGS = {"nft": "diffusion_nft", "awm": "awm", "dgpo": "dgpo", "guard": "grpo_guard"}


def parse_variants(text: str) -> list[Variant]:
    """'ac4,ac8,none2,ac4-fp32' -> variants: activation checkpointing ('ac') or not ('none'), the
    micro-batch size, '-fp32': LoRA matmuls in fp32 (no autocast: peft's own dtype handling),
    '-addmm': the experiment of :func:`addmm_lora`, '-compile': the query path compiled,
    '-everyN': checkpoint every N-th decoder layer only (trainer.activation_checkpointing_every;
    'ac8-every2'); '-nft', '-awm', '-dgpo', '-guard': another algorithm's step than FlowGRPO's
    (:data:`ALGORITHM_FLAGS`, :func:`algorithm_setup`); '-microprefill': every micro-batch
    prefills its own rows, not the step's one prefill (``Forwards.begin_step``), to compare;
    '-fp8': the experiment of :func:`fp8_bases`."""
    out = []
    for item in filter(None, text.split(",")):
        head, *flags = item.split("-")
        ac = head.startswith("ac")
        micro = int(head.removeprefix("ac").removeprefix("none"))
        every = [int(f.removeprefix("every")) for f in flags if f.startswith("every")]
        if every and (not ac or every[0] < 1):
            raise ValueError(f"variant {item!r}: -everyN needs 'ac' and N >= 1")
        algorithms = [ALGORITHM_FLAGS[f] for f in flags if f in ALGORITHM_FLAGS]
        if len(algorithms) > 1:
            raise ValueError(f"variant {item!r}: one algorithm flag at most")
        out.append(
            Variant(
                item,
                micro,
                ac,
                "fp32" not in flags,
                addmm="addmm" in flags,
                compile="compile" in flags,
                algorithm=algorithms[0] if algorithms else "flow_grpo",
                checkpoint_every=every[0] if every else 1,
                micro_prefill="microprefill" in flags,
                fp8="fp8" in flags,
            )
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


def fp8_bases(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """EXPERIMENT (bench only): every frozen gen-path linear layer of the decoder (a LoRA's
    ``base_layer``, or the layer itself where no adapter targets it) computes in FP8, forward and
    input gradient (:class:`Fp8FrozenLinear`; the forward's accumulation fast). Returns the
    replaced layers by module name; :func:`restore_layers` puts them back."""
    replaced: dict[str, torch.nn.Linear] = {}
    for name, module in list(model.named_modules()):
        if (
            isinstance(module, torch.nn.Linear)
            and not module.weight.requires_grad
            and name.removesuffix(".base_layer").endswith(GEN_PATH_LINEARS)
        ):
            replaced[name] = module
    for name, module in replaced.items():
        parent, _, child = name.rpartition(".")
        # the forward with Hopper's fast accumulation, the input gradient exact: torchao's float8
        # training recipes' choice (Float8LinearConfig's gemm configs)
        setattr(model.get_submodule(parent), child, Fp8FrozenLinear(module, fast_accum=True))
    if not replaced:
        raise ValueError("-fp8 found no frozen gen-path linear layer in this model")
    return replaced


def restore_layers(model: torch.nn.Module, layers: dict[str, torch.nn.Linear]) -> None:
    for name, module in layers.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, module)


# --- measuring one ---------------------------------------------------------------------------------


@dataclass
class StepBench:
    """What every variant is measured with."""

    policy: TrainablePolicy
    initial: dict[str, Tensor] | None  # the sampled weights (LoRA): each warm-up is a sync step
    batch: list[Trajectory]
    params: SamplerParams
    special: SpecialTokens
    dist: Dist
    repeats: int
    mini_batches: int
    compiled_before_sharding: bool  # sharded runs: --compile
    nft_fraction: float = 0.99  # DiffusionNFT rows: the share of the schedule's times trained per sample
    profile: bool = False  # each row: one more step under torch.profiler (bench.kernels)
    # the layers an '-fp8' variant replaced (fp8_bases), put back before the next variant
    fp8_layers: dict[str, torch.nn.Linear] = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return self.policy.model.vae2llm.weight.device


def measure_variant(variant: Variant, bench: StepBench) -> dict[str, Any]:
    """One row: a warm-up step, ``bench.repeats`` timed steps, their figures (MFU: add_mfu)."""
    row: dict[str, Any] = {"variant": variant.name, "micro_batch": variant.micro,
                           "algorithm": variant.algorithm, "nft": variant.nft,
                           "checkpointing": variant.checkpointing, "autocast": variant.autocast}  # fmt: skip
    skipped = _skip_reason(variant, bench)
    if skipped:
        return row | {"error": skipped}
    configure_variant(variant, bench)
    model = bench.policy.model
    row["checkpointed_share"] = len(checkpointed_layers(model)) / len(model.decoder.layers)
    row["compiled"] = variant.compile
    row["fp8"] = variant.fp8
    try:
        runs, profiled, count = _timed_steps(variant, bench)
    except torch.OutOfMemoryError as e:
        row["error"] = "out of memory: " + str(e).splitlines()[0][:300]
    except Exception as e:  # report it and go on with the next variant
        row["error"] = repr(e)[:1000]
    if "error" in row:
        free(bench.device)
        return row
    row |= _figures(runs, bench)
    (tokens,) = count.latent_tokens  # one resolution a step
    row["forwards"] = {
        "latent_tokens": tokens,
        "rows": [[*key, n] for key, n in sorted(count.rows.items())],
        "prefill_rows": count.prefills,
    }
    if profiled is not None:  # the kernels' time over the step's: how busy the GPU was
        row["kernels"] = profiled | {"busy_share": profiled["ms_per_call"] / (1e3 * runs.seconds.median)}
    return row


def _skip_reason(variant: Variant, bench: StepBench) -> str:
    if bench.dist.enabled and not variant.checkpointing:  # applied once, before sharding
        return "skipped: sharded runs always use activation checkpointing"
    if bench.dist.enabled and variant.compile != bench.compiled_before_sharding:
        return "skipped: sharded runs compile (--compile) or not, before sharding"
    if bench.dist.enabled and variant.fp8:
        return "skipped: -fp8 is measured on one process"
    if variant.fp8:
        try:
            check_fp8_device(bench.device)
        except RuntimeError as e:
            return f"skipped: {e}"
    return ""


def configure_variant(variant: Variant, bench: StepBench) -> None:
    """Compile first, checkpoint around it (the order load_policy applies); sharded models were
    configured once, before sharding."""
    if bench.dist.enabled:
        return
    model = bench.policy.model
    uncheckpoint_query_layers(model)
    uncompile_query_layers(model)
    restore_layers(model, bench.fp8_layers)
    bench.fp8_layers = {}
    if variant.fp8:
        bench.fp8_layers = fp8_bases(model)
    if variant.compile:
        # as a fresh process compiles: every variant's graphs are cached on the same query
        # methods' code, and four compiled variants in one call passed Dynamo's recompile limit
        # (8; the fourth failed, an H100 and this CPU, 2026-12-06)
        torch._dynamo.reset()
        compile_query_layers(model)
    if variant.checkpointing:
        checkpoint_query_layers(model, every=variant.checkpoint_every)


def _timed_steps(
    variant: Variant, bench: StepBench
) -> tuple[Runs[dict[str, float]], dict[str, Any] | None, ForwardCount]:
    if bench.initial is not None:  # back to the sampled weights: the warm-up step is a sync step
        bench.policy.load_published(bench.initial)
    cfg, params = algorithm_setup(variant, bench)
    trainer = TrainStep(bench.policy, bench.special, cfg, bench.dist)
    trainer.forwards.mixed_precision = variant.autocast
    if variant.micro_prefill:
        vars(trainer.forwards)["begin_step"] = lambda batch: None  # no step prefill: each micro-batch's
    patched = addmm_lora(bench.policy.model) if variant.addmm else []
    counted: list[ForwardCount] = []

    def step() -> dict[str, float]:
        if counted:
            return _step(trainer, bench, params)
        with counting_forwards(trainer) as count:  # the warm-up step: what every step runs
            counted.append(count)
            return _step(trainer, bench, params)

    try:
        runs = run_timed(step, repeats=bench.repeats, device=bench.device)
        profiled = None
        if bench.profile:  # after the timed steps: one more step, then the profiled one
            profiled = kernel_profile(lambda: _step(trainer, bench, params), bench.device, calls=1)
        return runs, profiled, counted[0]
    finally:
        for layer in patched:
            vars(layer).pop("forward", None)
        trainer.optimizer.zero_grad(set_to_none=True)


def nft_params(params: SamplerParams) -> SamplerParams:
    """DiffusionNFT's recipe samples CFG-free with the ODE: its training forwards are one branch."""
    return replace(params, cfg_text_scale=1.0, noise_level=0.0)


def algorithm_setup(variant: Variant, bench: StepBench) -> tuple[TrainerConfig, SamplerParams]:
    """The variant's trainer settings and the sampler settings it trains under, as the algorithm's
    recipe (examples/bagel_pickscore_lora_<name>.yaml) has them, its section at its defaults and
    the KL to the frozen base (trainer.loss.kl_beta) off: DiffusionNFT and AWM CFG-free on the
    ODE, DGPO on the ODE with the rollouts' CFG (it trains the conditional velocity), GRPO-Guard
    FlowGRPO's SDE window."""
    loss = LossConfig(mini_batches=bench.mini_batches, micro_batch_size=variant.micro)
    name = variant.algorithm
    if name == "diffusion_nft":
        nft = NftConfig(timestep_fraction=bench.nft_fraction)
        return TrainerConfig(algorithm=nft, loss=loss), nft_params(bench.params)
    if name == "awm":
        return TrainerConfig(algorithm=AwmConfig(), loss=loss), nft_params(bench.params)
    if name == "dgpo":
        return TrainerConfig(algorithm=DgpoConfig(), loss=loss), replace(bench.params, noise_level=0.0)
    if name == "grpo_guard":
        return TrainerConfig(loss=replace(loss, mode="grpo_guard")), bench.params
    return TrainerConfig(loss=loss), bench.params


@dataclass
class ForwardCount:
    """What :func:`counting_forwards` saw: rows by (pass, with gradients, context length)."""

    rows: Counter[tuple[str, bool, int]] = field(default_factory=Counter)
    latent_tokens: set[int] = field(default_factory=set)
    prefills: list[int] = field(default_factory=list)  # the rows of each prompt prefill, in order


@contextlib.contextmanager
def counting_forwards(trainer: TrainStep) -> Iterator[ForwardCount]:
    """Count the rows of every velocity forward the trainer runs inside (``predict_velocity``,
    through which every objective's forwards go): by pass ("old" inside the objective's ``begin``,
    "update" after it), grad mode and each row's context length (read from the device: the
    counted step is not a timed one); and the rows of every prompt prefill (not in the FLOPs)."""
    model, objective = trainer.policy.model, trainer.objective
    count, phase = ForwardCount(), ["update"]
    velocity, begin = model.predict_velocity, objective.begin  # FSDP's registered wrapper, if any
    prefill = model.prefill
    shadowed = {name: vars(model).get(name) for name in ("predict_velocity", "prefill")}

    def counted_prefill(input_ids: Tensor, *args: Any, **kwargs: Any) -> KVCache:
        count.prefills.append(int(input_ids.shape[0]))
        return prefill(input_ids, *args, **kwargs)

    def counted_velocity(cache: KVCache, x_t: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        for length in cache.lengths.tolist():
            count.rows[(phase[0], torch.is_grad_enabled(), int(length))] += 1
        count.latent_tokens.add(int(x_t.shape[1]))
        return velocity(cache, x_t, *args, **kwargs)

    def counted_begin(*args: Any, **kwargs: Any) -> dict[str, float]:
        phase[0] = "old"
        try:
            return begin(*args, **kwargs)
        finally:
            phase[0] = "update"

    vars(model)["predict_velocity"] = counted_velocity
    vars(model)["prefill"] = counted_prefill
    vars(objective)["begin"] = counted_begin
    try:
        yield count
    finally:
        del vars(objective)["begin"]
        for name, method in shadowed.items():
            if method is None:
                del vars(model)[name]
            else:
                vars(model)[name] = method


def _step(trainer: TrainStep, bench: StepBench, params: SamplerParams) -> dict[str, float]:
    """One ``run`` on a sync batch (policy_version = the trainer's version): its metrics and, on
    a GPU, its peak memory."""
    device = bench.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    metrics = trainer.run([replace(t, policy_version=trainer.version) for t in bench.batch], params, step=1)
    if device.type == "cuda":
        metrics["peak_gib"] = torch.cuda.max_memory_allocated(device) / GiB
    return metrics


def _figures(runs: Runs[dict[str, float]], bench: StepBench) -> dict[str, Any]:
    warm, steps = runs.warmup[0], runs.outputs
    return {
        "trajectories": len(bench.batch),
        "step_s": runs.seconds,
        # DiffusionNFT has no log-prob pass: its old policy's forwards run inside the update
        "old_log_prob_s": Figure.of([m.get("timing_s/old_log_prob", 0.0) for m in steps]),
        "update_s": Figure.of([m["timing_s/update_actor"] for m in steps]),
        "traj_per_s_per_gpu": runs.seconds.per(len(bench.batch) / bench.dist.world, "traj/s/GPU"),
        "peak_gib": max(m.get("peak_gib", math.nan) for m in steps),
        "loss": statistics.median(m.get("actor/pg_loss", math.nan) for m in steps),
        "grad_norm": statistics.median(m.get("actor/grad_norm", math.nan) for m in steps),
        "sync_logp_gap_max": warm.get("actor/rollout_logp_gap/max", math.nan),
        "sync_logp_gap_mean": warm.get("actor/rollout_logp_gap/mean", math.nan),
        "once_s": {"warmup_step": runs.warmup_seconds[0]},
    }


def add_mfu(row: dict[str, Any], flops: dict[str, float], peak_tflops: float) -> None:
    """MFU of the row's passes against ``peak_tflops``, from ``flops``: this rank's, of the
    forwards its step ran (``counted_flops`` of ``row["forwards"]``). HFU adds activation
    checkpointing's recompute (of the checkpointed layers) to the update pass. An algorithm
    without a pass before its updates (DiffusionNFT, AWM: their old policy's forwards are in the
    update) has no logp_old MFU."""
    if "error" in row:
        return
    row["flops"] = flops
    old, update = flops["old"], flops["update"]
    # every layer recomputes the same matmuls: the checkpointed layers' share of them
    recompute = flops["recompute"] * row["checkpointed_share"]
    if old > 0:
        row["mfu_old_log_prob"] = mfu(old, row["old_log_prob_s"], peak_tflops)
    row["mfu_update"] = mfu(update, row["update_s"], peak_tflops)
    row["hfu_update"] = mfu(update + recompute, row["update_s"], peak_tflops)
    row["mfu_step"] = mfu(old + update, row["step_s"], peak_tflops)
