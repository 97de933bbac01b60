"""Per-kernel breakdown of a sparse decode step: metadata upkeep, scoring, top-k, attention.

For each context (budget 2048 tokens by default) the four parts of one decode step are each timed **alone,
as their own public call** (``*_alone_us`` in the CSV), in the same interleaved run as the fused call and the
SDPA baseline:

- ``metadata``: the per-step upkeep in a decode loop, incremental: the new token's key is folded into
  its page's box with ``scatter_reduce_(amin/amax)``, exactly what ``PagedKVCache.write`` does, so it does
  not grow with the context. (``metadata_page_us`` in the CSV: the box of that page recomputed from its
  tokens with :func:`tinyattn.update_page_metadata` instead, not part of the step.)
- ``score``: :func:`tinyattn.page_scores` (reads every page box);
- ``topk``: :func:`tinyattn.select_pages`;
- ``attention``: :func:`tinyattn.sparse_paged_attention` given the selected ``page_indices``;
- ``step_fused_us``: what a decode step costs: the fused call (score + top-k + attention in one
  :func:`tinyattn.sparse_paged_attention`, ``fused_call_us``) plus the metadata upkeep. Every speedup is of
  this figure. ``sdpa`` (folded GQA) and ``sdpa_gqa`` (``enable_gqa=True``): the dense baselines, the faster
  of the two is the speedup's reference (see ``bench/decode_attention.py``).

The step is **not** the sum of the parts and is usually below it: each part timed alone pays its own call
(input validation, output allocation, dispatch; on CUDA a launch and, in ``do_bench``, a synchronisation and
an L2 flush each), and the parts alone hand their intermediate results (scores, page indices) through the
public API, where the fused call validates once and passes them on internally. ``parts_alone_sum_us`` is that
sum; the ``*_share_of_parts`` columns are shares of it, i.e. where the work goes, not fractions of the step.
Examples::

    python bench/kernel_breakdown.py                              # CPU, 4K..128K, budget 2048
    python bench/kernel_breakdown.py --contexts 32K --repeats 30  # the CPU target point
    python bench/kernel_breakdown.py --device cuda --out out/gpu
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import common as C  # noqa: E402

PHASES = ("metadata", "score", "topk", "attention")


def parse_args(argv=None):
    p = C.script_parser(__doc__, "kernel_breakdown", "comma-separated contexts (default: 4K,8K,16K,32K,64K,128K)")
    p.add_argument("--budget", type=int, default=2048, help="token budget (default: 2048)")
    C.add_head_args(p)
    args = p.parse_args(argv)
    if args.quick:
        args.contexts = args.contexts or [1024, 4096]
        args.budget = 256
        C.quick_heads(args)
    args.contexts = args.contexts or [4096 * 2**i for i in range(6)]
    C.default_repeats(args)
    return args


def run(args) -> list[dict]:
    import tinyattn

    device = C.setup(args)
    dtype = C.DTYPES[args.dtype]
    B, Hq, Hkv, D, S = args.batch, args.num_q_heads, args.num_kv_heads, args.head_dim, args.page_size
    G = Hq // Hkv
    K = args.budget // S
    print(f"# sparse decode step breakdown on {C.machine_name(args.device)}; B={B} Hq={Hq} Hkv={Hkv} D={D} "
          f"page_size={S} budget={args.budget} tokens {args.dtype}{' (cold caches)' if args.cold else ''}")
    rows = []
    for L in args.contexts:
        p = C.make_decode_problem(batch=B, context=L, num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D, page_size=S,
                                  dtype=dtype, device=device, backend=args.backend)
        last = (L - 1) // S
        bt_last = p.block_table[:, last:last + 1].contiguous()         # the page the new token went into
        len_last = p.seq_lens - last * S
        with torch.no_grad(), tinyattn.value_checks(False):
            be = args.backend
            scores = tinyattn.page_scores(p.q, p.k_min, p.k_max, p.block_table, p.seq_lens, page_size=S, backend=be)
            sel = tinyattn.select_pages(scores, p.seq_lens, page_size=S, page_budget=K, backend=be)
            q_fold = p.q.view(B, Hkv, G, D)

            phys_last = p.block_table[:, last].long()                     # [B]
            k_new = p.k_cache[phys_last, (L - 1) % S]                      # [B, Hkv, D]: the new token's key
            index = phys_last[:, None, None].expand_as(k_new)

            def metadata():   # exactly PagedKVCache.write's upkeep: fold the new key into its page's box
                p.k_min.scatter_reduce_(0, index, k_new, "amin")
                p.k_max.scatter_reduce_(0, index, k_new, "amax")

            def metadata_page():
                tinyattn.update_page_metadata(p.k_cache, bt_last, len_last, p.k_min, p.k_max, backend=be)

            def fused():
                return tinyattn.sparse_paged_attention(p.q, p.k_cache, p.v_cache, p.block_table, p.seq_lens,
                                                       k_min=p.k_min, k_max=p.k_max, page_budget=K, backend=be)

            methods = {
                "metadata": metadata,
                "metadata_page": metadata_page,
                "score": lambda: tinyattn.page_scores(p.q, p.k_min, p.k_max, p.block_table, p.seq_lens, page_size=S,
                                                      backend=be),
                "topk": lambda: tinyattn.select_pages(scores, p.seq_lens, page_size=S, page_budget=K, backend=be),
                "attention": lambda: tinyattn.sparse_paged_attention(p.q, p.k_cache, p.v_cache, p.block_table,
                                                                     p.seq_lens, page_indices=sel, backend=be),
                "fused": fused,
                "sdpa": lambda: F.scaled_dot_product_attention(q_fold, p.k_dense, p.v_dense),
                "sdpa_gqa": lambda: F.scaled_dot_product_attention(p.q[:, :, None], p.k_dense, p.v_dense,
                                                                   enable_gqa=True),
            }
            idle = C.wait_quiet(args.wait_quiet) if device.type == "cpu" else 1.0
            res = C.time_methods(methods, device=device, repeats=args.repeats, warmup=args.warmup, cold=args.cold)
        t = {k: v["median_us"] for k, v in res.items()}
        phase_sum = sum(t[ph] for ph in PHASES)
        step = t["fused"] + t["metadata"]
        row = dict(context=L, budget_tokens=args.budget, **{f"{ph}_alone_us": t[ph] for ph in PHASES},
                   parts_alone_sum_us=phase_sum, fused_call_us=t["fused"], step_fused_us=step,
                   sdpa_us=min(t["sdpa"], t["sdpa_gqa"]),
                   baseline="sdpa" if t["sdpa"] <= t["sdpa_gqa"] else "sdpa_gqa", sdpa_fold_us=t["sdpa"],
                   metadata_page_us=t["metadata_page"],
                   **{f"{ph}_share_of_parts": t[ph] / phase_sum for ph in PHASES},
                   score_topk_share_of_parts=(t["score"] + t["topk"]) / phase_sum,
                   speedup_vs_sdpa=min(t["sdpa"], t["sdpa_gqa"]) / step, sdpa_gqa_us=t["sdpa_gqa"],
                   speedup_vs_sdpa_gqa=t["sdpa_gqa"] / step,
                   ideal_speedup=C.decode_bytes(batch=B, context=L, num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D,
                                                page_size=S, elem=p.q.element_size())
                   / C.decode_bytes(batch=B, context=L, num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D, page_size=S,
                                    elem=p.q.element_size(), budget_tokens=args.budget),
                   idle_before=idle, device=args.device, dtype=args.dtype, cold=args.cold)
        rows.append(row)
        phases = "  ".join(f"{ph} {t[ph]:.0f}us ({row[ph + '_share_of_parts']:.0%})" for ph in PHASES)
        print(f"  L={C.fmt_tokens(L):>5}: parts alone: {phases}, sum {phase_sum:.0f}us"
              + f"  | step (fused call + metadata) {step:.0f}us, best SDPA {row['sdpa_us']:.0f}us, "
                f"x{row['speedup_vs_sdpa']:.2f} (ideal x{row['ideal_speedup']:.2f}; "
                f"x{row['speedup_vs_sdpa_gqa']:.2f} vs SDPA enable_gqa); score+topk "
                f"{row['score_topk_share_of_parts']:.0%} of the parts' sum")
        p = methods = None                           # free the caches before the next context
    return rows


def plot(rows, args, path: Path) -> None:
    if (made := C.new_figure(rows, figsize=(8, 4.5))) is None:
        return
    plt, fig, ax = made
    xs = list(range(len(rows)))
    bottom = [0.0] * len(rows)
    for ph in PHASES:
        vals = [r[f"{ph}_alone_us"] / 1e3 for r in rows]
        ax.bar(xs, vals, bottom=bottom, label=f"{ph} (timed alone)")
        for i, (v, b, r) in enumerate(zip(vals, bottom, rows)):
            if v > 0.06 * r["parts_alone_sum_us"] / 1e3:
                ax.text(i, b + v / 2, f"{r[ph + '_share_of_parts']:.0%}", ha="center", va="center", fontsize=7)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.plot(xs, [r["step_fused_us"] / 1e3 for r in rows], "r_", ms=28, mew=2,
            label="step: fused call + metadata")
    ax.plot(xs, [r["sdpa_us"] / 1e3 for r in rows], "k_", ms=28, mew=2, label="SDPA (dense, faster form)")
    ax.set_xticks(xs, [C.fmt_tokens(r["context"]) for r in rows])
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("ms per decode step (log)")
    ax.set_title(f"sparse decode step, budget {args.budget} tokens: parts timed as separate calls (stacked, "
                 f"shares of their sum) vs the fused step", fontsize=9)
    ax.legend(fontsize=8)
    C.save_figure(plt, fig, path, C.shape_title(args), 8)


def main(argv=None) -> int:
    return C.run_main(argv, parse_args, run, plot, [("context", "context", "d"),
                         ("metadata_alone_us", "metadata alone (us)", ".0f"),
                         ("score_alone_us", "score alone (us)", ".0f"), ("topk_alone_us", "top-k alone (us)", ".0f"),
                         ("attention_alone_us", "attention alone (us)", ".0f"),
                         ("parts_alone_sum_us", "sum of parts (us)", ".0f"),
                         ("score_topk_share_of_parts", "score+top-k share of parts", ".0%"),
                         ("step_fused_us", "step: fused call + metadata (us)", ".0f"),
                         ("sdpa_us", "best SDPA (us)", ".0f"),
                         ("speedup_vs_sdpa", "speedup", ".2f"), ("ideal_speedup", "ideal", ".2f"),
                         ("sdpa_gqa_us", "SDPA enable_gqa (us)", ".0f"),
                         ("speedup_vs_sdpa_gqa", "speedup vs it", ".2f")])


if __name__ == "__main__":
    sys.exit(main())
