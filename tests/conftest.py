"""Test-wide setup: the Triton interpreter on the CPU, one BLAS thread, NaN-filled allocations.

TRITON_INTERPRET must be set before triton is first imported, so it is set here, at collection.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
MODEL_DIR = SHARED / "models" / "stories260K"     # its README (the known-good text's source) only

# the model, tokenizer and texts the package ships: every test runs in a clone with nothing beside it
from tinyattn import assets as _assets  # noqa: E402

CKPT = _assets.default_model_path()
TOKENIZER = _assets.default_tokenizer_path()
VALID = _assets.default_text_path()
SAMPLE = _assets.default_finetune_text_path()
KNOWN_GOOD = Path(__file__).resolve().parent / "known_good_stories260K.txt"


def run_subprocess(cmd, *, quiet_seconds: float, **kwargs):
    """``subprocess.run(cmd, **kwargs)`` bounded for a loaded machine (issue 28): the limit is 10x the command's
    time on a quiet 2-core machine (``quiet_seconds``, measured), and at least 10 minutes, so only a hang trips
    it; when it does, the failure says what was run, the limit, and the quiet time, instead of a bare
    ``TimeoutExpired``."""
    import subprocess

    limit = max(10 * quiet_seconds, 600)
    try:
        return subprocess.run(cmd, timeout=limit, **kwargs)
    except subprocess.TimeoutExpired as exc:
        shown = " ".join(map(str, cmd))[:300]
        pytest.fail(f"{shown!r} did not finish in {limit:.0f} s (10x its ~{quiet_seconds:.0f} s on a quiet 2-core "
                    f"machine, at least 10 min): a hang, or a machine far busier than a loaded CI runner. Output so "
                    f"far:\n{(exc.stdout or '')[-2000:]}\n{(exc.stderr or '')[-2000:]}", pytrace=False)


EXTRA_MODULES = ("transformers", "safetensors", "matplotlib")   # the hf and plots extras (pyproject.toml)


def _require_extras(report) -> None:
    """Optional extras are ``pytest.importorskip``-ed, so a plain ``pip install -e ".[test]"`` skips what it cannot
    run; where they are installed, CI sets ``TINYATTN_REQUIRE_EXTRAS=1`` (.ci/run) and a skip for want of one of
    :data:`EXTRA_MODULES` is a failure (issue 28: no test skipped in CI that CI can run). vLLM is not one: its
    tests run in the vLLM part of CI, in a venv of their own."""
    text = str(report.longrepr)
    if report.skipped and os.environ.get("TINYATTN_REQUIRE_EXTRAS") == "1" and any(
            f"could not import '{m}" in text or f"the {x} extra" in text
            for m, x in zip(EXTRA_MODULES, ("hf", "hf", "plots"))):
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
