"""Running tinyattn's command line in tests: in a child process (:func:`run_cli`; :func:`run_subprocess` is any
command with a hang guard sized for a loaded machine) or in this process (:func:`run_main`, no torch import to pay)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from paths import CKPT, REPO, TOKENIZER


def run_subprocess(cmd, *, quiet_seconds: float, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, **kwargs)`` bounded for a loaded machine: the limit is 10x the command's time on a quiet
    2-core machine (``quiet_seconds``, measured), and at least 10 minutes, so only a hang trips it (a CI runner can
    be many times slower than a quiet machine); when it does, the failure says what was run, the limit, and the
    quiet time, instead of a bare ``TimeoutExpired``."""
    limit = max(10 * quiet_seconds, 600)
    try:
        return subprocess.run(cmd, timeout=limit, **kwargs)
    except subprocess.TimeoutExpired as exc:
        shown = " ".join(map(str, cmd))[:300]
        pytest.fail(f"{shown!r} did not finish in {limit:.0f} s (10x its ~{quiet_seconds:.0f} s on a quiet 2-core "
                    f"machine, at least 10 min): a hang, or a machine far busier than a loaded CI runner. Output so "
                    f"far:\n{(exc.stdout or '')[-2000:]}\n{(exc.stderr or '')[-2000:]}", pytrace=False)


def run_cli(*args: str, cwd: Path = REPO, quiet_seconds: float = 30) -> subprocess.CompletedProcess:
    """``python -m tinyattn ARGS`` from this checkout, on the torch backend (no TRITON_INTERPRET), one thread."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["OPENBLAS_NUM_THREADS"] = env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return run_subprocess([sys.executable, "-m", "tinyattn", *args], quiet_seconds=quiet_seconds, cwd=cwd, env=env,
                          capture_output=True, text=True)


def model_args() -> list[str]:
    """The shipped stories260K model and tokenizer, named explicitly."""
    return ["--model", str(CKPT), "--tokenizer", str(TOKENIZER)]


def assert_clean_error(proc: subprocess.CompletedProcess, pattern: str) -> None:
    """A usage error: exit status 2, no traceback, and ``pattern`` in stderr."""
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    assert re.search(pattern, proc.stderr), proc.stderr


def run_main(args: list[str], capsys, prog: str | None = None) -> tuple[int, str, str]:
    """``tinyattn ARGS`` in this process: ``(exit status, stdout, stderr)``. generate / eval / finetune get
    ``--backend torch`` unless the arguments name a backend (conftest sets TRITON_INTERPRET=1, under which the
    default backend would be the slow interpreter)."""
    from tinyattn.cli import main

    if args and args[0] in ("generate", "eval", "finetune") and not {"--help", "--backend"} & set(args):
        args = [*args, "--backend", "torch"]
    try:
        code = main(args) if prog is None else main(args, prog=prog)
    except SystemExit as exc:          # argparse errors and --help
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err
