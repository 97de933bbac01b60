"""Decode step with and without CUDA graphs: how much of a step is host overhead, and how close the
kernels themselves come to the bytes-moved limit (DESIGN.md §1).

A decode step of tinyattn is a handful of kernel launches (score, top-k, attention, split merge) plus
Python around them; at small sizes the host, not the GPU, sets the time. Serving engines (vLLM, SGLang)
replay decode steps as CUDA graphs for exactly this reason. This script times each method eagerly and
as a CUDA-graph replay (``torch.cuda.CUDAGraph``), both with ``triton.testing.do_bench`` (median, L2
flushed), against SDPA with ``enable_gqa=True`` on a contiguous cache (the strongest stock baseline), and
FlashAttention (``flash_attn_with_kvcache`` on a contiguous cache: its paged layout needs pages of 256) and
FlashInfer (``BatchDecodeWithPagedKVCacheWrapper`` on the same pages) when they are importable.

Methods: ``sparse`` / ``dense_paged`` are the public ops (a plan per call); ``sparse_run`` is
``PagedAttentionPlan.run`` of a plan made once (what a model runs per layer); ``sparse_step`` adds the step's fused
KV write (``tinyattn.ops.api.write_kv``, one launch) before it: the decode step as serving engines run it. Issue 35's
selection, each a plan run like ``sparse_run``: ``sparse_gamma`` (the box estimate, gamma 0.25, one sink page: the
default recipe), ``sparse_gamma_top_p`` (top_p 0.8), ``sparse_rerank`` (the capacity's candidates re-ranked by 4-bit
key codes), ``sparse_rerank_top_p``. The last lines, ``goal: ...``, check the CUDA-graph targets (B = 1, 32K: sparse
>= 4x SDPA graphed, eager step <= 60 µs, dense paged within 1.2x of SDPA) and issue 35's cost bar (the re-rank's
extra time <= 10% of the sparse step, graphed, B = 1 and 8).

    python bench/gpu_graphs.py --out docs/bench/gpu            # CUDA only
    python bench/gpu_graphs.py --device cpu --contexts 4K      # a smoke run of the script (no graphs)
"""

from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import tinyattn

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_size(text: str) -> int:
    text = text.strip().upper()
    return int(text[:-1]) * 1024 if text.endswith("K") else int(text)


def make_problem(L, B, Hq, Hkv, D, S, dtype, device):
    """B rows of L tokens each, pages of S tokens scattered over a shared pool by a random permutation."""
    pages_per_row = L // S
    num_pages = B * pages_per_row
    k_cache = torch.randn(num_pages, S, Hkv, D, device=device, dtype=dtype)     # generated on the device: fast
    v_cache = torch.randn(num_pages, S, Hkv, D, device=device, dtype=dtype)
    block_table = torch.randperm(num_pages, device=device).reshape(B, pages_per_row).to(torch.int32)
    seq_lens = torch.full((B,), L, dtype=torch.int32, device=device)
    k_min = torch.empty(num_pages, Hkv, D, dtype=dtype, device=device)
    k_max = torch.empty_like(k_min)
    tinyattn.update_page_metadata(k_cache, block_table, seq_lens, k_min, k_max)
    # 4-bit key codes of every page (the re-rank's input; issue 35), by the Triton writer on CUDA
    k_code = torch.zeros(num_pages, S, Hkv, D // 2, dtype=torch.uint8, device=device)
    tinyattn.encode_key_codes(k_cache, torch.arange(num_pages * S, device=device), k_min, k_max, k_code)
    q = torch.randn(B, Hq, D, device=device, dtype=dtype)
    # the stock baseline reads a contiguous [B, Hkv, L, D] cache
    flat = lambda pool: pool[block_table.long()].reshape(B, L, Hkv, D).transpose(1, 2).contiguous()  # noqa: E731
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table, seq_lens=seq_lens,
                k_min=k_min, k_max=k_max, k_code=k_code, k_flat=flat(k_cache), v_flat=flat(v_cache))


