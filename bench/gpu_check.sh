#!/usr/bin/env bash
# The GPU check: what CPU-only CI cannot see, in ONE device call on one GPU, in under 10 minutes.
# A change that touches a GPU path (CUDA IPC, the shared base, compile, attention backends, FSDP
# on CUDA, precision) is done only when this passed on its final commit (docs/ARCHITECTURE.md,
# "The GPU check"); its last line is the summary to quote.
#   run(command="COMMIT=<the hash, written out> bash bench/gpu_check.sh", carry=[".whl"],
#       kind="nvidia-h200", timeout_s=600)
# (.whl: bench/fetch_gpu_wheels.sh; COMMIT: the caller names the commit whose tree it sent, as a
# literal: a `$(git rev-parse HEAD)` in the command runs on the device, whose copy of the tree is
# not the caller's git: on 2026-12-06 it named a commit three older than the tree.) Stages, each timed:
#   1. layout: what this torch's `_share_cuda_()` returns, field by field ($OUT/cuda_ipc_layout.json;
#      the gpu tests compare it with tests/bus/cuda_ipc_layouts.json, which the CPU tests build from);
#   2. tests: every `gpu`-marked test but the vLLM-Omni ones (their own venv): among them a LoRA
#      and the shared base published by CUDA IPC through the real rollout service's LoadWeights,
#      bitwise against the bus, and two short runs (rollout and trainer two processes on one GPU,
#      the adapter over CUDA IPC; then the base shared too) that train bitwise alike;
#   3. system: the one-GPU recipe (examples/bagel_pickscore_lora_1gpu.yaml: rollout, trainer and
#      reward their own processes on one GPU, the base shared and the LoRA published by CUDA IPC,
#      compile, bf16, PickScore's geometry on the GPU) for SYSTEM_STEPS steps (the first a warm-up)
#      of 2 prompts x 8 samples, at the 7B geometry cut to SYSTEM_LAYERS of its 28 decoder layers:
#      every layer's shapes and kernels, the same code paths, minutes less of loading and
#      compiling. Its images/s is a smoke figure, not the recipe's: the full 7B figure of docs/performance.md
#      is `bash bench/system_gpu.sh` (a call of its own: a step of 128 images takes ~2.5 min).
# Measured (H200, torch 2.11): the tests 2 min until FP8 added its runs; then 296 s one after the other
# (c674b7b: 11 passed); as two processes at once 155 s (69e8dd5 on an H100; the whole check 424 s),
# then 316 s (1e39193, H100: 568 s of the 600) and 381 s (H200, 2026-12-07: the FP8 and compile
# tests, 124 + 64 + 57 + 59 s, one after the other in the second process). Now every stage runs at
# once, on one GPU: the tests as four processes (the one-GPU service runs; the FP8 tests; the
# compiled ones; the rest), and the system stage beside them. The tests' models are tiny (a few
# GiB of the GPU at most) and their time is mostly the CPU's (compiles, 16 cores), so the system
# stage's 62 GiB fit beside them; its images/s is a smoke figure, taken beside the tests.
# At 28 layers and 128 images a step the first step alone took 210-268 s, which is why the
# check cuts both.
# Environment: OUT (default /tmp/gpu-check), COMMIT, SYSTEM_STEPS (4; 0 skips the system stage,
# and the verdict then says the tests passed and the system did not run), SYSTEM_LAYERS (2).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
SYSTEM_STEPS=${SYSTEM_STEPS:-4}
SYSTEM_LAYERS=${SYSTEM_LAYERS:-2}
source bench/gpu_env.sh
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
started=$SECONDS
declare -A status seconds

stage() {  # stage NAME COMMAND...: run it, its output to $OUT/stage-NAME.log, "STATUS SECONDS" to $OUT/NAME.status
    local name=$1 begin=$SECONDS
    shift
    echo "=== $name: started at $((SECONDS - started)) s: $*" >&2
    "$@" >"$OUT/stage-$name.log" 2>&1
    local rc=$?
    echo "$rc $((SECONDS - begin))" >"$OUT/$name.status"
    echo "=== $name: exit $rc in $((SECONDS - begin)) s" >&2
}
collect() {  # collect NAME: its status and seconds into the arrays
    local rc=1 secs=0
    [[ -f $OUT/$1.status ]] && read -r rc secs <"$OUT/$1.status"
    status[$1]=$rc seconds[$1]=$secs
}

$PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))' \
    | tee "$OUT/env.txt"
stage layout $PY tests/bus/cuda_ipc_layouts.py "$OUT/cuda_ipc_layout.json"
collect layout

