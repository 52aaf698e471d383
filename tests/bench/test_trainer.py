"""``flowgrpo bench trainer`` on the tiny model, CPU, fp32: every code path of a LoRA row and the
publication runs, and the figures hold together (the speeds and MFUs recompute from the stored
timings, FLOPs and peak; each step's two passes fit inside it)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from flowgrpo.models.bagel import parallelize
from flowgrpo.models.bagel.config import tiny
from flowgrpo.models.bagel.model import MoTDecoderLayer
from flowgrpo.services.bench import trainer, trainer_step

from .figures import check_figures, median

MODEL = ["--model", "tiny", "--device", "cpu", "--dtype", "fp32", "--lora-rank", "4"]
SIZES = ["--resolution", "32", "--num-points", "8", "--batch", "4", "--group", "2", "--prompt-len", "6"]
TINY = MODEL + SIZES


def expected_row_flops(context: int, layers: int = tiny().layers) -> dict[str, float]:
    """One row of TINY (one CFG branch of one trajectory at one trained time), written out from
    the shapes rather than taken from the report: T = 4 latent tokens + 2 markers, K = context + T
    keys, rank-4 LoRA on all seven gen-path linears. Forward = the gen matmuls 2 P T + attention
    (QK^T and AV, 2 T K d each per head) 4 T K d H L + LoRA 2 T r S L; the backward's activation
    gradients every matmul again but layer 0's q/k/v, whose input needs none (nor their LoRA A's
    input), and attention twice (dQ, dK, dV and the softmax's input: four matmuls the size of the
    forward's two), its weight gradients the LoRA's alone (dA, dB: its matmuls again); activation
    checkpointing recomputes the forward's matmuls without attention."""
    cfg = tiny()
    q, kv, h, i = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.hidden, cfg.intermediate
    gen_params = layers * (2 * h * q + 2 * h * kv + 3 * h * i)  # q, o; k, v; gate, up, down
    layer0_qkv = h * q + 2 * h * kv
    in_plus_out = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h)
    tokens, rank = 4 + 2, 4
    lora = 2 * tokens * rank * in_plus_out * layers
    attention = 4 * tokens * (context + tokens) * cfg.head_dim * cfg.heads * layers
    act_grads = 2 * tokens * (gen_params - layer0_qkv) + 2 * attention + lora - 2 * tokens * rank * 3 * h
    return {
        "forward": 2 * gen_params * tokens + attention + lora,
        "backward": act_grads + lora,
        "recompute": 2 * gen_params * tokens + lora,
    }


def expected_pass_flops(layers: int = tiny().layers) -> dict[str, float]:
    """The logp_old and update passes of TINY (and the update's recompute): 4 trajectories of two
    prompts (6 and 14 tokens: --prompt-len 6, the next + 8), each a conditional and an
    empty-context row, at each of the 2 window steps. The logp_old pass recomputes the second
    mini-batch's 2 trajectories (the 14-token prompt's) alone: the first mini-batch's come from
    their own update forwards."""
    old = update = recompute = 0.0
    window = 2
    for trajectory, prompt in enumerate([6, 6, 14, 14]):
        for context in (prompt, 0):
            row = expected_row_flops(context, layers)
            old += window * row["forward"] if trajectory >= 2 else 0.0
            update += window * (row["forward"] + row["backward"])
            recompute += window * row["recompute"]
    return {"old": old, "update": update, "recompute": recompute}


def expected_nft_flops() -> dict[str, float]:
    """DiffusionNFT's step on TINY, CFG-free: per trajectory (its conditional row) and each of its
    6 trained times, one forward of the old policy ("old") and one forward-backward ("update")."""
    rows = [expected_row_flops(prompt) for prompt in [6, 6, 14, 14]]
    times = 6
    return {
        "old": times * sum(r["forward"] for r in rows),
        "update": times * sum(r["forward"] + r["backward"] for r in rows),
        "recompute": times * sum(r["recompute"] for r in rows),
    }


