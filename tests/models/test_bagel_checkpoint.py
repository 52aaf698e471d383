"""Checkpoint folders in the published layout: the tiny factory, round trips, components loading on
their own, and clear failures on missing, mis-shaped or unknown keys."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from flowgrpo.models.bagel.checkpoint import (
    CheckpointError,
    load_bagel_model,
    load_special_tokens,
    load_vae,
    make_tiny_bagel,
    read_bagel_config,
    save_bagel_checkpoint,
)
from flowgrpo.models.bagel.config import SpecialTokens, tiny, tiny_vae
from flowgrpo.models.bagel.model import BagelModel, latent_position_ids

FILES = [
    "ema.safetensors",
    "ae.safetensors",
    "llm_config.json",
    "vit_config.json",
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_bagel(tmp_path_factory.mktemp("tiny") / "bagel", seed=0)


def copy_files(src: Path, dst: Path, names: list[str]) -> Path:
    dst.mkdir()
    for name in names:
        shutil.copy(src / name, dst / name)
    return dst


def velocity(model: BagelModel, specials: SpecialTokens) -> torch.Tensor:
    ids = torch.tensor([[specials.im_start, 70, 80, 90, specials.im_end]])
    x = torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([0.5])
    pos = latent_position_ids(2, 2, 8)
    mask = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():
        out: torch.Tensor = model(
            ids, mask, x, t, pos, soi_id=specials.vision_start, eoi_id=specials.vision_end
        )
    return out


def test_tiny_factory_writes_the_published_layout(tiny_dir: Path) -> None:
    """Every published file exists; the tokenizer encodes prompts and knows the four markers."""
    from tokenizers import Tokenizer

    assert sorted(p.name for p in tiny_dir.iterdir()) == sorted(FILES)
    tokenizer = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    specials = load_special_tokens(tiny_dir)
    assert tokenizer.token_to_id("<|vision_start|>") == specials.vision_start
    ids = tokenizer.encode("a photo of a zebra", add_special_tokens=False).ids
    assert ids and max(ids) < tiny().vocab and tokenizer.decode(ids) == "a photo of a zebra"
    assert max(vars(specials).values()) < tiny().vocab
    assert read_bagel_config(tiny_dir) == tiny()


def test_round_trip_is_bitwise_and_the_factory_deterministic(tiny_dir: Path, tmp_path: Path) -> None:
    """Bitwise: load -> save reproduces ema.safetensors and ae.safetensors byte for byte (so the
    factory is a pure function of its seed); another seed gives other weights."""
    model = load_bagel_model(tiny_dir, dtype=torch.float32)
    vae = load_vae(tiny_dir)
    specials = load_special_tokens(tiny_dir)
    out = save_bagel_checkpoint(model, vae, tmp_path / "again", special_tokens=specials)
    for name in ["ema.safetensors", "ae.safetensors"]:
        assert (out / name).read_bytes() == (tiny_dir / name).read_bytes(), name
    reloaded = load_bagel_model(out, dtype=torch.float32)
    assert all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), reloaded.state_dict().values(), strict=True)
    )

    other = load_file(make_tiny_bagel(tmp_path / "seed1", seed=1) / "ema.safetensors")
    assert not torch.equal(other["llm2vae.weight"], model.llm2vae.weight)


def test_model_loads_from_ema_and_llm_config_alone(tiny_dir: Path, tmp_path: Path) -> None:
    """Bitwise: no ae.safetensors, no tokenizer needed; same velocity as from the full folder.
    Weights land in the requested dtype, nothing stays on the meta device."""
    alone = copy_files(tiny_dir, tmp_path / "alone", ["ema.safetensors", "llm_config.json"])
    specials = load_special_tokens(tiny_dir)
    full = load_bagel_model(tiny_dir, dtype=torch.float32)
    model = load_bagel_model(alone, dtype=torch.float32)
    assert torch.equal(velocity(model, specials), velocity(full, specials))
    assert not any(p.is_meta for p in model.parameters())
    assert not model.latent_pos_embed.pos_embed.requires_grad
    bf16 = load_bagel_model(alone)
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    with pytest.raises(CheckpointError, match=r"ae\.safetensors"):
        load_vae(alone)


def test_vae_loads_alone_with_geometry_from_shapes(tiny_dir: Path, tmp_path: Path) -> None:
    """Bitwise: the VAE from ae.safetensors alone decodes like the saved one."""
    alone = copy_files(tiny_dir, tmp_path / "vae", ["ae.safetensors"])
    vae = load_vae(alone)
    assert vae.config == tiny_vae() and vae.config.downsample == 8
    z = torch.randn(1, 16, 2, 2)
    with torch.no_grad():
        assert torch.equal(vae.decode(z), load_vae(tiny_dir).decode(z))


def rewrite_ema(tiny_dir: Path, dst: Path, edit: dict[str, torch.Tensor | None]) -> Path:
    """A copy of the folder's model files whose ema.safetensors has keys replaced or removed."""
    folder = copy_files(tiny_dir, dst, ["llm_config.json"])
    tensors = load_file(tiny_dir / "ema.safetensors")
    for key, value in edit.items():
        if value is None:
            del tensors[key]
        else:
            tensors[key] = value
    save_file(tensors, folder / "ema.safetensors")
    return folder


def test_missing_key_fails_naming_key_and_file(tiny_dir: Path, tmp_path: Path) -> None:
    key = "language_model.model.layers.1.self_attn.k_norm_moe_gen.weight"
    folder = rewrite_ema(tiny_dir, tmp_path / "missing", {key: None})
    with pytest.raises(CheckpointError, match="missing keys: 1") as err:
        load_bagel_model(folder)
    assert key in str(err.value) and "ema.safetensors" in str(err.value)


