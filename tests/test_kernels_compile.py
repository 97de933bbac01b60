"""Compile-only tier: every kernel specialisation the launchers emit, down to cubin for sm_80 and sm_90.

The interpreter accepts code that the GPU compiler rejects, so the kernels are also compiled for real
targets (TRITON_ON_CPU.md). TRITON_INTERPRET is read when triton is imported, and this test session
has it set, so the compiler runs in a subprocess with it unset. The list of specialisations comes from
the launchers' own block-size heuristics (``tinyattn.kernels.compile``).
"""
import os
import sys
from pathlib import Path

import pytest

from conftest import run_subprocess

ROOT = Path(__file__).resolve().parents[1]


def _run(*args, quiet_seconds=120):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9 warns when unset; 1 is today's default
    return run_subprocess([sys.executable, "-m", "tinyattn.kernels.compile", *args], quiet_seconds=quiet_seconds,
                          cwd=ROOT, env=env, capture_output=True, text=True)


@pytest.mark.parametrize("arch", [80, 90])
def test_every_specialisation_compiles(arch):
    result = _run("--arch", str(arch))
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-6000:]
    assert "0 failed" in result.stdout


def test_specialisation_list_covers_every_kernel_and_dtype():
    result = _run("--list", quiet_seconds=10)
    assert result.returncode == 0, result.stderr[-3000:]
    names = result.stdout
    for kernel in ("attention[", "merge[", "metadata[", "scores[", "topk[", "attention_bwd[", "page_grad_norm[",
                   "chunk_topk[", "merge_chunks["):
        assert kernel in names
    for dtype in ("fp16", "bf16", "fp32"):
        assert f"attention[{dtype}," in names
    assert "sparse,split" in names and "SPLIT': True" in names and "BD': 256" in names and "BD': 16" in names
    assert "attention[fp16,kv=i8," in names and ",kv=fp8e4nv," in names and "QUANT': True" in names   # issue 13


def test_refuses_to_run_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = run_subprocess([sys.executable, "-m", "tinyattn.kernels.compile", "--arch", "90"], quiet_seconds=10,
                            cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode != 0 and "TRITON_INTERPRET" in result.stderr
