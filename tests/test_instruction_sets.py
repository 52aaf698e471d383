"""The CPU's bitwise claims hold on every CPU of the kind CI runs on, not only on the one at hand.

A claim that held on AVX-512 machines once failed on an AMD EPYC (AVX2): two paths of the
scheduler's parity test ran their matmuls on different thread counts, which MKL's kernels there
split into different sums. Every test that claims exact equality is marked ``exact`` by the rule
of tests/exactness.py; those marked ``bitwise`` by hand re-run here in a subprocess whose
libraries are all capped at another instruction set
(``flowgrpo.services.bench.learning.isa_environment``: ATen, oneDNN and MKL): ``default`` (no
AVX at all) and ``avx2`` (a CPU without AVX-512). The subprocess runs on every core (torch's
default thread count, the one a user's process has), whatever the thread count of the run that
started it. Before running, a child reports what ATen and oneDNN run on, so a cap a library
ignored cannot pass for one that held (MKL reports nothing on AMD: tests/exactness.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from exactness import ONEDNN_ISA, files_with_exact_claims, isa_report

from flowgrpo.services.bench import learning

ROOT = Path(__file__).resolve().parents[1]
# Not re-run: the end-to-end runs through the services. Their exact claims compare launchers and
# faults (in process against local processes, killed and resumed, attacked) in deterministic
# mode, one thread and deterministic kernels on both sides; the arithmetic they run is the
# sampler's and the trainer's, whose exact claims the re-run covers in process. Re-running them
# under two caps would cost more than the rest of the suite (a run of minutes each).
END_TO_END = ("tests/coordinator/", "tests/security/")


def capped(isa: str) -> dict[str, str]:
    """The environment of a re-run at ``isa``: every library capped, every core's threads."""
    plain = {k: v for k, v in os.environ.items() if k not in learning.ISA_LIBRARIES}
    plain.pop("OMP_NUM_THREADS", None)
    return plain | learning.isa_environment(isa)


@pytest.mark.long
@pytest.mark.timeout(900)
@pytest.mark.parametrize("isa", ["default", "avx2"])
def test_bitwise_claims_hold_on_a_restricted_instruction_set(isa: str) -> None:
    env = capped(isa)
    assert isa_report(env, sys.executable) == {"aten": isa.upper(), "onednn": ONEDNN_ISA[isa]}
    files = [str(p.relative_to(ROOT)) for p in files_with_exact_claims(ROOT / "tests")]
    files = [f for f in files if not f.startswith(END_TO_END) and f != "tests/test_instruction_sets.py"]
    marks = "bitwise and not gpu and not slow and not vllm_omni"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-m", marks,
         "-p", "no:xdist", *files],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=880,
    )  # fmt: skip
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-2000:]
    assert done.returncode == 0, f"under {learning.isa_environment(isa)}: {summary}\n{done.stdout[-6000:]}"
    assert " passed" in summary and " failed" not in summary, summary


RULE_CASES = """
import torch
from torch.testing import assert_close

def same_bits(a, b):
    assert_close(a, b, rtol=0, atol=0)

def test_equal(): assert torch.equal(f(1), g(1))
def test_through_a_helper(): same_bits(f(1), g(1))
def test_said():
    \"\"\"Two runs train bitwise alike.\"\"\"
def test_gap(m): assert m["actor/rollout_logp_gap/max"] == 0.0
def test_figures(a, b):
    for key in EXACT:
        assert a[key] == b[key]
def test_within_rounding(): assert_close(f(1), g(1), rtol=0, atol=1e-6)
def test_by_hand(): assert f(1) == 0.5
"""


def test_the_rule_marks_exact_claims_and_only_them(tmp_path: Path) -> None:
    """Two computing paths compared exactly (``torch.equal``, through a helper, a zero log-prob
    gap, figures over ``EXACT``, or said to be bitwise) are claims; a tolerance or a
    hand-written value is not. A file is found by its claims, or by a ``bitwise`` mark."""
    import exactness

    (tmp_path / "test_claims.py").write_text(RULE_CASES)
    (tmp_path / "test_none.py").write_text("def test_by_hand():\n    assert 1 + 1 == 2\n")
    (tmp_path / "test_marked.py").write_text("import pytest\npytestmark = pytest.mark.bitwise\n")
    claims = {name: exactness.claims_exactness(tmp_path / "test_claims.py", name)
              for name in ("test_equal", "test_through_a_helper", "test_said", "test_gap", "test_figures",
                           "test_within_rounding", "test_by_hand")}  # fmt: skip
    assert claims == {"test_equal": True, "test_through_a_helper": True, "test_said": True, "test_gap": True,
                      "test_figures": True, "test_within_rounding": False, "test_by_hand": False}  # fmt: skip
    found = exactness.files_with_exact_claims(tmp_path)
    assert found == [tmp_path / "test_claims.py", tmp_path / "test_marked.py"]