def test_misshaped_key_fails_naming_key_and_shapes(tiny_dir: Path, tmp_path: Path) -> None:
    key = "language_model.model.layers.0.mlp_moe_gen.up_proj.weight"
    folder = rewrite_ema(tiny_dir, tmp_path / "shape", {key: torch.zeros(127, 64)})
    with pytest.raises(CheckpointError, match="mis-shaped keys") as err:
        load_bagel_model(folder)
    assert f"{key} [127, 64] (model expects [128, 64])" in str(err.value)


def test_vit_keys_are_ignored_other_unknown_keys_are_not(tiny_dir: Path, tmp_path: Path) -> None:
    vit = {"vit_model.encoder.layer.0.w": torch.zeros(2), "connector.fc1.weight": torch.zeros(2)}
    load_bagel_model(rewrite_ema(tiny_dir, tmp_path / "vit", dict(vit)), torch.float32)  # no error
    folder = rewrite_ema(tiny_dir, tmp_path / "extra", {"language_model.model.extra.weight": torch.zeros(2)})
    with pytest.raises(CheckpointError, match=r"unexpected keys: 1 \(language_model.model.extra.weight\)"):
        load_bagel_model(folder)


def test_max_latent_size_comes_from_the_position_table(tiny_dir: Path, tmp_path: Path) -> None:
    """A stale config.json does not matter; a non-square table is refused."""
    folder = copy_files(tiny_dir, tmp_path / "stale", ["ema.safetensors", "llm_config.json"])
    (folder / "config.json").write_text(json.dumps({"max_latent_size": 64}))
    assert read_bagel_config(folder).max_latent_size == 8
    bad = rewrite_ema(tiny_dir, tmp_path / "bad", {"latent_pos_embed.pos_embed": torch.zeros(60, 64)})
    with pytest.raises(CheckpointError, match="not a square"):
        read_bagel_config(bad)


def test_special_tokens_from_tokenizer_config_or_arguments(tiny_dir: Path, tmp_path: Path) -> None:
    from_tokenizer = load_special_tokens(tiny_dir)
    assert from_tokenizer == SpecialTokens(384, 385, 386, 387)
    no_tokenizer = copy_files(tiny_dir, tmp_path / "cfg", ["config.json"])  # holds special_token_ids
    assert load_special_tokens(no_tokenizer) == from_tokenizer
    fallback = SpecialTokens(1, 2, 3, 4)
    nothing = tmp_path / "nothing"
    nothing.mkdir()
    assert load_special_tokens(nothing, fallback=fallback) == fallback
    with pytest.raises(CheckpointError, match="special-token ids"):
        load_special_tokens(nothing)


def test_complete_layout_has_every_published_file_and_the_same_generation_weights(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """``complete=True``: the understanding tensors under their published names and shapes, the
    full config.json and preprocessor_config.json; the native loader reads it (ignoring the ViT),
    every generation weight equals the plain tiny checkpoint's, and the larger latent grid samples
    the same images at the sizes both allow (the sin-cos table is exact at any size)."""
    from flowgrpo.models.bagel.checkpoint import TINY_VIT_CONFIG, tensor_shapes, understanding_shapes
    from flowgrpo.models.bagel.sampling import BagelSampler, SampleRequest
    from flowgrpo.sampler_params import SamplerParams

    complete = make_tiny_bagel(tmp_path / "complete", seed=0, complete=True)
    assert sorted(p.name for p in complete.iterdir()) == sorted([*FILES, "preprocessor_config.json"])
    top = json.loads((complete / "config.json").read_text())
    assert top["model_type"] == "bagel" and top["visual_und"] is True
    assert top["llm_config"] == json.loads((complete / "llm_config.json").read_text())
    assert top["vit_config"] == TINY_VIT_CONFIG == json.loads((complete / "vit_config.json").read_text())
    assert top["vit_max_num_patch_per_side"] == 2 and top["max_latent_size"] == 32
    processor = json.loads((complete / "preprocessor_config.json").read_text())
    assert processor["image_processor_type"] == "SiglipImageProcessor" and processor["size"]["height"] == 28

    shapes = tensor_shapes(complete / "ema.safetensors")
    understanding = understanding_shapes(TINY_VIT_CONFIG, tiny().hidden)
    assert {k: v for k, v in shapes.items() if k in understanding} == understanding
    assert shapes["vit_model.vision_model.embeddings.patch_embedding.weight"] == (32, 3 * 14 * 14)
    assert shapes["connector.fc1.weight"] == (64, 32) and shapes["vit_pos_embed.pos_embed"] == (4, 64)

    plain, full = load_bagel_model(tiny_dir, torch.float32), load_bagel_model(complete, torch.float32)
    assert full.config.max_latent_size == 32 and plain.config.max_latent_size == 8
    full_state = full.state_dict()
    for name, tensor in plain.state_dict().items():
        if name != "latent_pos_embed.pos_embed":
            assert torch.equal(tensor, full_state[name]), name
    params = SamplerParams(
        num_points=4, height=64, width=64, window_size=1, window_range=(0, 2), deterministic=True
    )
    request = [SampleRequest("p", 0, torch.tensor([384, 5, 6, 385]))]
    specials = load_special_tokens(tiny_dir)
    ours = BagelSampler(full, load_vae(complete), specials).generate(request, params, seed=1, step=0)
    theirs = BagelSampler(plain, load_vae(tiny_dir), specials).generate(request, params, seed=1, step=0)
    assert torch.equal(ours.final_latents, theirs.final_latents) and torch.equal(ours.images, theirs.images)
