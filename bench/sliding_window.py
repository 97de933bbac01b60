"""Decode step of a sliding-window layer vs a full-attention layer (dense and Quest-sparse), one plan per step.

A hybrid model (Mistral / Gemma / SmolLM3 style) runs sliding layers (``window_left = W - 1``) beside full
layers under one :class:`tinyattn.PagedAttentionPlan`. This times ``plan.run`` per layer, the call the runtime
makes, for each context and window, all methods interleaved in the same run (``bench/common.py``):

- ``full``: dense over every valid page (the baseline of each context);
- ``sparse``: Quest selection of ``--budget`` tokens, then attention (what a full layer of a sparse step runs);
- ``sliding W``: dense over the last ``W`` keys (what a sliding layer runs, at prefill and decode alike).

Bytes per step (DESIGN.md §1): ``2·L·D·e`` per (row, KV head) for ``full``, ``2·min(L, W)·D·e`` for a window
(plus the partial first page, not counted), the sparse model of ``bench/common.py``; ``ideal`` = full bytes /
method bytes, the limit of a memory-bound step. CPU: the torch backend; ``--device cuda``: the Triton kernels.

    python bench/sliding_window.py                          # 8K and 32K contexts, windows 512 / 4096
    python bench/sliding_window.py --contexts 8K --windows 1K --repeats 30
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import common as C  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=C.parse_sizes, default=[8192, 32768], help="comma-separated, K = 1024")
    p.add_argument("--windows", type=C.parse_sizes, default=[512, 4096], help="sliding windows W in tokens")
    p.add_argument("--budget", type=int, default=2048, help="token budget of the sparse full layer (default 2048)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--num-q-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", choices=list(C.DTYPES), default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    p.add_argument("--out", type=Path, default=C.DEFAULT_OUT)
    args = p.parse_args(argv)
    if args.quick:
        args.contexts, args.windows, args.budget = [1024], [128], 256
        args.num_q_heads, args.num_kv_heads, args.head_dim, args.repeats = 4, 2, 32, 3
    return args


def run(args) -> list[dict]:
    import tinyattn
    from tinyattn import metrics

    device = C.setup(args)
    dtype = C.DTYPES[args.dtype]
    elem = torch.empty(0, dtype=dtype).element_size()
    rows = []
    for L in args.contexts:
        pr = C.make_decode_problem(batch=args.batch, context=L, num_q_heads=args.num_q_heads,
                                   num_kv_heads=args.num_kv_heads, head_dim=args.head_dim,
                                   page_size=args.page_size, dtype=dtype, device=device, dense_copy=False,
                                   backend=args.backend)
        plan = tinyattn.PagedAttentionPlan(backend=args.backend)
        plan.plan(pr.block_table, pr.seq_lens, num_q_heads=args.num_q_heads, num_kv_heads=args.num_kv_heads,
                  head_dim=args.head_dim, page_size=args.page_size, page_budget=args.budget // args.page_size,
                  trusted=True)
        methods = {"full": lambda: plan.run(pr.q, pr.k_cache, pr.v_cache),
                   "sparse": lambda: plan.run(pr.q, pr.k_cache, pr.v_cache, k_min=pr.k_min, k_max=pr.k_max)}
        for W in args.windows:
            methods[f"sliding {C.fmt_tokens(W)}"] = (lambda w=W: plan.run(pr.q, pr.k_cache, pr.v_cache,
                                                                         window_left=w - 1))
        with torch.inference_mode():
            times = C.time_methods(methods, device=device, repeats=args.repeats)
        per_head = {"full": metrics.dense_bytes(L, args.head_dim, elem),
                    "sparse": metrics.sparse_bytes(L, args.head_dim, args.page_size, args.budget // args.page_size,
                                                   elem)}
        for W in args.windows:
            per_head[f"sliding {C.fmt_tokens(W)}"] = metrics.dense_bytes(min(L, W), args.head_dim, elem)
        base = times["full"]["median_us"]
        for name, t in times.items():
            rows.append(dict(context=L, method=name, time_us=round(t["median_us"], 1),
                             speedup=round(base / t["median_us"], 2),
                             ideal=round(per_head["full"] / per_head[name], 2),
                             MB=round(per_head[name] * args.batch * args.num_kv_heads / 2**20, 2)))
    return rows


COLUMNS = [("context", "context", ""), ("method", "method", ""), ("time_us", "time (µs)", ".1f"),
           ("speedup", "speedup vs full", ".2f"), ("ideal", "ideal (bytes)", ".2f"), ("MB", "KV MiB read", ".2f")]


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = run(args)
    print(f"# {C.machine_name(args.device)}, {args.dtype}, B={args.batch}, Hq/Hkv={args.num_q_heads}/"
          f"{args.num_kv_heads}, D={args.head_dim}, page {args.page_size}, budget {args.budget} tokens")
    C.print_table(rows, COLUMNS)
    C.write_csv(args.out / "sliding_window.csv", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
