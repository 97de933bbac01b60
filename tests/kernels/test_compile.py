"""Compile-only tier: the kernel specialisations the ops really launch, down to cubin for sm_80 and sm_90.

The interpreter accepts code that the GPU compiler rejects, so the kernels are also compiled for real
targets (TRITON_ON_CPU.md). TRITON_INTERPRET is read when triton is imported, and this test session
has it set, so the compiler runs in a subprocess with it unset. The specialisations are the recorded launches
of the ops over the default rows of ``tinyattn.kernels.launches.SHAPES``, replayed through Triton's own JIT
specialisation (``tinyattn.kernels.compile``). Every test here runs the compiler in a subprocess (seconds to minutes),
so all are marked ``slow``.
"""
import os
import sys

import pytest

from commands import run_subprocess
from paths import REPO as ROOT


def _run(*args, quiet_seconds=120):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9 warns when unset; 1 is today's default
    return run_subprocess([sys.executable, "-m", "tinyattn.kernels.compile", *args], quiet_seconds=quiet_seconds,
                          cwd=ROOT, env=env, capture_output=True, text=True)


@pytest.mark.slow
@pytest.mark.parametrize("arch", [80, 90])
def test_every_recorded_specialisation_compiles(arch):
    """sm_80: the default rows of the shape table; sm_90: every row (``--full``, a superset: one run instead of two,
    the recording and the shared binaries not repeated)."""
    result = _run("--arch", str(arch), "--table", *(["--full"] if arch == 90 else []), quiet_seconds=360)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-6000:]
    assert "0 failed" in result.stdout
    assert f"| kernel [shape row: phase] (sm_{arch}) | registers |" in result.stdout


@pytest.mark.slow
def test_recorded_list_covers_every_inference_kernel_with_gpu_specialisations():
    """The recorded launches hold every kernel of a decode / prefill step, with the GPU JIT's specialisations
    (unit strides as constexpr 1, 16-divisible strides and aligned pointers) and the GPU's host choices."""
    result = _run("--list", quiet_seconds=30)
    assert result.returncode == 0, result.stderr[-3000:]
    names = result.stdout
    for kernel in ("kv_write[", "page_minmax[", "score_chunk_topk[", "merge_chunks[", "attn_fwd[", "merge_splits[",
                   "attention_bwd[", "page_grad_norm["):
        assert kernel in names, kernel
    for row in ("[stories260K: prefill]", "[smollm2-135m: sparse decode]", "[bench-32K: decode write]",
                "[vllm-block16: prefill write]", "[vllm-block16-fp8: dense decode]"):
        assert row in names, row
    assert "=1: stride_qd,stride_kd" in names                  # unit strides specialised as on a GPU
    assert "%16: q,k_cache" in names                           # aligned pointers
    assert "k_cache:*fp8e4nv" in names and "k:*bf16" in names and "k_cache:*fp32" in names
    assert "'UPCAST': True" not in names                      # the interpreter-only bf16 upcast is not recorded
    assert "'CHUNK': 256" in names                            # the GPU chunk at B = 1, 32K (2 x budget)


@pytest.mark.slow
def test_cross_product_list_still_builds():
    result = _run("--cross", "--list", quiet_seconds=12)
    assert result.returncode == 0, result.stderr[-3000:]
    for kernel in ("attention[", "merge[", "metadata[", "scores[", "topk[", "chunk_topk[", "kv_write[fp8e4nv"):
        assert kernel in result.stdout


@pytest.mark.slow
def test_refuses_to_run_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = run_subprocess([sys.executable, "-m", "tinyattn.kernels.compile", "--arch", "90"], quiet_seconds=10,
                            cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode != 0 and "TRITON_INTERPRET" in result.stderr