def methods(p, budget_pages):
    from tinyattn.ops import api as kv_write

    args = (p["q"], p["k_cache"], p["v_cache"], p["block_table"], p["seq_lens"])
    q4 = p["q"][:, :, None, :]
    B, Hq, D = p["q"].shape
    S, Hkv = p["k_cache"].shape[1], p["k_cache"].shape[2]
    plan = tinyattn.PagedAttentionPlan(backend="triton" if p["q"].is_cuda else None).plan(
        p["block_table"], p["seq_lens"], num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D, page_size=S,
        page_budget=budget_pages, trusted=True)
    out = torch.empty_like(p["q"])
    # the step's new token goes to the last slot of each row (rows are full pages)
    slots = p["block_table"][:, -1].long() * S + (S - 1)
    k_new, v_new = torch.randn_like(p["k_cache"][:B, 0]), torch.randn_like(p["v_cache"][:B, 0])  # [B, Hkv, D]

    def sparse_run():
        return plan.run(p["q"], p["k_cache"], p["v_cache"], k_min=p["k_min"], k_max=p["k_max"], out=out)

    def run_of(**selection):
        """A plan made once with issue 35's selection settings, run like ``sparse_run``."""
        pl = tinyattn.PagedAttentionPlan(backend="triton" if p["q"].is_cuda else None).plan(
            p["block_table"], p["seq_lens"], num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D, page_size=S,
            page_budget=budget_pages, trusted=True, **selection)
        codes = dict(k_code=p["k_code"]) if selection.get("rerank") else {}
        return lambda: pl.run(p["q"], p["k_cache"], p["v_cache"], k_min=p["k_min"], k_max=p["k_max"], out=out,
                              **codes)

    def sparse_step():
        kv_write.write_kv(k_new, v_new, slots, p["k_cache"], p["v_cache"], k_min=p["k_min"], k_max=p["k_max"])
        return sparse_run()

    table = {
        "sdpa_gqa": lambda: F.scaled_dot_product_attention(q4, p["k_flat"], p["v_flat"], enable_gqa=True),
        "dense_paged": lambda: tinyattn.paged_attention(*args),
        "sparse": lambda: tinyattn.sparse_paged_attention(*args, k_min=p["k_min"], k_max=p["k_max"],
                                                          page_budget=budget_pages),
        "sparse_run": sparse_run,
        "sparse_step": sparse_step,
        # issue 35 (docs/design_rerank.md): the box estimate (gamma 0.25, the default recipe), the adaptive budget,
        # and the 4-bit re-rank of the capacity's candidates; the cost bar is rerank's extra time over sparse_gamma
        "sparse_gamma": run_of(gamma=0.25, num_sink_pages=1),
        "sparse_gamma_top_p": run_of(gamma=0.25, num_sink_pages=1, top_p=0.8),
        "sparse_rerank": run_of(gamma=0.25, num_sink_pages=1, rerank="int4"),
        "sparse_rerank_top_p": run_of(gamma=0.25, num_sink_pages=1, rerank="int4", top_p=0.8),
    }
    table.update(stock_methods(p))
    return table


def stock_methods(p) -> dict:
    """FlashAttention and FlashInfer decode over the same keys, when importable (else nothing, with a note)."""
    out = {}
    if not p["q"].is_cuda:
        return out
    B, Hq, D = p["q"].shape
    S, Hkv = p["k_cache"].shape[1], p["k_cache"].shape[2]
    L = p["k_flat"].shape[2]
    try:
        from flash_attn import flash_attn_with_kvcache

        k_nhd, v_nhd = p["k_flat"].transpose(1, 2).contiguous(), p["v_flat"].transpose(1, 2).contiguous()
        lens = p["seq_lens"]
        out["flash_attn"] = lambda: flash_attn_with_kvcache(p["q"][:, None], k_nhd, v_nhd, cache_seqlens=lens)
    except Exception as exc:  # not installed, or a build without this GPU
        print(f"# flash_attn: skipped ({type(exc).__name__}: {exc})")
    try:
        import flashinfer

        workspace = torch.empty(128 * 2**20, dtype=torch.uint8, device=p["q"].device)
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        pages_per_row = p["block_table"].shape[1]
        indptr = torch.arange(B + 1, dtype=torch.int32, device=p["q"].device) * pages_per_row
        wrapper.plan(indptr, p["block_table"].reshape(-1), torch.full((B,), S - (-L % S), dtype=torch.int32,
                     device=p["q"].device), Hq, Hkv, D, S, data_type=p["q"].dtype)
        out["flashinfer"] = lambda: wrapper.run(p["q"], (p["k_cache"], p["v_cache"]))
    except Exception as exc:
        print(f"# flashinfer: skipped ({type(exc).__name__}: {exc})")
    return out


def goals(rows) -> list:
    """The CUDA-graph targets at B = 1, 32K (graph replay = CUDA graph times): lines ``goal: ... PASS|FAIL|n/a``."""
    at = {(r["batch"], r["context"], r["method"]): r for r in rows}
    lines = []
    sdpa, sparse = at.get((1, 32768, "sdpa_gqa")), at.get((1, 32768, "sparse_step")) or at.get((1, 32768, "sparse"))
    dense = at.get((1, 32768, "dense_paged"))
    run = at.get((1, 32768, "sparse_run"))

    def line(text, value, ok):
        verdict = "n/a" if value != value else ("PASS" if ok else "FAIL")
        lines.append(f"goal: {text}: {value:.2f} {verdict}")

    nan = float("nan")
    line("B=1 32K sparse step (graphed) x SDPA gqa (graphed), >= 4 (ideal 8)",
         sdpa["graph_us"] / sparse["graph_us"] if sdpa and sparse else nan,
         bool(sdpa and sparse and sdpa["graph_us"] / sparse["graph_us"] >= 4))
    line("B=1 32K sparse_run eager (us), <= 60", run["eager_us"] if run else nan, bool(run and run["eager_us"] <= 60))
    line("B=1 32K dense paged / SDPA gqa (graphed), <= 1.2",
         dense["graph_us"] / sdpa["graph_us"] if dense and sdpa else nan,
         bool(dense and sdpa and dense["graph_us"] / sdpa["graph_us"] <= 1.2))
    # issue 35's cost bar, on the GPU: the re-rank's extra time <= 10% of the sparse step (graphed, 2048-token capacity)
    for b in (1, 8):
        base, rr = at.get((b, 32768, "sparse_gamma")), at.get((b, 32768, "sparse_rerank"))
        extra = rr["graph_us"] / base["graph_us"] - 1 if base and rr else nan
        line(f"B={b} 32K rerank int4 extra over sparse_gamma (graphed), <= 0.10", extra, extra <= 0.10)
    return lines


