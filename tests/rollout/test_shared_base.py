"""rollout.base_weights=trainer on CPU: the trainer's frozen weights placed in one allocation, a
rollout model mapped onto it, and updates that never write it. The CUDA IPC transport itself is
tested on a GPU (tests/services/test_colocated_gpu.py); here the trainer's allocation is read
back through the same table the bucket exports, as views of the same bytes."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import Tensor

from flowgrpo.bus.cuda_ipc import BucketWriter
from flowgrpo.configs.rollout import EngineConfig
from flowgrpo.configs.run import load_run_config
from flowgrpo.models.bagel.checkpoint import load_bagel_model, read_bagel_config
from flowgrpo.models.bagel.config import is_gen_path
from flowgrpo.models.bagel.model import BagelModel
from flowgrpo.models.bagel.policy import PolicyApplier, PolicyUpdate, PolicyUpdateError
from flowgrpo.models.bagel.sampling import BagelSampler, SampleRequest
from flowgrpo.sampler_params import SamplerParams
from flowgrpo.services.bench.common import SPECIAL_TINY as SPECIAL
from flowgrpo.services.rollout.shared_base import SharedBaseError, attach_base
from flowgrpo.services.trainer.distributed import Dist
from flowgrpo.services.trainer.load import load_policy
from tests.trainer.test_step import LORA, tiny

__all__ = ["tiny"]  # the module-scoped checkpoint fixture

PARAMS = SamplerParams(num_points=5, height=32, width=32, window_size=1, window_range=(0, 2),
                       deterministic=True, decode_images=False)  # fmt: skip
Q, UP = (
    "language_model.model.layers.0.self_attn.q_proj_moe_gen",
    "language_model.model.layers.1.mlp_moe_gen.up_proj",
)


def lora(tiny: Path, seed: int, modules: tuple[str, ...] = (Q, UP)) -> dict[str, Tensor]:
    shapes = {n: p.shape for n, p in meta_model(tiny).named_parameters()}
    g = torch.Generator().manual_seed(seed)
    out = {}
    for m in modules:
        rows, cols = shapes[m + ".weight"]
        out[m + ".lora_A.weight"] = torch.randn(4, cols, generator=g) * 0.1
        out[m + ".lora_B.weight"] = torch.randn(rows, 4, generator=g) * 0.1
    return out


def shared_trainer(tiny: Path, kind: str = "lora") -> BucketWriter:
    policy = load_policy(
        tiny, replace(LORA, kind=kind), Dist(), dtype=torch.float32, device="cpu", share_base=True
    )
    assert policy.base_bucket is not None
    return policy.base_bucket


def views_of(writer: BucketWriter) -> dict[str, Tensor]:
    """What a consumer opens: the exported table read against the same bytes."""
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    out = {}
    for entry in writer.entries:
        dtype = dtypes[entry.dtype]
        nbytes = torch.Size(entry.shape).numel() * dtype.itemsize
        out[entry.name] = (
            writer.buffer[entry.offset : entry.offset + nbytes].view(dtype).view(tuple(entry.shape))
        )
    return out


def meta_model(tiny: Path, dtype: torch.dtype = torch.float32) -> BagelModel:
    with torch.device("meta"):
        return BagelModel(read_bagel_config(tiny)).to(dtype).eval().requires_grad_(False)


def inside(tensor: Tensor, buffer: Tensor) -> bool:
    start = buffer.data_ptr()
    return start <= tensor.data_ptr() < start + buffer.numel()


def sample(model: BagelModel) -> Tensor:
    requests = [SampleRequest("p", i, torch.tensor([5, 6, 7])) for i in range(2)]
    return BagelSampler(model, None, SPECIAL).generate(requests, PARAMS, seed=0, step=0).final_latents


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_the_trainer_places_every_frozen_weight_in_one_allocation(tiny: Path, kind: str) -> None:
    policy = load_policy(
        tiny, replace(LORA, kind=kind), Dist(), dtype=torch.float32, device="cpu", share_base=True
    )
    plain = load_policy(tiny, replace(LORA, kind=kind), Dist(), dtype=torch.float32, device="cpu")
    assert policy.base_bucket is not None
    buffer = policy.base_bucket.buffer
    expected = dict(plain.model.named_parameters())
    for name, param in policy.model.named_parameters():
        assert torch.equal(param, expected[name]), name
        assert param.requires_grad == expected[name].requires_grad, name
        assert inside(param, buffer) == (not param.requires_grad), name  # frozen: in; trained: out
    names = {e.name for e in policy.base_bucket.entries}
    assert not any(".base_layer" in n or ".lora_" in n for n in names), "checkpoint names only"
    assert any(is_gen_path(n) for n in names) == (kind == "lora")  # full: the gen path trains


@pytest.mark.parametrize("lora_mode", ["merge", "peft"])
def test_a_mapped_rollout_samples_like_a_loaded_one_and_never_writes_the_base(
    tiny: Path, lora_mode: str
) -> None:
    writer = shared_trainer(tiny)
    before = writer.buffer.clone()
    model = meta_model(tiny)
    shared, bases = attach_base(
        model, views_of(writer), owned=lambda k: lora_mode == "merge" and is_gen_path(k), checkpoint=tiny
    )
    loaded = load_bagel_model(tiny, dtype=torch.float32)
    for name, param in model.named_parameters():
        assert torch.equal(param, dict(loaded.named_parameters())[name]), name
        assert inside(param, writer.buffer) == (name in shared), name
        assert not param.requires_grad, name
    if lora_mode == "merge":  # the gen path is the rollout's own (a merge writes it), the rest mapped
        assert shared == {n for n, _ in model.named_parameters() if not is_gen_path(n)}
        assert Q in bases and all(inside(b, writer.buffer) for b in bases.values())
    else:  # peft never writes the base: nothing is copied
        assert shared == {n for n, _ in model.named_parameters()} and not bases
    assert torch.equal(sample(model), sample(loaded))

    applier = PolicyApplier(model, lora_mode=lora_mode, shared_base=bases, read_only=shared)  # type: ignore[arg-type]
    reference = PolicyApplier(loaded, lora_mode=lora_mode)  # type: ignore[arg-type]
    for version, seed in ((1, 1), (2, 2)):
        modules = (Q, UP) if version == 1 or lora_mode == "peft" else (Q,)  # merge: un-adapts UP
        update = PolicyUpdate(version, "lora", lora(tiny, seed, modules), lora_rank=4, lora_alpha=8.0)
        applier.apply(update)
        reference.apply(update)
        assert torch.equal(sample(model), sample(loaded)), f"version {version}"
    assert torch.equal(writer.buffer, before), "the trainer's base was written"


def test_what_the_trainer_trains_in_full_is_read_from_the_checkpoint(tiny: Path) -> None:
    writer = shared_trainer(tiny, kind="full")
    model = meta_model(tiny)
    shared, _ = attach_base(model, views_of(writer), owned=is_gen_path, checkpoint=tiny)
    loaded = dict(load_bagel_model(tiny, dtype=torch.float32).named_parameters())
    for name, param in model.named_parameters():
        assert torch.equal(param, loaded[name]), name
        assert inside(param, writer.buffer) == (not is_gen_path(name)), name
    gen = UP + ".weight"
    new = torch.randn_like(loaded[gen])
    applier = PolicyApplier(model, shared_base={}, read_only=shared)
    applier.apply(PolicyUpdate(1, "gen_path", {gen: new}))
    assert torch.equal(dict(model.named_parameters())[gen], new)


def test_an_update_that_would_write_the_shared_base_is_refused_whole(tiny: Path) -> None:
    writer = shared_trainer(tiny)
    before = writer.buffer.clone()
    model = meta_model(tiny)
    shared, _ = attach_base(model, views_of(writer), owned=lambda _: False, checkpoint=tiny)
    applier = PolicyApplier(model, read_only=shared)
    gen = UP + ".weight"
    with pytest.raises(PolicyUpdateError, match="shared base"):
        applier.apply(
            PolicyUpdate(1, "gen_path", {gen: torch.zeros_like(dict(model.named_parameters())[gen])})
        )
    with pytest.raises(PolicyUpdateError, match="shared base"):  # merge mode onto mapped weights
        applier.apply(PolicyUpdate(1, "lora", lora(tiny, 1), lora_rank=4, lora_alpha=8.0))
    assert torch.equal(writer.buffer, before) and applier.version == 0


def test_a_base_of_another_dtype_or_model_is_refused_with_the_fix(tiny: Path) -> None:
    views = views_of(shared_trainer(tiny))
    with pytest.raises(SharedBaseError, match=r"trainer\.dtype = rollout\.dtype"):
        attach_base(meta_model(tiny, torch.bfloat16), views, owned=is_gen_path, checkpoint=tiny)
    with pytest.raises(SharedBaseError, match="not in this model"):
        attach_base(
            meta_model(tiny), {**views, "extra.weight": torch.zeros(2)}, owned=is_gen_path, checkpoint=tiny
        )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer.share_base=false"], r"set trainer\.share_base=true"),
        (["trainer.dtype=float32"], r"must equal trainer\.dtype"),
        (["launch.rollout_devices=[cuda:1]"], "other GPUs"),
        (["launch.trainer_nproc=2", "trainer.device=cuda"], "one trainer process"),
        (["launch.rollout_devices=[cpu]"], "other GPUs"),
        (["rollout.checkpoint=/other", "trainer.checkpoint=/ckpt"], "give both the same checkpoint"),
    ],
)
def test_a_colocated_recipe_that_cannot_share_is_refused(overrides: list[str], message: str) -> None:
    recipe = Path(__file__).resolve().parents[2] / "examples" / "bagel_pickscore_lora_1gpu.yaml"
    data = ["data.dataset=/data/pickscore"]  # the recipe's command line names it
    assert load_run_config(recipe, data).rollout.base_weights == "trainer"
    with pytest.raises(ValueError, match=message):
        load_run_config(recipe, [*data, *overrides])


def test_sharing_and_releasing_are_refused_off_the_gpu() -> None:
    for config in (EngineConfig(base_weights="trainer"), EngineConfig(release_memory=True)):
        with pytest.raises(ValueError, match="GPU rollout"):
            config.validate()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["sampling.batch_invariant=true", "rollout.engine=vllm_omni", "rollout.dtype=bfloat16",
          "rollout.lora_mode=merge"],
         "use the native engine"),
        (["trainer.algorithm=diffusion_nft", "trainer.loss.max_logp_gap=0"], "computes none"),
    ],
)  # fmt: skip
def test_settings_another_part_would_ignore_are_refused(overrides: list[str], message: str) -> None:
    demo = Path(__file__).resolve().parents[2] / "examples" / "tiny_jpeg.yaml"
    with pytest.raises(ValueError, match=message):
        load_run_config(demo, overrides)
