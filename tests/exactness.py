"""Which tests claim exact equality, found by a rule rather than remembered by hand.

A test that asserts two results equal to the last bit holds only where both sides ran the same
operations in the same order, which a CPU's instruction set and thread count can change. Such a
test gets the ``exact`` mark (tests/conftest.py); tests/test_instruction_sets.py re-runs those
also marked ``bitwise`` by hand with each library capped at another instruction set (not every
``exact`` claim holds under the caps yet: docs/ARCHITECTURE.md, "Testing tiers"). The rule: the
test's own code, or a function of its module that the test calls by name (helpers one level
deep), contains

- an exact comparison of arrays: ``torch.equal(``, ``array_equal(``, ``.tobytes() ==``, or
  ``assert_close`` with both ``rtol=0`` and ``atol=0``;
- a rollout-to-trainer log-prob gap asserted to be 0 (``logp_gap/max"] == 0``: the rollout's
  log-probs and the trainer's, two paths);
- figures compared key by key over the module's ``EXACT`` (``for key in EXACT``: the suite's
  list of a run's figures that two runs must share to the bit);
- or the word ``bitwise`` (the suite's own word for such a claim, in a docstring or a comment:
  figures of two runs compared with ``==`` say it there).

A test compared only against a value written out by hand (``== 0.5``) matches neither: its
arithmetic is not two computing paths.
"""

from __future__ import annotations

import ast
import functools
import re
import textwrap
from pathlib import Path

EXACT = re.compile(
    r"torch\.equal\(|array_equal\(|\.tobytes\(\)\s*==|\b[Bb]itwise\b|logp_gap/max\"\]\s*==\s*0|\bin EXACT\b"
)


def _exact(source: str) -> bool:
    """Whether ``source`` (a function's) holds an exact comparison, an ``assert_close`` with no
    tolerance included."""
    if EXACT.search(source):
        return True
    for node in ast.walk(ast.parse(textwrap.dedent(source))):
        name = getattr(node, "func", None)
        if isinstance(node, ast.Call) and getattr(name, "attr", getattr(name, "id", "")) == "assert_close":
            zero = {k.arg for k in node.keywords if isinstance(k.value, ast.Constant) and k.value.value == 0}
            if {"rtol", "atol"} <= zero:
                return True
    return False


@functools.cache
def _module_functions(path: Path) -> dict[str, str]:
    """Source of every function defined at the top level of ``path`` (and in its classes)."""
    text = path.read_text()
    found: dict[str, str] = {}
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            found[node.name] = ast.get_source_segment(text, node) or ""
    return found


def claims_exactness(path: Path, function: str) -> bool:
    """Whether the test function ``function`` of the test file ``path`` claims exact equality."""
    functions = _module_functions(path)
    source = functions.get(function)
    if source is None:
        return False
    if _exact(source):
        return True
    called = {n.func.id for n in ast.walk(ast.parse(textwrap.dedent(source)))
              if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}  # fmt: skip
    return any(_exact(functions[name]) for name in called - {function} if name in functions)


def files_with_exact_claims(tests: Path) -> list[Path]:
    """The test files holding a test that claims exact equality (the rule above), or marked
    ``bitwise`` by hand."""
    found = []
    for path in sorted(tests.rglob("test_*.py")):
        text = path.read_text()
        tests_here = [name for name in _module_functions(path) if name.startswith("test_")]
        if "mark.bitwise" in text or any(claims_exactness(path, name) for name in tests_here):
            found.append(path)
    return found


# What the libraries that pick their own kernels say they run on: ATen's capability, and oneDNN's
# ISA from its verbose log (a convolution makes it print it). MKL says nothing of its kernels on
# an AMD CPU, where it also ignores MKL_ENABLE_INSTRUCTIONS (the same bits capped or not, seen on
# an AMD EPYC): only ATen's and oneDNN's caps can be seen to hold everywhere.
ISA_PROBE = (
    "import torch; torch.nn.functional.conv2d(torch.ones(2, 64, 16, 16), torch.ones(64, 64, 3, 3)); "
    "print('aten', torch.backends.cpu.get_cpu_capability())"
)
ONEDNN_ISA = {"default": "Intel SSE4.1", "avx2": "Intel AVX2"}


def isa_report(env: dict[str, str], python: str) -> dict[str, str]:
    """{"aten": capability, "onednn": ISA} as a child process with ``env`` reports them."""
    import subprocess

    done = subprocess.run([python, "-c", ISA_PROBE], env=env | {"ONEDNN_VERBOSE": "1"},
                          capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
    lines = done.stdout.splitlines()
    aten = next(line.split()[1] for line in lines if line.startswith("aten "))
    onednn = next(line.rsplit("isa:", 1)[1] for line in lines if ",cpu,isa:" in line)
    return {"aten": aten, "onednn": onednn}
