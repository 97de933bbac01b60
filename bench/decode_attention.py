"""Decode attention step: sparse (score + top-k + attention) vs dense paged vs SDPA (and FlashAttention).

One decode step of ``B`` rows at context ``L`` (32 query / 8 KV heads, head_dim 128 by default), for each
context and page budget. Methods, all timed in the same run (interleaved on the CPU):

- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` on a contiguous ``[B, Hkv, L, D]`` cache,
  the query heads of each KV head folded into the query length (exact for decode; the fastest form on CPU);
- ``sdpa_gqa``: SDPA with ``enable_gqa=True`` on ``[B, Hq, 1, D]`` queries (what most users write; the
  fastest form on CUDA, where it reaches the flash kernels);
- ``flash_attn``: ``flash_attn_with_kvcache`` on a contiguous cache (CUDA, when flash-attn is installed);
- ``dense_paged``: :func:`tinyattn.paged_attention`;
- ``sparse``: :func:`tinyattn.sparse_paged_attention` with ``k_min/k_max/page_budget`` (scores, selects and
  attends in one call), for each budget;

Every speedup is against the **faster** of ``sdpa`` and ``sdpa_gqa`` in the same run (named in the
``baseline`` column). Columns: time (median, µs), speedup, speedup vs ``sdpa_gqa``, bytes moved (DESIGN.md §1,
see ``bench/common.py``), GB/s,
ideal speedup (dense bytes / method bytes) and efficiency = speedup / ideal.
CPU runs the torch backend; ``--device cuda`` runs the Triton kernels (``triton.testing.do_bench``).

Examples::

    python bench/decode_attention.py                       # CPU, 1K..128K, budgets 512..4096 tokens
    python bench/decode_attention.py --contexts 32K --budgets 2048 --repeats 30
    python bench/decode_attention.py --device cuda --out out/gpu
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import common as C  # noqa: E402


def parse_args(argv=None):
    p = C.script_parser(__doc__, "decode_attention",
                        "comma-separated contexts, K = 1024 (default: 1K,2K,4K,8K,16K,32K,64K,128K)")
    p.add_argument("--budgets", type=C.parse_sizes, default=None,
                   help="comma-separated token budgets = page_budget x page_size (default: 512,1024,2048,4096)")
    C.add_head_args(p)
    p.add_argument("--value-checks", action="store_true",
                   help="time the ops with their data checks on, as users call them (default: off, as a runtime "
                        "with trusted tables runs them)")
    p.add_argument("--max-gib", type=float, default=6.0,
                   help="skip contexts whose paged + contiguous caches exceed this many GiB (default: 6)")
    args = p.parse_args(argv)
    if args.quick:
        args.contexts = args.contexts or [512, 2048]
        args.budgets = args.budgets or [128, 256]
        C.quick_heads(args)
    args.contexts = args.contexts or [1024 * 2**i for i in range(8)]
    args.budgets = args.budgets or [512, 1024, 2048, 4096]
    C.default_repeats(args)
    return args


def flash_attn_fn():
    try:
        from flash_attn import flash_attn_with_kvcache
        return flash_attn_with_kvcache
    except Exception:                                  # not installed, or built for another torch / GPU
        return None


def run(args) -> list[dict]:
    import tinyattn

    device = C.setup(args)
    dtype = C.DTYPES[args.dtype]
    elem = torch.empty((), dtype=dtype).element_size()
    B, Hq, Hkv, D, S = args.batch, args.num_q_heads, args.num_kv_heads, args.head_dim, args.page_size
    G = Hq // Hkv
    flash = flash_attn_fn() if device.type == "cuda" else None
    machine = C.machine_name(args.device)
    print(f"# decode attention step on {machine}; B={B} Hq={Hq} Hkv={Hkv} D={D} page_size={S} {args.dtype}"
          f"{' (cold caches)' if args.cold else ''}; flash_attn: {'yes' if flash else 'not available'}")
    rows = []
    for L in args.contexts:
        gib = 4 * B * L * Hkv * D * elem / 2**30
        if gib > args.max_gib:
            print(f"skip context {L}: {gib:.1f} GiB of caches > --max-gib {args.max_gib}")
            continue
        p = C.make_decode_problem(batch=B, context=L, num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D, page_size=S,
                                  dtype=dtype, device=device, backend=args.backend)
        q_fold = p.q.view(B, Hkv, G, D)                    # the G query heads of a KV head as G query rows
        q_gqa = p.q[:, :, None, :]                          # [B, Hq, 1, D]
        methods = {
            "sdpa": lambda: F.scaled_dot_product_attention(q_fold, p.k_dense, p.v_dense),
            "sdpa_gqa": lambda: F.scaled_dot_product_attention(q_gqa, p.k_dense, p.v_dense, enable_gqa=True),
            "dense_paged": lambda: tinyattn.paged_attention(p.q, p.k_cache, p.v_cache, p.block_table, p.seq_lens,
                                                                    backend=args.backend),
        }
        if flash is not None:
            k_nhd = p.k_dense.transpose(1, 2).contiguous()  # [B, L, Hkv, D]
            v_nhd = p.v_dense.transpose(1, 2).contiguous()
            lens = p.seq_lens
            methods["flash_attn"] = lambda: flash(p.q[:, None], k_nhd, v_nhd, cache_seqlens=lens)
        budgets = [b for b in args.budgets if b < L]
        for bt in budgets:
            methods[f"sparse@{bt}"] = (lambda k=bt // S: tinyattn.sparse_paged_attention(
                p.q, p.k_cache, p.v_cache, p.block_table, p.seq_lens, k_min=p.k_min, k_max=p.k_max, page_budget=k,
                backend=args.backend))
        with torch.no_grad(), tinyattn.value_checks(args.value_checks):
            check_outputs(p, methods, q_fold)
            idle = C.wait_quiet(args.wait_quiet) if device.type == "cpu" else 1.0
            res = C.time_methods(methods, device=device, repeats=args.repeats, warmup=args.warmup, cold=args.cold)
        baseline = min(("sdpa", "sdpa_gqa"), key=lambda m: res[m]["median_us"])   # the faster SDPA form
        base = res[baseline]["median_us"]
        base_gqa = res["sdpa_gqa"]["median_us"]
        dense_bytes = C.decode_bytes(batch=B, context=L, num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D,
                                     page_size=S, elem=elem)
        for name, r in res.items():
            budget = int(name.split("@")[1]) if "@" in name else None
            nbytes = C.decode_bytes(batch=B, context=L, num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D, page_size=S,
                                    elem=elem, budget_tokens=budget)
            ideal = dense_bytes / nbytes
            speedup = base / r["median_us"]
            rows.append(dict(context=L, method=name.split("@")[0], budget_tokens=budget or L, time_us=r["median_us"],
                             min_us=r["min_us"], baseline=baseline, speedup=speedup, speedup_vs_sdpa_gqa=base_gqa / r["median_us"],
                             bytes=nbytes,
                             gb_per_s=nbytes / (r["median_us"] * 1e3), ideal_speedup=ideal,
                             efficiency=speedup / ideal, idle_before=idle, device=args.device, dtype=args.dtype,
                             batch=B,
                             num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D, page_size=S, cold=args.cold,
                             value_checks=args.value_checks, threads=args.threads))
        for r in rows[-len(res):]:
            print(f"  L={C.fmt_tokens(L):>5} {r['method']:<12} budget={C.fmt_tokens(r['budget_tokens']):>5} "
                  f"{r['time_us']:>10.1f} us  x{r['speedup']:5.2f} (ideal x{r['ideal_speedup']:5.2f}, "
                  f"eff {r['efficiency']:5.1%})  {r['gb_per_s']:6.1f} GB/s")
        p = methods = None                           # free the caches before the next context
    return rows


def check_outputs(p, methods, q_fold) -> None:
    """Dense paged must equal SDPA (same values, both layouts); a failed check stops the benchmark."""
    ref = methods["sdpa"]().reshape(p.q.shape).float()
    got = methods["dense_paged"]().float()
    err = (got - ref).abs().max().item()
    tol = 1e-3 if p.q.dtype == torch.float32 else 3e-2
    if not err <= tol:
        raise SystemExit(f"dense_paged differs from sdpa by {err:.3g} (> {tol}): the benchmark is not comparing "
                         f"like with like")


def plot(rows, args, path: Path) -> None:
    if (made := C.new_figure(rows, 1, 2, figsize=(13, 4.8))) is None:
        return
    plt, fig, (ax1, ax2) = made
    contexts = sorted({r["context"] for r in rows})
    budgets = sorted({r["budget_tokens"] for r in rows if r["method"] == "sparse"})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, bt in enumerate(budgets):
        sel = sorted((r for r in rows if r["method"] == "sparse" and r["budget_tokens"] == bt),
                     key=lambda r: r["context"])
        xs = [r["context"] for r in sel]
        ax1.plot(xs, [r["speedup"] for r in sel], "o-", color=colors[i % len(colors)], label=f"sparse, {bt} tokens")
        ax1.plot(xs, [r["ideal_speedup"] for r in sel], "--", color=colors[i % len(colors)], alpha=0.6,
                 label=f"ideal (bytes), {bt} tokens")
    for name, style in (("dense_paged", "k-"), ("sdpa", "k--"), ("sdpa_gqa", "k:"), ("flash_attn", "k-.")):
        sel = sorted((r for r in rows if r["method"] == name), key=lambda r: r["context"])
        if sel:
            ax1.plot([r["context"] for r in sel], [r["speedup"] for r in sel], style, label=name)
    ax1.axhline(1.0, color="grey", lw=0.8)
    C.context_axis(ax1, contexts)
    ax1.set_yscale("log", base=2)
    ax1.set_ylabel("speedup vs the faster SDPA form (dense)")
    ax1.set_title("decode step speedup vs SDPA; dashed = bytes-moved ideal", fontsize=10)
    ax1.legend(fontsize=7, ncol=2)
    for i, name in enumerate(["sdpa", "sdpa_gqa", "dense_paged", "flash_attn"] + [f"sparse@{b}" for b in budgets]):
        m, _, b = name.partition("@")
        sel = sorted((r for r in rows if r["method"] == m and (not b or r["budget_tokens"] == int(b))),
                     key=lambda r: r["context"])
        if sel:
            ax2.plot([r["context"] for r in sel], [r["gb_per_s"] for r in sel], "o-", ms=3,
                     label=m if not b else f"sparse, {b} tokens")
    C.context_axis(ax2, contexts)
    ax2.set_ylabel("GB/s (bytes the method must read / time)")
    ax2.set_title("effective bandwidth")
    ax2.legend(fontsize=7)
    C.save_figure(plt, fig, path, f"{C.shape_title(args)}, page {args.page_size}", 9)


def main(argv=None) -> int:
    return C.run_main(argv, parse_args, run, plot, [("context", "context", "d"), ("method", "method", ""), ("budget_tokens", "budget", "d"),
                         ("time_us", "time (us)", ".1f"), ("speedup", "speedup vs best SDPA", ".2f"),
                         ("speedup_vs_sdpa_gqa", "vs SDPA enable_gqa", ".2f"),
                         ("bytes", "bytes", ".3g"), ("gb_per_s", "GB/s", ".1f"),
                         ("ideal_speedup", "ideal", ".2f"), ("efficiency", "efficiency", ".0%")])


if __name__ == "__main__":
    sys.exit(main())
