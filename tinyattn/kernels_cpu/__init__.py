"""The compiled CPU kernel of tinyattn: Quest selection + paged attention in one call (``paged_decode.cpp``).

Why: on a CPU a PyTorch call costs 1-5 µs whatever its size, and a sparse decode layer written with PyTorch ops
is ~29 calls; one call of this kernel does the scoring, the top-k and the attention of every (row, KV head) of a
layer, reading each selected page in place. :class:`tinyattn.PagedAttentionPlan` uses it on the torch backend
for steps with few queries per row (decode, speculative verification, short chunks) when nothing needs
autograd; long prefills keep the batched SDPA path (a GEMM is faster there).

The kernel is compiled on first use with the machine's C++ compiler (``torch.utils.cpp_extension.load``, ~30-60
s once; cached under ``TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``), for this CPU (``-march=native``:
the build name carries the CPU model, so a shared cache never loads code built for another CPU). Without a
compiler, with ``TINYATTN_CPU_KERNEL=0`` or inside :func:`disabled`, every op falls back to the PyTorch implementation (same results to
float tolerance) and :func:`status` says why.

Launchers take canonical tensors (see :func:`paged_decode`); validation lives in :mod:`tinyattn.ops`.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import shutil
import sys
import threading
import warnings
from pathlib import Path

import torch

__all__ = ["available", "status", "disabled", "paged_decode", "write_kv", "enabled", "MAX_QUERY_TOKENS", "DTYPES"]

SOURCE = Path(__file__).with_name("paged_decode.cpp")
HEADERS = (Path(__file__).with_name("paged_decode_avx512.h"),)
MAX_QUERY_TOKENS = 16          # more queries per row: the SDPA (GEMM) path of the plan is faster
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno"]
# TINYATTN_CPU_KERNEL_SIMD=portable builds without the AVX-512 micro-kernels (paged_decode_avx512.h): the loops
# every other CPU runs, testable on an AVX-512 machine
if os.environ.get("TINYATTN_CPU_KERNEL_SIMD") == "portable":
    _CFLAGS.append("-mno-avx512f")
_LDFLAGS = ["-fopenmp"]

enabled = True                 # False: the torch backend runs its PyTorch implementation only (see disabled())
_lock = threading.Lock()
_module = None
_status: str | None = None


def _cpu_model() -> str:
    """A name of this CPU (its model line, else the platform's), hashed into the build name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _build_name() -> str:
    h = hashlib.sha256(SOURCE.read_bytes())
    for header in HEADERS:
        h.update(header.read_bytes())
    h.update(" ".join(_CFLAGS + [torch.__version__, _cpu_model()]).encode())
    return f"tinyattn_cpu_{h.hexdigest()[:12]}"


def _ninja_on_path() -> None:
    """The ``ninja`` the pip package installs lives beside the venv's python, which a venv used without
    activation does not put on PATH (torch runs ``ninja`` by name)."""
    try:
        import ninja
    except ImportError:
        return
    if shutil.which("ninja") is None:
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def _load():
    global _module, _status
    if os.environ.get("TINYATTN_CPU_KERNEL", "1") == "0":
        _status = "off: TINYATTN_CPU_KERNEL=0"
        return
    try:
        from torch.utils import cpp_extension

        _ninja_on_path()
        name = _build_name()
        built = Path(cpp_extension._get_build_directory(name, verbose=False)) / f"{name}.so"
        if not built.exists():
            print("tinyattn: compiling the CPU kernel for this machine (once, ~1 min)...", file=sys.stderr,
                  flush=True)
        _module = cpp_extension.load(name, [str(SOURCE)], extra_cflags=_CFLAGS, extra_ldflags=_LDFLAGS,
                                     extra_include_paths=[str(SOURCE.parent)],
                                     verbose=os.environ.get("TINYATTN_CPU_KERNEL_VERBOSE") == "1")
        _status = f"compiled ({_module.simd()})"
    except Exception as exc:          # no compiler / ninja / headers: the PyTorch path serves every op
        _status = f"unavailable ({type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200] if str(exc) else ''})"
        warnings.warn(f"tinyattn: the compiled CPU kernel is {_status}; CPU ops use the PyTorch path (slower per "
                      f"call, same results). Set TINYATTN_CPU_KERNEL=0 to silence this.", RuntimeWarning,
                      stacklevel=3)


def available() -> bool:
    """Whether the compiled kernel is loaded (compiling it on the first call)."""
    if _status is None:
        with _lock:
            if _status is None:
                _load()
    return _module is not None


def status() -> str:
    """``"compiled (AVX-512 micro-kernels)"`` / ``"compiled (portable loops)"``, ``"off: ..."`` or
    ``"unavailable (why)"`` (loads the kernel first)."""
    available()
    return _status


@contextlib.contextmanager
def disabled():
    """Within this block the torch backend runs its PyTorch implementation only (A/B comparisons, tests of that
    path); ``TINYATTN_CPU_KERNEL=0`` does the same for a whole process."""
    global enabled
    saved, enabled = enabled, False
    try:
        yield
    finally:
        enabled = saved


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, out: torch.Tensor, *, k_min=None, k_max=None, page_indices=None,
                 selected=None, page_budget: int = 0, num_sink_pages: int = 0, num_recent_pages: int = 1,
                 scale: float, window_left: int = -1, lse=None) -> None:
    """Run the kernel (in place into ``out`` / ``lse`` / ``selected``).

    Args:
        q: ``[B, Tq, Hq, D]`` or ``[B, Hq, D]`` (decode) contiguous fp32 / bf16 / fp16; ``out`` the same.
        k_cache, v_cache: ``[num_pages, page_size, Hkv, D]``, ``q``'s dtype, unit stride in ``D``.
        block_table ``[B, M]``, seq_lens ``[B]``: contiguous int32, already validated.
        k_min, k_max: ``[num_pages, Hkv, D]`` boxes (fp32 / bf16 / fp16, unit stride in ``D``): with
            ``page_budget > 0``, select by the Quest bound; rows with at most ``page_budget`` pages run dense.
        page_indices: ``[B, Hkv, K]`` contiguous int32 logical pages to attend (sorted and de-duplicated inside).
        selected: ``[B, Hkv, page_budget]`` int32 receiving the selection (ascending, -1 padded).
        scale: softmax scale; window_left: FlashInfer's sliding window (-1: none).
        lse: ``[B, Tq, Hq]`` / ``[B, Hq]`` fp32 receiving the natural-log log-sum-exp (-inf where no key is
            visible).

    Raises:
        RuntimeError naming the argument for shapes, dtypes or page ids the kernel cannot read (its last line
        of defence: the ops raise ``ValueError`` / ``TypeError`` first).
    """
    if _module is None and not available():
        raise RuntimeError(f"tinyattn: the compiled CPU kernel is {_status}")
    _module.paged_decode(q, k_cache, v_cache, block_table, seq_lens, k_min, k_max, page_indices, selected,
                         int(page_budget), int(num_sink_pages), int(num_recent_pages), float(scale),
                         int(window_left), out, lse)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k_min, k_max, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """Store ``k``, ``v`` ``[N, Hkv, D]`` at token rows ``slots`` ``[N]`` (int64) of the contiguous pools
    ``[num_pages, page_size, Hkv, D]`` and grow the boxes ``[num_pages, Hkv, D]`` (or ``None``) of their pages,
    all in the pool's dtype: what :meth:`tinyattn.PagedKVCache.write` does with two ``index_copy_`` and two
    ``index_reduce_``, in one call. Raises RuntimeError for other layouts or slots outside the pool."""
    if _module is None and not available():
        raise RuntimeError(f"tinyattn: the compiled CPU kernel is {_status}")
    _module.write_kv(k_cache, v_cache, k_min, k_max, slots, k, v)