# the gpu tests in four pytest processes at once, each its report $OUT/gpu-tests-NAME.xml: the
# one-GPU service runs (~180 s), the FP8 tests (~200 s, compiles), the other compiled ones
# (~120 s), the rest; a file in no group of its own goes to the rest
mapfile -t gpu_tests < <(grep -rlE "pytest\.mark\.gpu|mark\.gpu\b" tests --include='test_*.py' | sort)
declare -A TEST_GROUPS=(
    [colocated]="tests/services/test_colocated_gpu.py"
    [fp8]="tests/models/test_fp8_gpu.py tests/bench/test_fp8_torchao.py"
    [compiled]="tests/models/test_bagel_gpu.py tests/trainer/test_sft_gpu.py"
)
grouped=" ${TEST_GROUPS[*]} "
rest=()
for f in "${gpu_tests[@]}"; do [[ $grouped == *" $f "* ]] || rest+=("$f"); done
TEST_GROUPS[rest]="${rest[*]}"
gpu_pytest() {  # gpu_pytest NAME FILES...: one process, its report $OUT/gpu-tests-NAME.xml
    local name=$1
    shift
    $PY -m pytest -p no:cacheprovider -o addopts="" -m "gpu and not vllm_omni" -q -rfEs \
        --junitxml="$OUT/gpu-tests-$name.xml" "$@" >"$OUT/tests-$name.log" 2>&1
}
run_gpu_tests() {
    local pids=() name rc=0
    for name in "${!TEST_GROUPS[@]}"; do
        # shellcheck disable=SC2086  # the group's files, split on spaces
        stage "tests-$name-run" gpu_pytest "$name" ${TEST_GROUPS[$name]} &
        pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid"; done
    for name in "${!TEST_GROUPS[@]}"; do
        collect "tests-$name-run"
        echo "tests $name: exit ${status[tests-$name-run]} in ${seconds[tests-$name-run]} s"
        rc=$((rc || status[tests-$name-run]))
    done
    grep -hvE "^DEBUG " "$OUT"/tests-*.log | grep -E "passed|failed|FAILED|ERROR" || true
    return $rc
}
stage tests run_gpu_tests &
tests_pid=$!
if [ "$SYSTEM_STEPS" = 0 ]; then  # a call with too little device time left for the system stage
    echo "skipped 0" >"$OUT/system.status"
else
    stage system env LAYERS="$SYSTEM_LAYERS" OUT="$OUT" bash bench/system_gpu.sh --steps "$SYSTEM_STEPS" \
        --variant check data.prompts_per_step=2 data.group_size=8 &
fi
wait
collect tests
collect system
cat "$OUT/stage-tests.log"

$PY - "$OUT" "$COMMIT" "$((SECONDS - started))" "${status[layout]}" "${status[tests]}" "${status[system]}" \
    "${seconds[tests]}" "${seconds[system]}" "$SYSTEM_LAYERS" <<'EOF'
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path
out, commit, total, st_layout, st_tests, st_system, s_tests, s_system, layers = sys.argv[1:]
parts, ok = [], st_layout == st_tests == "0" and st_system in ("0", "skipped")
try:
    reports = sorted(Path(out).glob("gpu-tests-*.xml"))
    if len(reports) != 4:
        raise OSError(f"{len(reports)} of the 4 reports (gpu-tests-colocated, -fp8, -compiled, -rest .xml)")
    counts = dict.fromkeys(("tests", "failures", "errors", "skipped"), 0)
    for report in reports:
        suite = ET.parse(report).getroot()
        suite = suite if suite.tag == "testsuite" else suite[0]
        for k in counts:
            counts[k] += int(suite.get(k, 0))
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    parts.append(f"gpu tests {passed} passed, {counts['failures'] + counts['errors']} failed, "
                 f"{counts['skipped']} skipped ({s_tests} s)")
    ok = ok and passed > 0 and counts["skipped"] == 0
except (OSError, ET.ParseError, IndexError) as error:
    parts.append(f"gpu tests: no report ({error})")
    ok = False
if st_system == "skipped":
    parts.append("system: skipped (SYSTEM_STEPS=0)")
else:
    try:
        variant = json.loads((Path(out) / "system.json").read_text())["variants"]["check"]
        rate, share = variant["images_per_s"], variant["achieved_over_limit"]
        memory = variant["gpu_memory_gib"]
        peak = f", peak {max(memory.values()):.1f} GiB" if isinstance(memory, dict) else ""
        parts.append(f"system ({layers} layers) {rate['median']:.3f} images/s ({rate['min']:.3f}-"
                     f"{rate['max']:.3f}, n={rate['n']}), {share['median']:.1%} of its limit{peak} ({s_system} s)")
    except (OSError, KeyError, ValueError) as error:
        parts.append(f"system: no figures ({type(error).__name__}: {error})")
        ok = False
# without its system stage the check has not passed: it says which part did
verdict = ("PASSED" if st_system != "skipped" else "TESTS PASSED, SYSTEM NOT RUN") if ok else "FAILED"
print(f"GPU CHECK {verdict} at {commit} in {total} s: " + "; ".join(parts))
sys.exit(0 if ok else 1)
EOF
