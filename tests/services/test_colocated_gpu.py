"""Rollout and trainer on one GPU, the rollout mapping the trainer's frozen base by CUDA IPC
(trainer.share_base, rollout.base_weights=trainer): a short demo run, every service its own
process, trains bitwise like the same run where each loads its own weights, in the weights' dtype
and with FP8 rollouts. GPU only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flowgrpo.configs.run import load_run_config
from flowgrpo.services.coordinator.train import train

pytestmark = pytest.mark.gpu

DEMO = Path(__file__).resolve().parents[2] / "examples" / "tiny_jpeg.yaml"
ONE_GPU = [
    "schedule.steps=3", "schedule.eval_every=0", "schedule.save_every=0", "data.val_prompts=0",
    "rollout.device=cuda:0", "launch.rollout_devices=[cuda:0]", "rollout.compile=false",
    "rollout.lora_mode=merge", "trainer.device=cuda:0", "trainer.publish_cuda_ipc=true",
    "trainer.policy.kind=lora", "trainer.policy.lora_rank=4", "trainer.policy.lora_alpha=8.0",
    "trainer.optim.lr=1e-2",
]  # fmt: skip
SHARED = ["trainer.share_base=true", "rollout.base_weights=trainer", "rollout.release_memory=true",
          "trainer.release_memory=true"]  # fmt: skip
COMPARED = ("critic/score/mean", "actor/pg_loss", "actor/rollout_logp_gap/max", "actor/grad_norm")


# rollout.precision=fp8: bf16 weights, the gen path's linear layers in FP8 (Hopper's FP8 GEMMs);
# mapped, the trainer's bf16 base is quantized into the rollout's own FP8 copy. Eager: compiled
# FP8 layers are tests/models/test_fp8_gpu.py's (compiling here cost the GPU check 50 s)
FP8 = ["rollout.precision=fp8", "rollout.dtype=bfloat16", "trainer.dtype=bfloat16"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("precision", ["dtype", "fp8"])
def test_a_rollout_mapping_the_trainers_base_trains_like_one_loading_its_own(
    tmp_path: Path, precision: str
) -> None:
    runs = {}
    for name, extra in (("own", []), ("shared", SHARED)):
        overrides = [f"run_dir={tmp_path / name}", *ONE_GPU, *extra, *(FP8 if precision == "fp8" else [])]
        runs[name] = train(load_run_config(DEMO, overrides), progress=None)
    own, shared = runs["own"], runs["shared"]
    assert len(own) == len(shared) == 3
    for step, (a, b) in enumerate(zip(own, shared, strict=True), start=1):
        for key in COMPARED:
            assert a[key] == b[key], f"step {step} {key}: {a[key]} vs {b[key]}"
    assert own[-1]["critic/score/mean"] != own[0]["critic/score/mean"], "the policy moved"
    if precision == "fp8":  # FP8 samples: the trainer saw the quantization's gap and weighted them
        assert all(r["actor/fp8_logp_gap/max"] > 0 and "actor/is_weight/mean" in r for r in own)
    logs = "".join(p.read_text() for p in (tmp_path / "shared" / "logs").glob("rollout*.log"))
    assert "mapped" in logs and "of the trainer's base tensors" in logs