class Clocks:
    """The wall clock here around each variant's timed steps (trainer_step's ``run_timed``: its
    warm-up and timed steps) and around each step inside (``_step``): a step's reported time
    encloses the step, and the variant's steps lie inside its call, one after another."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[float] = []  # each variant's call: seconds
        self.steps: list[list[float]] = []  # each variant's steps: seconds, the warm-up first
        run_timed, step = trainer_step.run_timed, trainer_step._step

        def timed_run(*args: Any, **kwargs: Any) -> Any:
            self.steps.append([])
            begin = time.perf_counter()
            out = run_timed(*args, **kwargs)
            self.calls.append(time.perf_counter() - begin)
            return out

        def timed_step(*args: Any, **kwargs: Any) -> Any:
            begin = time.perf_counter()
            out = step(*args, **kwargs)
            self.steps[-1].append(time.perf_counter() - begin)
            return out

        monkeypatch.setattr(trainer_step, "run_timed", timed_run)
        monkeypatch.setattr(trainer_step, "_step", timed_step)

    def check(self, rows: list[dict[str, Any]]) -> None:
        for row, call, steps in zip(rows, self.calls, self.steps, strict=True):
            warm, timed = row["once_s"]["warmup_step"], row["step_s"]["values"]
            assert len(steps) == 1 + len(timed) == 4, row["variant"]
            assert steps[0] <= warm and all(s <= t for s, t in zip(steps[1:], timed, strict=True)), row
            assert warm + sum(timed) <= call, (row["variant"], warm, timed, call)


def test_the_trainer_benchmark_reports_consistent_figures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The FLOPs and MFUs against the formulas written out above (rel 1e-12: the same integer
    counts summed in another order, as floats), the times against the wall clock around them."""
    out = tmp_path / "trainer.json"
    variants = "none2,ac4,ac4-every2,none2-nft,none2-microprefill"
    clocks = Clocks(monkeypatch)
    assert trainer.main([*TINY, "--variants", variants, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    check_figures(report)
    clocks.check(report["rows"])
    peak = report["matmul_peak"]
    assert peak["used_tflops"] == max(median(peak["before"]), median(peak["after"]))
    assert peak["before"]["n"] == peak["after"]["n"] == 10
    flops, world, used = report["flops"], report["world"], peak["used_tflops"] * 1e12
    expected = expected_pass_flops()
    assert flops == pytest.approx(expected, rel=1e-12)
    assert [r["variant"] for r in report["rows"]] == [
        "none2",
        "ac4",
        "ac4-every2",
        "none2-nft",
        "none2-microprefill",
    ]
    # the step prefills its 2 prompts once (4 trajectories of 2 prompts); '-microprefill' each of
    # its 3 micro-batches of 2 rows (the logp_old pass 1: the second mini-batch's; the 2
    # optimizer steps 1 each)
    prefills = [r["forwards"]["prefill_rows"] for r in report["rows"]]
    assert prefills[:4] == [[2]] * 4 and prefills[4] == [2] * 3
    assert report["rows"][4]["loss"] == pytest.approx(report["rows"][0]["loss"], rel=1e-4)
    # the tiny model's 2 layers: every2 checkpoints layer 0 alone, so recomputes half of ac4's
    assert [r["checkpointed_share"] for r in report["rows"]] == [0.0, 1.0, 0.5, 0.0, 0.0]
    assert report["flops_nft"] == pytest.approx(expected_nft_flops(), rel=1e-12)
    _check_nft_row(report["rows"][3], report["nft_times_per_sample"], world, used)
    for row in report["rows"][:3]:
        assert "error" not in row, row
        step = row["step_s"]
        assert step["n"] == 3
        assert median(row["traj_per_s_per_gpu"]) * median(step) * world == pytest.approx(row["trajectories"])
        # the step's counted forwards are the passes written out: its MFUs recompute from those
        old_pass, update_pass = expected["old"] / world, expected["update"] / world
        mfu_step = (old_pass + update_pass) / median(step) / used
        assert median(row["mfu_step"]) == pytest.approx(mfu_step, rel=1e-12)
        mfu_update = update_pass / median(row["update_s"]) / used
        assert median(row["mfu_update"]) == pytest.approx(mfu_update, rel=1e-12)
        mfu_old = old_pass / median(row["old_log_prob_s"]) / used
        assert median(row["mfu_old_log_prob"]) == pytest.approx(mfu_old, rel=1e-12)
        share = {"none2": 0.0, "ac4": 1.0, "ac4-every2": 0.5}[row["variant"]]  # layers checkpointed
        hfu = (update_pass + share * expected["recompute"] / world) / median(row["update_s"]) / used
        assert median(row["hfu_update"]) == pytest.approx(hfu, rel=1e-12)
        parts = zip(row["old_log_prob_s"]["values"], row["update_s"]["values"], step["values"], strict=True)
        assert all(old + update <= total for old, update, total in parts)  # the same three runs
        assert row["sync_logp_gap_max"] < 1e-4  # fp32: the warm-up step recomputes the sampler's log-probs
    assert report["rows"][1]["checkpointing"] and median(report["rows"][1]["hfu_update"]) > median(
        report["rows"][1]["mfu_update"]
    )
    _check_publication(report["publication"])
    assert "median (min-max) of 3 steps after a warm-up" in capsys.readouterr().out


def _check_nft_row(row: dict[str, Any], times: int, world: int, used: float) -> None:
    """DiffusionNFT's step: its old-policy forwards are inside the update pass (no log-prob pass),
    CFG-free: per trajectory and time, one forward of the old policy and one forward-backward."""
    assert "error" not in row, row
    assert times == int(7 * 0.99) == 6  # 8 schedule points: 7 times before t = 0, the reference's 0.99
    assert "mfu_old_log_prob" not in row and median(row["old_log_prob_s"]) == 0.0
    expected = expected_nft_flops()
    total = (expected["old"] + expected["update"]) / world
    assert median(row["mfu_update"]) == pytest.approx(total / median(row["update_s"]) / used, rel=1e-12)
    assert median(row["mfu_step"]) == pytest.approx(total / median(row["step_s"]) / used, rel=1e-12)


def _check_publication(pub: dict[str, object]) -> None:
    assert pub["gather_s"]["n"] == 3  # type: ignore[index]
    for key, bytes_per_value in (("bus_fp32", 4), ("bus_bfloat16", 2)):
        assert pub[f"{key}_publish_s"]["n"] == 3  # type: ignore[index]
        consumer = pub[f"{key}_consumer"]
        assert isinstance(consumer, dict) and "error" not in consumer, consumer
        assert consumer["bytes"] == pub["bytes_fp32"] // 4 * bytes_per_value  # type: ignore[operator]
        assert consumer["tensors"] == pub["tensors"]
        took = zip(consumer["fetch_s"]["values"], consumer["total_s"]["values"], strict=True)
        assert all(fetch <= whole for fetch, whole in took)


def test_each_algorithm_is_timed_on_the_forwards_its_step_runs(tmp_path: Path) -> None:
    """Every algorithm's variant trains, and its FLOPs come from the velocity forwards its
    warm-up step ran, counted by pass, grad mode and context: FlowGRPO's and GRPO-Guard's equal
    the pass formula written out above; the others' counts are their recipes' per-sample work
    (2 samples of each prompt, CFG-free): AWM 6 times, each the policy with gradients and its EMA
    without; DGPO 4 times, each the current, reference and old errors without gradients (the
    groups' statistics come first) and the current again with them."""
    out = tmp_path / "trainer.json"
    variants = "none2,none2-awm,none2-dgpo,none2-guard"
    assert trainer.main([*TINY, "--variants", variants, "--no-publish", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = {r["variant"]: r for r in report["rows"]}
    assert [r["algorithm"] for r in rows.values()] == ["flow_grpo", "awm", "dgpo", "grpo_guard"]
    expected = expected_pass_flops()
    used = report["matmul_peak"]["used_tflops"] * 1e12
    for name in ("none2", "none2-guard"):
        assert rows[name]["flops"] == pytest.approx(expected, rel=1e-12)

    def counts(name: str) -> dict[tuple[str, bool, int], int]:
        assert rows[name]["forwards"]["latent_tokens"] == 4
        return {(phase, grad, context): n for phase, grad, context, n in rows[name]["forwards"]["rows"]}

    assert counts("none2-awm") == {
        ("update", grad, length): 2 * 6 for grad in (False, True) for length in (6, 14)
    }
    assert counts("none2-dgpo") == {
        ("update", grad, length): 2 * 4 * (1 if grad else 3) for grad in (False, True) for length in (6, 14)
    }
    for name in ("none2-awm", "none2-dgpo"):
        row = rows[name]
        update = 0.0  # each counted row's FLOPs written out: a forward, with gradients its backward too
        for (_, grad, context), n in counts(name).items():
            flops = expected_row_flops(context)
            update += n * (flops["forward"] + (flops["backward"] if grad else 0.0))
        assert row["flops"]["old"] == 0 and "mfu_old_log_prob" not in row
        assert row["flops"]["update"] == pytest.approx(update, rel=1e-12)
        assert median(row["mfu_step"]) == pytest.approx(update / median(row["step_s"]) / used, rel=1e-12)


def test_the_fp8_experiment_changes_the_numbers_of_its_row_alone(tmp_path: Path) -> None:
    """'-fp8' (bench.trainer_step.fp8_bases): its row trains through the frozen base's FP8 GEMMs
    (the CPU's reference kernel), so its log-probs leave the fp32 sampler's by FP8's error and its
    gradient differs; the variant after it has the fp32 layers back (checkpointing recomputes
    bitwise, so it trains as the first row)."""
    out = tmp_path / "trainer.json"
    assert trainer.main([*TINY, "--variants", "none2,none2-fp8,ac2", "--no-publish", "--json", str(out)]) == 0
    plain, fp8, after = json.loads(out.read_text())["rows"]
    assert (plain["fp8"], fp8["fp8"], after["fp8"]) == (False, True, False)
    assert plain["sync_logp_gap_max"] == after["sync_logp_gap_max"] == 0.0
    assert 1e-7 < fp8["sync_logp_gap_max"] < 1e-3  # FP8's error on the tiny model, not another function
    assert after["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-6)
    assert fp8["grad_norm"] != pytest.approx(plain["grad_norm"], rel=1e-3)
    assert 0.5 < fp8["grad_norm"] / plain["grad_norm"] < 2.0


def test_every_compiled_variant_of_one_call_compiles_as_in_a_fresh_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Compiled variants one after another in one call each compile afresh: four once failed in
    Dynamo (its recompile limit of 8 counted the graphs of the three before the fourth, all cached
    on the same query methods' code). One variant caches 3 graphs on each query method, so with
    the limit at 5 the second of two variants fails unless the first's are gone. The claim is
    Dynamo's cache, so Dynamo's graphs alone are compiled (the eager backend: Inductor's code
    generation made four variants take 3-5 minutes of 2 CPU cores)."""
    eager = functools.partial(parallelize.compile_query_layers, backend="eager")
    monkeypatch.setattr(trainer_step, "compile_query_layers", eager)
    out = tmp_path / "trainer.json"
    variants = "none1-compile,ac2-compile-fp8"  # the first and the last of the '-fp8' device call's four
    limit = 5
    with torch._dynamo.config.patch(recompile_limit=limit):
        assert trainer.main([*TINY, "--variants", variants, "--no-publish", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [row["variant"] for row in rows] == variants.split(",")
    assert [row.get("error", "") for row in rows] == [""] * 2
    assert all(row["compiled"] for row in rows)
    # the last variant's graphs on each method: more than half the limit, or two variants would fit
    methods = (MoTDecoderLayer.query_qkv, MoTDecoderLayer.query_out)
    cached = [len(_debug_get_cache_entry_list(m.__code__)) for m in methods]
    assert all(limit / 2 < n <= limit for n in cached), cached


def test_fewer_than_three_timed_steps_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        trainer.main([*TINY, "--reps", "2"])
    assert "every figure is a median of >= 3 runs" in capsys.readouterr().err


def test_a_checkpoint_every_step_is_timed_three_ways(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--checkpoint-every-step``: the step alone, with a synchronous and with a background save
    after it; every cycle a median of 3 after a warm-up, each ratio recomputes from the cycles,
    the blocking part of a save fits in its cycle, and the folder is removed afterwards."""
    out, folder = tmp_path / "trainer.json", tmp_path / "ckpt"
    args = [*TINY, "--variants", "none2", "--no-publish", "--checkpoint-every-step", str(folder)]
    assert trainer.main([*args, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    check_figures(report)
    cost = report["checkpoint_every_step"]
    assert cost["variant"] == "none2" and cost["checkpoint_bytes"] > 0 and not folder.exists()
    assert median(cost["none"]["save_s"]) == 0.0
    for way in ("sync", "async"):
        cycle, save = cost[way]["cycle_s"], cost[way]["save_s"]
        assert cycle["n"] == save["n"] == 3
        assert all(s <= c for s, c in zip(save["values"], cycle["values"], strict=True))
        assert median(cost[way]["cycle_over_none"]) == pytest.approx(
            median(cycle) / median(cost["none"]["cycle_s"])
        )
    assert "a checkpoint every step (none2" in capsys.readouterr().out


def test_a_checkpoint_with_fewer_layers_is_counted_by_its_own_layers(tmp_path: Path) -> None:
    """``--checkpoint`` of a geometry cut to 1 decoder layer (``--write-checkpoint --layers 1``):
    the FLOPs, and so the MFU, are those of the layers loaded, not of the full geometry's."""
    assert tiny().layers > 1
    ckpt, out = tmp_path / "one-layer", tmp_path / "trainer.json"
    assert trainer.main([*MODEL, "--write-checkpoint", str(ckpt), "--layers", "1"]) == 0
    args = [*TINY, "--variants", "none2", "--no-publish", "--checkpoint", str(ckpt), "--reps", "3"]
    assert trainer.main([*args, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["lora_params_formula"] == report["trainable_params"]
    assert report["flops"] == pytest.approx(expected_pass_flops(layers=1), rel=1e-12)


def test_the_profile_finds_each_step_s_matmuls_and_its_optimizer(tmp_path: Path) -> None:
    """``--profile`` as a user runs it, in a process of its own (torch.profiler's global state stays
    out of the test process): one step's ATen time by kind on a CPU, the GEMMs and AdamW's foreach
    kernels among them, inside the step's own time."""
    out = tmp_path / "trainer.json"
    command = [sys.executable, "-m", "flowgrpo.services.bench.trainer", *TINY, "--variants", "none2",
               "--no-publish", "--profile", "--json", str(out)]  # fmt: skip
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=240, env=os.environ | {"OMP_NUM_THREADS": "1"}
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "none2: one step's kernels" in done.stdout
    (row,) = json.loads(out.read_text())["rows"]
    kernels = row["kernels"]
    assert sum(k["share"] for k in kernels["kinds"].values()) == pytest.approx(1.0)
    # AdamW's aten::_foreach_* ops (on a GPU its multi_tensor_apply kernels) land in "optimizer"
    assert kernels["kinds"]["gemm"]["ms_per_call"] > 0 and kernels["kinds"]["optimizer"]["ms_per_call"] > 0
    assert kernels["busy_share"] == pytest.approx(kernels["ms_per_call"] / (1e3 * median(row["step_s"])))
    # one thread: the ops' self times lie inside the profiled step's own wall time (counting a
    # nested op's time in its parent too would exceed it); against an unprofiled step's time the
    # share is only > 0 on a CPU, where recording each op costs microseconds of a 40 ms step
    assert 0 < kernels["ms_per_call"] <= kernels["wall_ms_per_call"]
    assert kernels["busy_share"] > 0