def graphed(fn):
    """Capture ``fn`` once as a CUDA graph and return its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def time_us(fn, device) -> float:
    if device.type == "cuda":
        import triton
        return 1e3 * triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()
    t0 = time.perf_counter()
    for _ in range(3):
        fn()
    return 1e6 * (time.perf_counter() - t0) / 3


def bytes_moved(method, L, B, Hkv, D, S, budget_pages, elt):
    """DESIGN.md §1 per step (:mod:`tinyattn.metrics`): K and V of every token (dense), or the page boxes plus
    the kept pages (sparse)."""
    from tinyattn import metrics

    if method == "sparse":
        return B * Hkv * metrics.sparse_bytes(L, D, S, budget_pages, elt)
    return B * Hkv * metrics.dense_bytes(L, D, elt)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (smoke run, no graphs)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="cache and query dtype (default bf16)")
    ap.add_argument("--contexts", default="4K,16K,32K,64K,128K", help="context lengths L (default 4K..128K)")
    ap.add_argument("--batches", default="1,8", help="batch sizes B (default 1,8)")
    ap.add_argument("--token-budget", type=int, default=2048, help="sparse token budget (default 2048)")
    ap.add_argument("--num-q-heads", type=int, default=32, help="Hq (default 32)")
    ap.add_argument("--num-kv-heads", type=int, default=8, help="Hkv (default 8)")
    ap.add_argument("--head-dim", type=int, default=128, help="D (default 128)")
    ap.add_argument("--page-size", type=int, default=16, help="tokens per page (default 16)")
    ap.add_argument("--max-gib", type=float, default=40.0, help="skip problems whose caches exceed this (GiB)")
    ap.add_argument("--out", type=Path, default=None, help="folder for gpu_graphs.csv (default: print only)")
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    elt = torch.empty(0, dtype=dtype).element_size()
    S, D, Hq, Hkv = args.page_size, args.head_dim, args.num_q_heads, args.num_kv_heads
    budget_pages = args.token_budget // S
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"# {name}, torch {torch.__version__}, {args.dtype}, Hq={Hq} Hkv={Hkv} D={D} page {S}, "
          f"budget {args.token_budget} tokens")
    rows = []
    torch.manual_seed(0)
    with torch.no_grad(), tinyattn.value_checks(False):
        for B in [int(b) for b in args.batches.split(",")]:
            for L in [parse_size(c) for c in args.contexts.split(",")]:
                gib = 6 * B * L * Hkv * D * elt / 2**30          # paged pools + the contiguous copies (two layouts)
                if gib > args.max_gib:
                    print(f"skip B={B} L={L}: {gib:.1f} GiB")
                    continue
                p = make_problem(L, B, Hq, Hkv, D, S, dtype, device)
                base_graph = None
                for method, fn in methods(p, budget_pages).items():
                    eager = time_us(fn, device)
                    graph = float("nan")
                    if device.type == "cuda":
                        try:
                            graph = time_us(graphed(fn), device)
                        except Exception as exc:       # a stock method that cannot be captured: eager only
                            print(f"# {method}: no CUDA graph ({type(exc).__name__}: {exc})")
                            torch.cuda.synchronize()
                    nbytes = bytes_moved(method.split("_")[0], L, B, Hkv, D, S, budget_pages, elt)
                    if method == "sdpa_gqa":
                        base_graph = graph if device.type == "cuda" else eager
                    best = graph if graph == graph else eager
                    ideal = bytes_moved("dense", L, B, Hkv, D, S, budget_pages, elt) / nbytes
                    row = dict(batch=B, context=L, method=method, eager_us=round(eager, 1),
                               graph_us=round(graph, 1), gbps=round(nbytes / best / 1e3, 1),
                               speedup_vs_sdpa_gqa=round(base_graph / best, 2), ideal=round(ideal, 2),
                               efficiency=round(base_graph / best / ideal, 3))
                    rows.append(row)
                    print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
                del p
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    print("\n| B | context | method | eager (us) | CUDA graph (us) | GB/s | speedup vs SDPA gqa | ideal | efficiency |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['batch']} | {r['context']} | {r['method']} | {r['eager_us']} | {r['graph_us']} | {r['gbps']} | "
              f"{r['speedup_vs_sdpa_gqa']} | {r['ideal']} | {100 * r['efficiency']:.0f}% |")
    print()
    for text in goals(rows):
        print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        with open(args.out / "gpu_graphs.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        print(f"wrote {args.out / 'gpu_graphs.csv'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
