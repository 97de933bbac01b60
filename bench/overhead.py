"""Per-call overhead of the ops against SDPA, and stories260K decode speed against Hugging Face, in one run.

Two tables (CSV + PNG + Markdown printed for docs/benchmarks.md), 1 CPU thread by default:

1. **per call**, tiny / small / medium decode problems (B rows of context L, Hq/Hkv heads, head_dim D, page
   16, budget 4 / 16 / 64 pages): median microseconds of

   - ``sdpa_gqa``: ``F.scaled_dot_product_attention(..., enable_gqa=True)`` on a contiguous ``[B, Hkv, L, D]``
     cache (what a stock Hugging Face model runs), and ``sdpa_folded``: the query heads of each KV head folded
     into rows (the fastest SDPA form on a CPU) - the baselines;
   - ``paged_attention`` and ``sparse_paged_attention`` (the public ops: validate, plan and run every call);
   - ``plan.run dense`` / ``plan.run sparse``: one :class:`tinyattn.PagedAttentionPlan` run, the per-layer cost a
     model pays (the plan is built once per step and shared by the layers; ``plan`` is its cost);

2. **end to end**, stories260K greedy decode from BOS, 200 new tokens, budget 4 pages of 16: tokens/s of
   Hugging Face ``generate`` with stock SDPA attention, of the same model with ``attn_implementation="tinyattn"`` +
   ``TinyAttnCache(page_budget=4)``, and of the tinyattn runtime (``LlamaRuntime``).
   Needs transformers (the ``hf`` extra); skipped without it.

    python bench/overhead.py                      # writes out/bench/overhead*.csv|png (scratch)
    python bench/overhead.py --out docs/bench     # the committed figures

Ratios are taken against a baseline timed in the same run, interleaved (each repeat times every method once).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402

import tinyattn  # noqa: E402

PROBLEMS = {   # name: (batch, context, Hq, Hkv, head_dim, page_budget)
    "tiny": (1, 200, 8, 4, 8, 4),           # one stories260K layer at 200 tokens
    "small": (4, 1024, 8, 2, 64, 16),
    "medium": (8, 4096, 32, 8, 128, 64),
}
PAGE_SIZE = 16


def _median_us(fn, repeats: int, inner: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t0) / inner * 1e6)
    return statistics.median(times)


def per_call_rows(names, repeats: int) -> list[dict]:
    rows = []
    for name in names:
        B, L, Hq, Hkv, D, budget = PROBLEMS[name]
        torch.manual_seed(0)
        P = -(-L // PAGE_SIZE)
        num_pages = B * P
        kc = torch.randn(num_pages, PAGE_SIZE, Hkv, D)
        vc = torch.randn(num_pages, PAGE_SIZE, Hkv, D)
        bt = torch.randperm(num_pages).view(B, P).int()
        sl = torch.full((B,), L, dtype=torch.int32)
        k_min = torch.empty(num_pages, Hkv, D)
        k_max = torch.empty(num_pages, Hkv, D)
        tinyattn.update_page_metadata(kc, bt, sl, k_min, k_max)
        q = torch.randn(B, Hq, D)
        k = torch.randn(B, Hkv, L, D)
        v = torch.randn(B, Hkv, L, D)
        q_sdpa = q[:, :, None]                                         # [B, Hq, 1, D]
        q_fold = q.view(B, Hkv, Hq // Hkv, D)
        plan = tinyattn.PagedAttentionPlan()

        def planned():
            plan.plan(bt, sl, num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D, page_size=PAGE_SIZE,
                      page_budget=budget, trusted=True)

        planned()
        methods = {
            "sdpa_gqa": lambda: F.scaled_dot_product_attention(q_sdpa, k, v, enable_gqa=True),
            "sdpa_folded": lambda: F.scaled_dot_product_attention(q_fold, k, v),
            "paged_attention": lambda: tinyattn.paged_attention(q, kc, vc, bt, sl),
            "sparse_paged_attention": lambda: tinyattn.sparse_paged_attention(
                q, kc, vc, bt, sl, k_min=k_min, k_max=k_max, page_budget=budget),
            "plan": planned,
            "plan.run dense": lambda: plan.run(q, kc, vc),
            "plan.run sparse": lambda: plan.run(q, kc, vc, k_min=k_min, k_max=k_max),
        }
        inner = max(1, int(2000 / (B * L * Hq * D / 12800) ** 0.5))
        for fn in methods.values():                                    # warm up (tables, allocator)
            for _ in range(5):
                fn()
        samples = {m: [] for m in methods}
        for _ in range(repeats):                                       # interleaved
            for m, fn in methods.items():
                samples[m].append(_median_us(fn, 1, inner))
        med = {m: statistics.median(s) for m, s in samples.items()}
        base = med["sdpa_gqa"]
        for m, us in med.items():
            rows.append(dict(problem=name, batch=B, context=L, num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D,
                             page_budget=budget, method=m, us_per_call=us, x_sdpa_gqa=us / base,
                             x_sdpa_folded=us / med["sdpa_folded"]))
    return rows


def _hf_models():
    from tinyattn.assets import default_model_path, default_tokenizer_path
    from tinyattn.integrations.convert import convert
    import tinyattn.integrations.hf  # noqa: F401  registers "tinyattn"
    from transformers import AutoModelForCausalLM

    out = Path(tempfile.mkdtemp(prefix="tinyattn-hf-"))
    convert(default_model_path(), out, default_tokenizer_path())
    stock = AutoModelForCausalLM.from_pretrained(out, attn_implementation="sdpa").eval()
    ours = AutoModelForCausalLM.from_pretrained(out, attn_implementation="tinyattn").eval()
    return stock, ours


def end_to_end_rows(repeats: int, new_tokens: int, budget: int) -> list[dict]:
    from tinyattn.assets import default_model_path
    from tinyattn.models import LlamaModel, LlamaRuntime

    runners = {}
    model = LlamaModel.from_llama2c(default_model_path())
    runtime = LlamaRuntime(model, page_size=PAGE_SIZE, page_budget=budget)
    runners["tinyattn runtime"] = lambda: runtime.generate([[1]], max_new_tokens=new_tokens, eos_id=None)
    try:
        from tinyattn.integrations.hf import TinyAttnCache
        stock, ours = _hf_models()
    except ImportError as e:
        print(f"skipping the Hugging Face rows ({e}); pip install -e '.[hf]'")
    else:
        ids = torch.tensor([[1]])
        kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        runners["HF stock (sdpa)"] = lambda: stock.generate(ids, **kw)
        runners["HF + tinyattn"] = lambda: ours.generate(
            ids, cache=TinyAttnCache(ours.config, page_size=PAGE_SIZE, page_budget=budget), **kw)
    texts = {}
    with torch.no_grad():
        for name, fn in runners.items():                               # warm up; keep the tokens
            out = fn()
            texts[name] = out.tokens[0] if hasattr(out, "tokens") else out[0, 1:].tolist()
        samples = {m: [] for m in runners}
        for _ in range(repeats):
            for m, fn in runners.items():
                t0 = time.perf_counter()
                fn()
                samples[m].append(time.perf_counter() - t0)
    base_name = "HF stock (sdpa)" if "HF stock (sdpa)" in samples else "tinyattn runtime"
    base = new_tokens / statistics.median(samples[base_name])
    rows = []
    for m, s in samples.items():
        tps = new_tokens / statistics.median(s)                        # prefill of one BOS token included
        rows.append(dict(method=m, new_tokens=new_tokens, page_budget=budget, tokens_per_s=tps,
                         x_hf_stock=tps / base, same_tokens_as_runtime=texts[m] == texts["tinyattn runtime"]))
    return rows


def plot(call_rows, e2e_rows, path: Path, title: str) -> None:
    plt = C.pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw=dict(width_ratios=[3, 1.3]))
    ax = axes[0]
    problems = list(dict.fromkeys(r["problem"] for r in call_rows))
    methods = [m for m in dict.fromkeys(r["method"] for r in call_rows) if m != "plan"]
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        ys = [next(r["us_per_call"] for r in call_rows if r["problem"] == p and r["method"] == m) for p in problems]
        ax.bar([j + i * width for j in range(len(problems))], ys, width, label=m)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(problems))],
                  [f"{p}\nB={PROBLEMS[p][0]} L={PROBLEMS[p][1]} D={PROBLEMS[p][4]}" for p in problems])
    ax.set_yscale("log")
    ax.set_ylabel("µs per call (median, log scale)")
    ax.legend(fontsize=7, ncol=2)
    ax.set_title("per call (lower is better)", fontsize=9)
    ax = axes[1]
    if e2e_rows:
        ax.barh([r["method"] for r in e2e_rows], [r["tokens_per_s"] for r in e2e_rows], color="tab:green")
        ax.set_xlabel("tokens/s (higher is better)")
        ax.set_title("stories260K greedy, budget 4 pages", fontsize=9)
    C.save_figure(plt, fig, path, title, 10)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=C.DEFAULT_OUT,
                   help="output folder (default: out/bench, git-ignored scratch; the committed figures: docs/bench)")
    p.add_argument("--problems", default="tiny,small,medium",
                   help=f"comma-separated per-call problems among {', '.join(PROBLEMS)} (default: all)")
    p.add_argument("--repeats", type=int, default=7, help="interleaved repeats; medians are reported (default: 7)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: 1)")
    p.add_argument("--new-tokens", type=int, default=200, help="tokens generated per end-to-end run (default: 200)")
    p.add_argument("--e2e-repeats", type=int, default=3, help="end-to-end repeats (default: 3)")
    p.add_argument("--no-e2e", action="store_true", help="skip the end-to-end stories260K rows")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    names = [n.strip() for n in args.problems.split(",") if n.strip()]
    bad = [n for n in names if n not in PROBLEMS]
    if bad:
        p.error(f"--problems: expected names among {', '.join(PROBLEMS)}, got {', '.join(bad)}")
    call_rows = per_call_rows(names, args.repeats)
    C.write_csv(args.out / "overhead.csv", call_rows)
    C.print_table(call_rows, [("problem", "problem", ""), ("method", "method", ""), ("us_per_call", "µs/call", ".1f"),
                              ("x_sdpa_gqa", "x SDPA gqa", ".2f"), ("x_sdpa_folded", "x SDPA folded", ".2f")])
    e2e = [] if args.no_e2e else end_to_end_rows(args.e2e_repeats, args.new_tokens, budget=4)
    if e2e:
        C.write_csv(args.out / "overhead_e2e.csv", e2e)
        C.print_table(e2e, [("method", "decode path", ""), ("tokens_per_s", "tokens/s", ".0f"),
                            ("x_hf_stock", "x HF stock", ".2f"), ("same_tokens_as_runtime", "same tokens", "")])
    plot(call_rows, e2e, args.out / "overhead.png",
         f"tinyattn per-call overhead - {C.machine_name('cpu')}, fp32")
    return 0


if __name__ == "__main__":
    sys.exit(main())
