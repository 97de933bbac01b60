"""Where the host time of one eager public op goes: ``tinyattn.sparse_paged_attention`` (and ``paged_attention``),
called as a model calls it (validate, plan, run) once per layer per token.

On a GPU an eager decode op is bound by its host time, not by its kernels (a 32K sparse step's kernels take
tens of microseconds; the eager op measured 515-555 us per call on an H200, docs/benchmarks.md). This script
splits that time, in one run:

1. **per call** (the mean over ``--calls`` back-to-back calls, synchronized around the loop, not each call, as a
   decode loop runs; the median of ``--repeats`` such rounds, default 5, interleaved across the calls): the public op;
   the same op under ``tinyattn.value_checks(False)`` (no data-dependent checks, hence no host sync); and
   ``PagedAttentionPlan.run`` of a plan made once (what a model pays per layer: no checks, no planning);
2. **by function**: ``cProfile`` over the op's calls, the tinyattn functions with the most cumulative time per
   call (the Python side: validation, planning, launches);
3. **by torch op**: ``torch.profiler`` over the same calls, the aten ops / kernel launches with the most self CPU
   time per call, and how many of each one call makes.

    python bench/host_profile.py                         # cpu, torch backend (its host side), writes out/bench/
    python bench/host_profile.py --device cuda           # the Triton path (bench/gpu.sh runs this)

Writes ``<name>.md`` (the three tables) into ``--out`` and prints it.
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402

import tinyattn  # noqa: E402


def parse_args(argv=None):
    p = C.base_parser(__doc__, "host_profile")
    C.add_head_args(p)
    p.add_argument("--context", type=int, default=32768, help="tokens per row (default: 32768)")
    p.add_argument("--budget", type=int, default=2048, help="token budget of the sparse op (default: 2048)")
    p.add_argument("--calls", type=int, default=200, help="calls per measurement (default: 200)")
    p.add_argument("--top", type=int, default=15, help="rows of the by-function and by-op tables (default: 15)")
    args = p.parse_args(argv)
    if args.quick:
        C.quick_heads(args)
        args.context, args.budget, args.calls = 1024, 128, 5
    return args


def _ops(p, budget_pages: int, backend: str) -> dict:
    """The calls profiled: name -> a function of no argument."""
    args = (p.q, p.k_cache, p.v_cache, p.block_table, p.seq_lens)
    boxes = dict(k_min=p.k_min, k_max=p.k_max)
    B, Hq, D = p.q.shape
    plan = tinyattn.PagedAttentionPlan(backend=backend).plan(
        p.block_table, p.seq_lens, num_q_heads=Hq, num_kv_heads=p.k_cache.shape[2], head_dim=D,
        page_size=p.page_size, page_budget=budget_pages, trusted=True)

    def unchecked():
        with tinyattn.value_checks(False):
            return tinyattn.sparse_paged_attention(*args, **boxes, page_budget=budget_pages, backend=backend)

    return {
        "sparse_paged_attention": lambda: tinyattn.sparse_paged_attention(*args, **boxes, page_budget=budget_pages,
                                                                          backend=backend),
        "sparse, value_checks(False)": unchecked,
        "plan.run (planned once)": lambda: plan.run(p.q, p.k_cache, p.v_cache, **boxes),
        "paged_attention (dense)": lambda: tinyattn.paged_attention(*args, backend=backend),
    }


def _per_call_us(fn, calls: int, device: torch.device) -> float:
    """Mean microseconds per call over ``calls`` back-to-back calls (one sync at the end, as a decode loop)."""
    C.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    C.synchronize(device)
    return (time.perf_counter() - t0) / calls * 1e6


def per_call_table(ops: dict, calls: int, repeats: int, device: torch.device) -> str:
    """Median over ``repeats`` interleaved rounds of each op's mean time per call."""
    times = {name: [] for name in ops}
    for _ in range(repeats):
        for name, fn in ops.items():
            times[name].append(_per_call_us(fn, calls, device))
    base = statistics.median(times["sparse_paged_attention"])
    lines = ["| call | us per call | / public sparse op |", "|---|---:|---:|"]
    for name, t in times.items():
        us = statistics.median(t)
        lines.append(f"| {name} | {us:.1f} | {us / base:.2f} |")
    return "\n".join(lines)


def by_function_table(fn, calls: int, top: int) -> str:
    """cProfile over ``calls`` calls: tinyattn's functions by cumulative time per call."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    stats = pstats.Stats(prof).stats            # (file, line, name) -> (cc, nc, tt, ct, callers)
    package = Path(tinyattn.__file__).resolve().parent
    files = {f: Path(f).resolve() for f, _, _ in stats}
    rows = [(ct, nc, f"{files[f].relative_to(package.parent)}:{line} {name}")
            for (f, line, name), (cc, nc, tt, ct, callers) in stats.items() if files[f].is_relative_to(package)]
    rows.sort(reverse=True)
    lines = ["| function | us per op call (cumulative) | calls per op call |", "|---|---:|---:|"]
    for ct, nc, where in rows[:top]:
        lines.append(f"| `{where}` | {ct / calls * 1e6:.1f} | {nc / calls:g} |")
    return "\n".join(lines)


def by_op_table(fn, calls: int, top: int, device: torch.device) -> str:
    """torch.profiler over ``calls`` calls: aten ops / launches by self CPU time per call, and their count."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        C.synchronize(device)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    lines = ["| op | self CPU us per op call | count per op call |", "|---|---:|---:|"]
    for e in events[:top]:
        lines.append(f"| `{e.key}` | {e.self_cpu_time_total / calls:.1f} | {e.count / calls:g} |")
    total = sum(e.count for e in events if e.key.startswith("aten::")) / calls
    lines.append(f"\naten ops per op call: {total:g}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = C.setup(args)
    dtype = C.DTYPES[args.dtype]
    p = C.make_decode_problem(batch=args.batch, context=args.context, num_q_heads=args.num_q_heads,
                              num_kv_heads=args.num_kv_heads, head_dim=args.head_dim, page_size=args.page_size,
                              dtype=dtype, device=device, dense_copy=False, backend=args.backend)
    ops = _ops(p, max(1, args.budget // args.page_size), args.backend)
    for fn in ops.values():                     # compile / plan / allocate outside every measurement
        for _ in range(args.warmup):
            fn()
    public = ops["sparse_paged_attention"]
    text = "\n\n".join([
        f"# Host time of the eager public op ({C.machine_name(args.device)}, {args.backend} backend, {args.dtype})",
        f"B={args.batch}, context {args.context}, Hq={args.num_q_heads}, Hkv={args.num_kv_heads}, "
        f"D={args.head_dim}, page {args.page_size}, budget {args.budget} tokens; {args.calls} calls per figure",
        "## Per call (median of interleaved rounds)",
        per_call_table(ops, args.calls, args.repeats or 5, device),
        "## By function (cProfile; the public sparse op)",
        by_function_table(public, args.calls, args.top),
        "## By torch op (torch.profiler; the public sparse op)",
        by_op_table(public, args.calls, args.top, device),
    ])
    path = args.out / f"{args.name}.md"
    path.write_text(text + "\n")
    print(text)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
