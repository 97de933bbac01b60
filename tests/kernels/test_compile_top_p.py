"""The compile tier records the box estimate and top-p (issue 35): the default rows ``bench-32K-top-p`` (two-stage
selection, stage 1 writing every valid page's score) and ``b32-2K-top-p`` (one-stage select) launch the top-p
filter, so ``python -m tinyattn.kernels.compile`` compiles it for sm_80 / sm_90 with the GPU JIT's
specialisations (tests/kernels/test_compile.py compiles every recorded launch)."""
import os
import sys
from pathlib import Path

import pytest

from commands import run_subprocess

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_recorded_launches_hold_the_top_p_kernels():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    result = run_subprocess([sys.executable, "-m", "tinyattn.kernels.compile", "--list"], quiet_seconds=60, cwd=ROOT,
                            env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    names = result.stdout
    assert "top_p_filter[bench-32K-top-p: sparse decode]" in names
    assert "top_p_filter[b32-2K-top-p: sparse decode]" in names
    assert "'SCORES': True" in names and "'SCORES': False" in names      # stage 1 with and without the scores
    assert "select_pages[b32-2K-top-p: sparse decode]" in names           # the one-stage path feeds the filter too
