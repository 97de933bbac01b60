"""Record the Triton launches the ops really make, for a table of shapes, without a GPU.

Under ``TRITON_INTERPRET=1`` every ``kernel[grid](...)`` goes through
``triton.runtime.interpreter.InterpretedFunction.run``; :func:`record` wraps it and keeps, per launch, the kernel
and each argument as the GPU JIT would see it: a tensor's dtype and whether its address is 16-byte aligned, an
int's value (Triton specialises ints equal to 1 and multiples of 16), constexprs and launch options. With
``execute=False`` the kernels are not run, so shapes of a real deployment (128K-token pools of 32 heads) cost no
time or memory: pools are ``torch.empty`` (never touched), and only the small tables hold real values.
:mod:`tinyattn.kernels.compile` replays each recorded launch through Triton's own specialisation and compiles it.

    TRITON_INTERPRET=1 python -m tinyattn.kernels.launches --out launches.json [--full]

:data:`SHAPES` is the table: the runtime's models (stories260K: 8 / 4 heads, head_dim 8; SmolLM2-135M: 9 / 3
heads, head_dim 64), the benchmarks (32 / 8 heads, D = 128, page 16, 32K-128K, budgets 128-256 pages, B = 1 and
8), the vLLM backend (blocks of 16 and 32, fp8 KV) and the selection's box estimate with top-p (issue 35).
Each row runs the step's ops with ``backend="triton"``:
the fused KV write, the page boxes, the sparse decode (scores, selection, attention), the dense decode and, for
rows with ``prefill > 1``, a dense prefill. Rows marked ``default`` form the subset the test suite compiles.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from typing import NamedTuple

import torch


class Shape(NamedTuple):
    name: str
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str            # model dtype: fp32 / fp16 / bf16
    context: int          # tokens per row
    batch: int
    page_budget: int      # pages per (row, KV head) of the sparse decode; 0: dense only
    prefill: int = 0      # query tokens of a dense prefill step (0: none)
    kv_cache_dtype: str = "auto"
    box_dtype: str = "auto"
    default: bool = False  # in the test suite's subset
    gamma: float = 1.0     # the sparse decode's page estimate (1: Quest's bound)
    top_p: float | None = None  # the sparse decode's adaptive budget (None: the whole page_budget)
    rerank: str | None = None   # the sparse decode's second stage ("int4": 4-bit key codes, written with the KV)


K = 1024
SHAPES = (
    # the runtime (tinyattn.models): stories260K (fp32 checkpoint), SmolLM2-135M (bf16)
    Shape("stories260K", 8, 4, 8, 16, "fp32", 512, 1, 4, prefill=64, default=True),
    Shape("stories260K-int8", 8, 4, 8, 16, "fp32", 512, 4, 4, kv_cache_dtype="int8"),
    Shape("smollm2-135m", 9, 3, 64, 16, "bf16", 8 * K, 1, 64, prefill=512, default=True),
    Shape("smollm2-135m-b8-bf16box", 9, 3, 64, 16, "bf16", 2 * K, 8, 32, box_dtype="bf16"),
    # the benchmarks (bench/decode_attention.py, gpu_graphs.py, kernel_breakdown.py): Llama-3-8B-like heads
    Shape("bench-32K", 32, 8, 128, 16, "bf16", 32 * K, 1, 128, default=True),
    Shape("bench-128K", 32, 8, 128, 16, "bf16", 128 * K, 1, 128),
    Shape("bench-32K-budget256", 32, 8, 128, 16, "bf16", 32 * K, 1, 256),
    Shape("bench-32K-b8", 32, 8, 128, 16, "bf16", 32 * K, 8, 128),
    Shape("bench-4K-fp16", 32, 8, 128, 16, "fp16", 4 * K, 8, 32),
    # the vLLM backend (tinyattn/integrations/vllm): blocks of 16 and 32, a chunked prefill, fp8 KV
    Shape("vllm-block16", 32, 8, 128, 16, "bf16", 4 * K, 8, 64, prefill=512, default=True),
    Shape("vllm-block32", 32, 8, 128, 32, "bf16", 4 * K, 8, 32, prefill=512),
    Shape("vllm-block16-fp8", 32, 8, 128, 16, "bf16", 4 * K, 8, 64, kv_cache_dtype="fp8_e4m3", default=True),
    # issue 35: the box estimate and top-p, on the two-stage path (B = 1) and after the one-stage select (B * Hkv
    # programs fill the GPU)
    Shape("bench-32K-top-p", 32, 8, 128, 16, "bf16", 32 * K, 1, 128, gamma=0.25, top_p=0.9, default=True),
    Shape("b32-2K-top-p", 32, 8, 128, 16, "bf16", 2 * K, 32, 32, gamma=0.25, top_p=0.9, default=True),
    # issue 35's second stage: candidates re-ranked by 4-bit key codes (the code writer, the rerank kernel)
    Shape("bench-32K-rerank", 32, 8, 128, 16, "bf16", 32 * K, 1, 128, gamma=0.25, top_p=0.8, rerank="int4",
          default=True),
    Shape("smollm2-135m-rerank", 9, 3, 64, 16, "bf16", 8 * K, 8, 64, gamma=0.25, top_p=0.8, rerank="int4"),
)
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


_phase = ""   # the step phase run_shape is in (``decode write``, ``sparse decode``, ...), stored with each launch


def _describe(value):
    """A JSON description of one launch argument, with what the GPU JIT specialises on."""
    if isinstance(value, torch.Tensor):
        return {"tensor": str(value.dtype).removeprefix("torch."), "aligned": value.data_ptr() % 16 == 0}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    if hasattr(value, "value"):                       # a tl.constexpr
        return {"value": value.value}
    raise TypeError(f"launch argument of type {type(value).__name__} cannot be recorded")


@contextlib.contextmanager
def record(execute: bool = False):
    """Record every interpreted Triton launch inside the block: yields the list it appends to, one dict per launch
    ``{"kernel": "module:function", "args": {name: description}, "grid": [...]}``. ``execute=False`` skips running
    the kernels (their outputs stay as allocated) and makes the launchers' host choices as on a GPU: no bf16
    upcast (``needs_upcast``), the two-stage selection's GPU chunk size (not the interpreter's one config); the
    SM count is ``attention.NUM_SMS_DEFAULT`` (132, an H100 / H200). Needs ``TRITON_INTERPRET=1`` set before
    triton was imported."""
    from triton.runtime.interpreter import InterpretedFunction

    from ..ops.attention import triton_impl as attention
    from . import chunk_topk

    launches = []
    real = InterpretedFunction.run
    # host choices made for the interpreter only take their GPU values (132 SMs: attention.NUM_SMS_DEFAULT)
    gpu_choices = [(attention, "needs_upcast", lambda dtype: False), (chunk_topk, "is_interpreting", lambda: False)]
    saved = [(module, name, getattr(module, name)) for module, name, _ in gpu_choices]

    def run(self, *args, grid, warmup, **kwargs):
        bound = dict(zip(self.arg_names, args), **kwargs)
        grid_desc = list(grid) if isinstance(grid, (tuple, list)) else str(grid)
        launches.append({"kernel": f"{self.fn.__module__}:{self.fn.__name__}", "phase": _phase,
                         "args": {name: _describe(value) for name, value in bound.items()}, "grid": grid_desc})
        if execute:
            return real(self, *args, grid=grid, warmup=warmup, **kwargs)
        return None

    InterpretedFunction.run = run
    if not execute:
        for module, name, value in gpu_choices:
            setattr(module, name, value)
    try:
        yield launches
    finally:
        InterpretedFunction.run = real
        for module, name, value in saved:
            setattr(module, name, value)


def _in_phase(name: str) -> None:
    global _phase
    _phase = name


def run_shape(shape: Shape) -> None:
    """The step's ops for one row of the table, with ``backend="triton"`` (launch under :func:`record`)."""
    import tinyattn
    from tinyattn.ops import api, quant

    dtype = DTYPES[shape.dtype]
    B, Hq, Hkv, D, S = shape.batch, shape.num_q_heads, shape.num_kv_heads, shape.head_dim, shape.page_size
    pages_per_row = -(-max(shape.context, shape.prefill) // S)
    num_pages = B * pages_per_row + 1
    pool_dtype = quant.storage_dtype(shape.kv_cache_dtype, dtype)
    quantized = quant.is_quantized(pool_dtype)
    box_dtype = quant.box_dtype_for(shape.box_dtype, pool_dtype, quantized)
    k_cache = torch.empty(num_pages, S, Hkv, D, dtype=pool_dtype)          # never touched: kernels do not run
    v_cache = torch.empty_like(k_cache)
    k_min = torch.zeros(num_pages, Hkv, D, dtype=box_dtype)
    k_max = torch.zeros_like(k_min)
    scales = dict(k_scale=torch.ones(num_pages, Hkv), v_scale=torch.ones(num_pages, Hkv)) if quantized else {}
    block_table = torch.arange(B * pages_per_row, dtype=torch.int32).view(B, pages_per_row)
    seq_lens = torch.full((B,), shape.context, dtype=torch.int32)
    # the runtime's KV write: k is a view into the fused qkv projection ([N, Hq + 2 Hkv, D] rows)
    qkv = torch.zeros(B, Hq + 2 * Hkv, D, dtype=dtype)
    slots = (block_table[:, -1].long() * S + (shape.context - 1) % S)
    _in_phase("decode write")
    api.write_kv(qkv[:, Hq:Hq + Hkv], qkv[:, Hq + Hkv:], slots, k_cache, v_cache, k_min=k_min, k_max=k_max,
                      fill=torch.zeros(num_pages, dtype=torch.int64) if quantized else None, backend="triton",
                      **scales)
    k_code = None
    if shape.rerank is not None:
        k_code = torch.zeros(num_pages, S, Hkv, D // 2, dtype=torch.uint8)
        tinyattn.encode_key_codes(k_cache, slots, k_min, k_max, k_code, backend="triton",
                                  **({"k_scale": scales["k_scale"]} if quantized else {}))
    _in_phase("boxes")
    tinyattn.update_page_metadata(k_cache, block_table, seq_lens, k_min, k_max, backend="triton",
                                  **({"k_scale": scales["k_scale"]} if quantized else {}))
    q = qkv[:, :Hq]
    if shape.page_budget:
        _in_phase("sparse decode")
        with tinyattn.value_checks(False):   # the kernels do not run: the boxes were never filled (the box check)
            tinyattn.sparse_paged_attention(q, k_cache, v_cache, block_table, seq_lens, k_min=k_min, k_max=k_max,
                                            page_budget=shape.page_budget, backend="triton", gamma=shape.gamma,
                                            top_p=shape.top_p, rerank=shape.rerank, k_code=k_code, **scales)
    _in_phase("dense decode")
    tinyattn.paged_attention(q, k_cache, v_cache, block_table, seq_lens, backend="triton", **scales)
    if shape.prefill > 1:
        T = shape.prefill
        qkv = torch.zeros(B * T, Hq + 2 * Hkv, D, dtype=dtype)
        slots = torch.arange(B * T) % (B * pages_per_row * S)
        _in_phase("prefill write")
        api.write_kv(qkv[:, Hq:Hq + Hkv], qkv[:, Hq + Hkv:], slots, k_cache, v_cache, k_min=k_min,
                          k_max=k_max, fill=torch.zeros(num_pages, dtype=torch.int64) if quantized else None,
                          backend="triton", **scales)
        prefill_lens = torch.full((B,), T, dtype=torch.int32)
        _in_phase("prefill")
        tinyattn.paged_attention(qkv[:, :Hq].reshape(B, T, Hq, D), k_cache, v_cache, block_table, prefill_lens,
                                 backend="triton", **scales)


def record_table(shapes) -> list:
    """Launches of every row of ``shapes`` (kernels not run), each tagged with its row's name."""
    out = []
    for shape in shapes:
        with record(execute=False) as launches:
            run_shape(shape)
        for launch in launches:
            launch["shape"] = shape.name
        out += launches
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--full", action="store_true", help="every row of SHAPES (default: the default rows)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("set TRITON_INTERPRET=1: the launches are recorded from the interpreter")
    shapes = [s for s in SHAPES if args.full or s.default]
    launches = record_table(shapes)
    with open(args.out, "w") as f:
        json.dump(launches, f)
    print(f"recorded {len(launches)} launches of {len(shapes)} shapes", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
