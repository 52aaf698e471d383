"""The recipes under examples/: each loads and validates with the commands its header documents;
the BAGEL recipes carry the reference values (examples/README.md) for 4 GPUs; a bad recipe fails
with a message that names the key and the fix. Torch-free and fast: RunConfig imports no torch."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from flowgrpo.config import ConfigError, dump_yaml, to_dict
from flowgrpo.configs.run import RunConfig, load_run_config
from flowgrpo.models.bagel.config import GEN_PATH_LINEARS

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
# `flowgrpo train` recipes; `flowgrpo sft` ones (sft_*.yaml) are a config of their own
RECIPES = sorted(p for p in EXAMPLES.glob("*.yaml") if not p.name.startswith("sft_"))
SFT_RECIPES = sorted(EXAMPLES.glob("sft_*.yaml"))
# what a user passes on the command line (the recipes leave the dataset to the user)
PICKSCORE_ARGS = ("model.checkpoint=/ckpt/BAGEL-7B-MoT", "data.dataset=/data/pickscore")
OCR_ARGS = ("model.checkpoint=/ckpt/BAGEL-7B-MoT", "data.dataset=/data/ocr")

# --- the reference values (examples/README.md), 4 GPUs -------------------------------------------------

COMMON = {
    "data.group_size": 16,  # G
    "trainer.loss.mini_batches": 2,  # optimizer steps per step
    "trainer.optim.lr": 1e-4,
    "trainer.optim.weight_decay": 1e-4,
    "sampling.window_range": (0, 7),
    "sampling.num_points": 15,  # train schedule points
    "sampling.eval_num_points": 50,
    "sampling.resolution": 512,
    "trainer.loss.clip_eps": 1e-5,
    "trainer.loss.kl_beta": 0.0,
    "schedule.steps": 300,
    "schedule.save_every": 30,
    "schedule.eval_every": 30,
    # the rest of the reference sampler and loss the table takes for granted
    "trainer.optim.grad_clip": 1.0,
    "trainer.loss.logp_old": "recompute",
    "advantages.std_ddof": 1,
    "advantages.eps": 1e-4,
    "advantages.clip": 5.0,
    "advantages.global_std": False,
    "sampling.sde_type": "sde",
    "sampling.timestep_shift": 3.0,
    "sampling.cfg_text_scale": 4.0,
    "sampling.cfg_img_scale": 1.0,
    "sampling.cfg_interval": (0.0, 1.0),
    "sampling.cfg_renorm_type": "global",
    "sampling.cfg_renorm_min": 0.0,
}
LORA = {
    "trainer.policy.kind": "lora",
    "trainer.policy.lora_rank": 64,
    "trainer.policy.lora_alpha": 128.0,
    "trainer.policy.lora_init": "gaussian",
    "trainer.policy.lora_targets": list(GEN_PATH_LINEARS),
    "sampling.window_size": 2,
}
FULL = {"trainer.policy.kind": "full", "sampling.window_size": 3}
PICKSCORE = {"data.prompts_per_step": 48, "trainer.loss.micro_batch_size": 12, "sampling.noise_level": 1.3}
OCR = {"data.prompts_per_step": 32, "trainer.loss.micro_batch_size": 16, "sampling.noise_level": 0.7}

# recipe -> (its table values, the table's mini-batch in prompts, the command line)
BAGEL: dict[str, tuple[dict[str, Any], int, tuple[str, ...]]] = {
    "bagel_pickscore_lora.yaml": ({**COMMON, **LORA, **PICKSCORE}, 24, PICKSCORE_ARGS),
    "bagel_pickscore_lora_async.yaml": ({**COMMON, **LORA, **PICKSCORE}, 24, PICKSCORE_ARGS),
    "bagel_pickscore_full.yaml": ({**COMMON, **FULL, **PICKSCORE}, 24, PICKSCORE_ARGS),
    "bagel_ocr_lora.yaml": ({**COMMON, **LORA, **OCR}, 16, OCR_ARGS),
    "bagel_ocr_lora_offline.yaml": ({**COMMON, **LORA, **OCR}, 16, OCR_ARGS),
}
BASE = EXAMPLES / "bagel_pickscore_lora.yaml"  # the recipe the bad cases start from


def _get(cfg: Any, dotted: str) -> Any:
    for key in dotted.split("."):
        cfg = getattr(cfg, key)
    return cfg


def _load(name: str, *extra: str) -> RunConfig:
    return load_run_config(EXAMPLES / name, [*BAGEL[name][2], *extra])


def _header(path: Path) -> str:
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line[1:])
    return "\n".join(lines)


def _documentation(name: str) -> str:
    """The header that documents a recipe: an async file's is its sync file's (which it names)."""
    sync = name.replace("_async.yaml", ".yaml")
    if sync != name:
        assert f"examples/{sync}" in _header(EXAMPLES / name)
    return _header(EXAMPLES / sync)


def _commands(text: str) -> list[tuple[str, list[str]]]:
    """The ``flowgrpo train examples/X.yaml OVERRIDES`` commands of a text, as (recipe, overrides)."""
    found = []
    for raw in text.replace("\\\n", " ").splitlines():
        line = raw.strip().lstrip("#").strip()
        if line.startswith("flowgrpo train examples/"):
            words = shlex.split(line, comments=True)
            found.append((words[2].removeprefix("examples/"), words[3:]))
    return found


DOCUMENTED = [
    pytest.param(recipe, overrides, id=f"{source.name}:{recipe}:{i}")
    for source in [*RECIPES, EXAMPLES / "README.md"]
    for i, (recipe, overrides) in enumerate(
        _commands(_header(source) if source.suffix == ".yaml" else source.read_text())
    )
]


# --- every shipped recipe ------------------------------------------------------------------------


def test_the_bagel_recipes_are_shipped() -> None:
    assert set(BAGEL) <= {p.name for p in RECIPES}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_every_recipe_documents_its_command(recipe: Path) -> None:
    assert any(name == recipe.name for name, _ in _commands(_header(recipe))), (
        f"{recipe.name}: its header comment must show `flowgrpo train examples/{recipe.name} ...`"
    )


@pytest.mark.parametrize("recipe", SFT_RECIPES, ids=lambda p: p.name)
def test_every_sft_recipe_documents_its_command_and_loads(recipe: Path) -> None:
    from flowgrpo.config import load_config
    from flowgrpo.services.trainer.sft_config import SftConfig

    assert f"flowgrpo sft examples/{recipe.name}" in _header(recipe)
    assert f"`{recipe.name}`" in (EXAMPLES / "README.md").read_text()
    cfg = load_config(SftConfig, recipe, ["model=bagel", "data.images=pairs"])
    assert cfg.steps >= 1 and cfg.eval.reward.scorers


@pytest.mark.parametrize(("recipe", "overrides"), DOCUMENTED)
def test_every_documented_command_loads_and_validates(recipe: str, overrides: list[str]) -> None:
    cfg = load_run_config(EXAMPLES / recipe, overrides)
    assert cfg.run_dir  # runs/<name> unless the recipe names one


def test_the_readme_lists_every_recipe_and_links_the_data_readme() -> None:
    readme = (EXAMPLES / "README.md").read_text()
    for recipe in RECIPES:
        assert f"`{recipe.name}`" in readme, recipe.name
    assert "(data/README.md)" in readme


def test_the_readme_override_examples_apply() -> None:
    rows = re.findall(r"^\| `'?([a-z_.]+=[^`']*)'?` \|", (EXAMPLES / "README.md").read_text(), re.MULTILINE)
    assert len(rows) >= 6
    for override in rows:
        load_run_config(BASE, [override, *PICKSCORE_ARGS])


@pytest.mark.parametrize("name", sorted(BAGEL))
def test_the_resolved_config_loads_as_a_recipe(name: str, tmp_path: Path) -> None:
    cfg = _load(name)
    dump_yaml(cfg, tmp_path / "config.yaml")  # what <run_dir>/config.yaml holds
    assert load_run_config(tmp_path / "config.yaml") == cfg


def test_loading_a_recipe_imports_no_torch() -> None:
    code = (
        "import sys\n"
        "from flowgrpo.configs.run import load_run_config\n"
        f"load_run_config({str(BASE)!r}, {list(PICKSCORE_ARGS)!r})\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'peft', 'transformers'))\n"
        "print(heavy)\n"
        "sys.exit(1 if heavy else 0)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr


# --- the reference values' table ----------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(BAGEL))
def test_bagel_recipe_values_are_specs_table(name: str) -> None:
    expected, mini_batch_prompts, _ = BAGEL[name]
    cfg = _load(name)
    got = {key: _get(cfg, key) for key in expected}
    assert got == expected
    assert cfg.data.prompts_per_step // cfg.trainer.loss.mini_batches == mini_batch_prompts
    assert cfg.trainer.optim.eps == 1e-8  # AdamW's default, the references' value
    assert cfg.trainer.dtype == "bfloat16" and cfg.rollout.dtype == "bfloat16"  # as the references
    evaluation = cfg.sampling.params(evaluation=True).to_proto()  # validation: the ODE on 50 points
    assert (evaluation.noise_level, evaluation.num_points) == (0.0, 50)
    training = cfg.sampling.params().to_proto()
    assert (training.window_size, training.window_range_lo, training.window_range_hi) == (
        expected["sampling.window_size"],
        0,
        7,
    )


def _gpus(device: str) -> str:
    return "cuda:0" if device == "cuda" else device


@pytest.mark.parametrize("name", sorted(BAGEL))
def test_bagel_recipes_lay_out_4_gpus(name: str) -> None:
    cfg = _load(name)
    nproc = cfg.launch.trainer_nproc
    # under torchrun each rank takes the GPU of its LOCAL_RANK
    trainer = {f"cuda:{r}" for r in range(nproc)} if nproc > 1 else {_gpus(cfg.trainer.device)}
    rollout = {_gpus(d) for d in cfg.launch.rollout_devices}
    assert cfg.launch.launcher == "local"
    assert len(cfg.launch.rollout_devices) == cfg.launch.rollout_replicas == len(rollout)
    assert not trainer & rollout, "the trainer and a rollout replica share a GPU"
    assert trainer | rollout == {"cuda:0", "cuda:1", "cuda:2", "cuda:3"}
    if "pickscore" in [s.name for s in cfg.reward.scorers]:
        assert cfg.reward.pickscore.device in trainer | rollout


def test_the_full_recipe_shards_the_gen_path() -> None:
    cfg = _load("bagel_pickscore_full.yaml")
    assert cfg.launch.trainer_nproc >= 2 and cfg.trainer.device == "cuda"
    assert cfg.trainer.activation_checkpointing and cfg.trainer.compile
    assert cfg.trainer.publish_dtype == "bfloat16"


@pytest.mark.parametrize("name", sorted(BAGEL))
def test_bagel_recipe_rewards(name: str) -> None:
    cfg = _load(name)
    header = _documentation(name)
    scorers = [(s.name, s.weight) for s in cfg.reward.scorers]
    if "pickscore" in name:
        assert scorers == [("pickscore", 1.0)]
        assert cfg.reward.pickscore.model and cfg.reward.pickscore.processor
        assert "flowgrpo data prepare pickscore" in header
        return
    assert scorers == [("ocr", 1.0)]
    assert "flowgrpo data prepare ocr" in header
    if name.endswith("_offline.yaml"):
        assert cfg.reward.ocr.engine == "offline"
        return
    judge = cfg.reward.ocr.judge  # flow_grpo's judge: Qwen3-VL-8B-Instruct behind vLLM, greedy
    assert cfg.reward.ocr.engine == "judge"
    assert judge.model == "Qwen/Qwen3-VL-8B-Instruct" and judge.temperature == 0.0
    assert judge.base_url.startswith("http") and judge.base_url.endswith("/v1")
    assert "vllm serve" in header and "--served-model-name Qwen/Qwen3-VL-8B-Instruct" in header


@pytest.mark.parametrize("name", sorted(BAGEL))
def test_bagel_recipe_headers_explain_themselves(name: str) -> None:
    header = _documentation(name)
    for words in ("What it trains", "Prepare first", "Run:", "GPUs", "Departures from the reference values"):
        assert words in header, words


def test_the_async_file_is_the_sync_recipe_plus_the_async_override() -> None:
    sync = to_dict(_load("bagel_pickscore_lora.yaml", "schedule.mode=async", "schedule.staleness=1"))
    asynchronous = to_dict(_load("bagel_pickscore_lora_async.yaml"))
    for cfg in (sync, asynchronous):
        del cfg["name"], cfg["run_dir"]
    assert asynchronous == sync
    assert asynchronous["schedule"]["mode"] == "async"
    assert asynchronous["trainer"]["loss"]["logp_old"] == "recompute"


@pytest.mark.parametrize("name", [n for n in sorted(BAGEL) if not n.endswith("_async.yaml")])
def test_every_bagel_recipe_goes_async_by_override(name: str) -> None:
    cfg = _load(name, "schedule.mode=async", "schedule.staleness=1")
    assert (cfg.schedule.mode, cfg.schedule.staleness) == ("async", 1)


# --- bad recipes: the message names the key and the fix -----------------------------------------

BAD_OVERRIDES = {
    "unknown key": (
        ["trainer.optim.weight_decy=0.0"],
        ["'trainer.optim.weight_decy'", "did you mean trainer.optim.weight_decay"],
    ),
    "unknown section": (["trainer.optimizer.lr=3e-5"], ["'trainer.optimizer'", "did you mean trainer.optim"]),
    "wrong type": (
        ["data.prompts_per_step=forty-eight"],
        ["data.prompts_per_step", "expected int", "'forty-eight'"],
    ),
    "scalar for a list": (["launch.rollout_devices=cuda:2"], ["launch.rollout_devices", "expected a list"]),
    "not one of": (["schedule.mode=asynch"], ["schedule.mode", "'asynch' is not one of", "'async'"]),
    "prompts not divisible": (
        ["data.prompts_per_step=47"],
        ["data.prompts_per_step=47", "not divisible by trainer.loss.mini_batches=2", "change one of them"],
    ),
    "window past the schedule": (
        ["sampling.window_range=[0,20]"],
        ["sampling.window_range=[0, 20]", "schedule of 14 steps", "hi <= 14"],
    ),
    "schedule shorter than the window": (
        ["sampling.num_points=6"],
        ["sampling.window_range=[0, 7]", "schedule of 5 steps (num_points=6)", "hi <= 5"],
    ),
    "window wider than its range": (
        ["sampling.window_size=8"],
        ["sampling.window_size=8", "lo + window_size <= hi"],
    ),
    "LoRA target matching no module": (
        ["trainer.policy.lora_targets=[self_attn.qkv_proj_moe_gen]"],
        ["trainer.policy.lora_targets ['self_attn.qkv_proj_moe_gen'] match no module", "q_proj_moe_gen"],
    ),
    "LoRA target outside the gen path": (
        ["trainer.policy.lora_targets=[self_attn.q_proj]"],
        ["trainer.policy.lora_targets ['self_attn.q_proj']", "outside the gen path", "moe_gen"],
    ),
    "bypass without the weight-sync alarm": (
        ["trainer.loss.logp_old=bypass"],
        ["trainer.loss.logp_old=bypass", "set trainer.loss.max_logp_gap"],
    ),
    "async with bypass": (
        ["schedule.mode=async", "trainer.loss.logp_old=bypass", "trainer.loss.max_logp_gap=0"],
        ["schedule.mode=async", "needs trainer.loss.logp_old=recompute"],
    ),
    "remote with some addresses": (
        ["launch.launcher=remote", "launch.trainer_address=10.0.0.1:50051"],
        ["launcher=remote", "launch.rollout_addresses", "launch.reward_addresses", "coordinator=HOST:PORT"],
    ),
    "heartbeats": (
        ["launch.heartbeat_interval_s=5", "launch.lost_after_s=6"],
        ["launch.lost_after_s=6", "twice launch.heartbeat_interval_s=5"],
    ),
    "rollout devices count": (
        ["launch.rollout_devices=[cuda:2]"],
        ["launch.rollout_devices has 1 entries", "launch.rollout_replicas=2", "one device per replica"],
    ),
    "rollout device misspelt": (
        ["launch.rollout_devices=[cuda2,cuda:3]"],
        ["launch.rollout_devices ['cuda2']", "'cuda:N'"],
    ),
    "torchrun trainer on a fixed GPU": (
        ["trainer.device=cuda:3"],
        ["launch.trainer_nproc=2", "LOCAL_RANK", "set trainer.device=cuda, not 'cuda:3'"],
    ),
    "validation without prompts": (
        ["data.val_prompts=0"],
        ["schedule.eval_every=30", "data.val_prompts=0", "schedule.eval_every=0"],
    ),
    "no dataset": (["data.dataset="], ["data.dataset", "flowgrpo data prepare"]),
    "vLLM-Omni in fp32": (
        ["rollout.engine=vllm_omni", "rollout.dtype=float32"],
        ["rollout.engine=vllm_omni samples in bfloat16 only", "set rollout.dtype=bfloat16"],
    ),
    "vLLM-Omni with peft LoRA": (
        ["rollout.engine=vllm_omni", "rollout.lora_mode=peft"],
        ["rollout.lora_mode=peft", "only the native engine", "rollout.lora_mode=merge"],
    ),
    "unknown engine": (["rollout.engine=vllm"], ["rollout.engine: 'vllm' is not one of", "'vllm_omni'"]),
    "FP8 with peft LoRA": (
        ["rollout.precision=fp8", "rollout.lora_mode=peft"],
        ["rollout.precision=fp8 quantizes the LoRA merged", "set rollout.lora_mode=merge"],
    ),
    "FP8 on vLLM-Omni": (
        ["rollout.precision=fp8", "rollout.engine=vllm_omni"],
        ["rollout.precision=fp8 is the native engine's", "not vllm_omni"],
    ),
    "FP8 in fp32 on a GPU": (
        ["rollout.precision=fp8", "rollout.dtype=float32"],
        ["rollout.precision=fp8 on a GPU writes its GEMMs' outputs in bfloat16", "rollout.dtype=bfloat16"],
    ),
    "FP8 with the bypass": (
        ["rollout.precision=fp8", "trainer.loss.logp_old=bypass", "trainer.loss.max_logp_gap=1e-3"],
        ["rollout.precision=fp8 samples another policy", "use trainer.loss.logp_old=recompute"],
    ),
    "unknown precision": (["rollout.precision=fp4"], ["rollout.precision: 'fp4' is not one of", "'fp8'"]),
    "GRPO-Guard without the recompute": (
        ["trainer.loss.mode=grpo_guard", "trainer.loss.logp_old=bypass", "trainer.loss.max_logp_gap=0"],
        ["trainer.loss.mode=grpo_guard", "use trainer.loss.logp_old=recompute"],
    ),
    "GRPO-Guard with CPS steps": (
        ["trainer.loss.mode=grpo_guard", "sampling.sde_type=cps", "sampling.noise_level=0.8"],
        ["trainer.loss.mode=grpo_guard", "sampling.sde_type=sde, not 'cps'"],
    ),
    "GRPO-Guard for DiffusionNFT": (
        ["trainer.algorithm=diffusion_nft", "trainer.loss.mode=grpo_guard"],
        ["trainer.algorithm=diffusion_nft has its own", "trainer.loss.mode=flow_grpo"],
    ),
    "NFT beta": (
        ["trainer.algorithm=diffusion_nft", "trainer.algorithm.beta=0"],
        ["trainer.algorithm.beta=0.0"],
    ),
    "DGPO times beyond the schedule": (
        ["trainer.algorithm=dgpo", "trainer.algorithm.time_points=20"],
        ["trainer.algorithm.time_points=20 exceeds the schedule's 14 steps", "sampling.num_points"],
    ),
    "another algorithm's key": (
        ["trainer.algorithm.beta=0.1"],  # BASE trains FlowGRPO, which has no beta
        ["unknown key 'trainer.algorithm.beta'", "valid keys under 'trainer.algorithm': name)"],
    ),
    "the section of an older version": (
        ["trainer.nft.beta=0.1"],
        [
            "'trainer.nft' is gone",
            "trainer.algorithm: {name: diffusion_nft, ...}",
            "trainer.algorithm.KEY=VALUE",
        ],
    ),
    "DGPO more times than points": (
        ["trainer.algorithm=dgpo", "trainer.algorithm.trained_times=6"],
        ["trainer.algorithm.trained_times=6", "trainer.algorithm.time_points=5"],
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_OVERRIDES))
def test_a_bad_override_names_the_key_and_the_fix(case: str) -> None:
    overrides, words = BAD_OVERRIDES[case]
    with pytest.raises(ConfigError) as error:
        load_run_config(BASE, [*PICKSCORE_ARGS, *overrides])
    for w in words:
        assert w in str(error.value), f"{w!r} not in: {error.value}"


BAD_FILES = {  # case: (a line of the recipe, its bad replacement, what the message says)
    "unknown key": (
        "  noise_level: 1.3",
        "  noise_levl: 1.3",
        ["'sampling.noise_levl'", "did you mean sampling.noise_level"],
    ),
    "wrong type": ("    lr: 1.0e-4", "    lr: fast", ["trainer.optim.lr", "expected float", "'fast'"]),
    "window outside the schedule": (
        "  window_range: [0, 7]",
        "  window_range: [0, 15]",
        ["sampling.window_range=[0, 15]", "hi <= 14"],
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_a_bad_recipe_file_names_the_file_the_key_and_the_fix(case: str, tmp_path: Path) -> None:
    old, new, words = BAD_FILES[case]
    text = BASE.read_text()
    assert text.count(old + "\n") == 1
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(text.replace(old + "\n", new + "\n"))
    with pytest.raises(ConfigError) as error:
        load_run_config(recipe, PICKSCORE_ARGS)
    message = str(error.value)
    if case in {"unknown key", "wrong type"}:
        assert message.startswith(str(recipe)), message  # the loader names the file it read
    for w in words:
        assert w in message, f"{w!r} not in: {message}"


def test_the_gpu_benchmark_recipe_loads() -> None:
    """bench/coordinator_2gpu.yaml (bench/coordinator_gpu.sh) is a recipe too: rollout and trainer
    on two GPUs of one host, LoRA, the JPEG reward, 16 images per step."""
    cfg = load_run_config(EXAMPLES.parent / "bench" / "coordinator_2gpu.yaml")
    assert cfg.launch.rollout_devices == ["cuda:0"] and cfg.trainer.device == "cuda:1"
    assert cfg.trainer.policy.kind == "lora" and cfg.samples_per_step == 16
    assert [s.name for s in cfg.reward.scorers] == ["jpeg_compressibility"]


def test_a_recipes_paths_are_relative_to_it_and_the_command_lines_to_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`flowgrpo train /abs/path/recipe.yaml` from any folder finds the recipe's data."""
    monkeypatch.chdir(tmp_path)
    cfg = load_run_config(ROOT / "examples" / "tiny_jpeg.yaml")
    assert cfg.data.prompts == str(ROOT / "examples" / "data" / "tiny")
    assert (Path(cfg.data.prompts) / "train.txt").is_file()
    typed = load_run_config(
        ROOT / "examples" / "tiny_jpeg.yaml", ["data.prompts=mine", "model.checkpoint=/ckpt"]
    )
    assert typed.data.prompts == "mine" and typed.model.checkpoint == "/ckpt"
