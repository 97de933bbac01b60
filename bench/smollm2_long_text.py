"""NLL of real long text on SmolLM2-135M-Instruct (dequantized Q4_1) under sparse decode, by position bucket.

The text is the public-domain excerpt shipped in ``tinyattn/data/book_of_mormon_1nephi.txt`` (1 Nephi, ~16.6K
SmolLM2 tokens; attribution in tinyattn/data/README.md). Per window of ``--context`` tokens, one dense prefill
grows through the window; at each bucket position ``p`` (e.g. 1K, 2K, 4K, 8K - N) the next ``N`` tokens are
teacher-forced one at a time through the decode path under every (policy, budget) and under dense, their NLL
recorded, and the cache truncated back to ``p`` (:meth:`tinyattn.PagedKVCache.truncate`) before the next
configuration; then the prefill continues to the next bucket. The budget of a bucket is a fraction of *its*
context: ``page_budget = ceil(p / page_size * fraction)``.

Writes ``OUT/long_text.json`` / ``.csv`` (one row per window, bucket, page size, policy, budget: mean NLL in
nats/token over the bucket's ``N`` tokens, the dense NLL of the same tokens, the ratio, and ``pages_attended`` /
``tokens_attended``: the mean pages and tokens attended per (KV head, sparse layer, decode step) of the bucket's
``N - 1`` decode steps, forced pages included, as bench/smollm2_ruler.py counts them: analytically for dense and
Quest's fused fixed budget, from the selections for top-p and other policies; older files without them still merge)
and ``OUT/long_text.png`` (NLL / dense - 1 vs budget, per bucket). A ``quest:...:rerank=int4`` label makes the cache
keep 4-bit key codes.

    nice -n 5 python bench/smollm2_long_text.py --out docs/smollm2 --context 8192 --buckets 2048,4096,8160 \\
        --tokens 32 --budgets 1/4,1/8,1/32 --policies quest,streaming,h2o,oracle
"""

from __future__ import annotations

import argparse
import json
import time
from fractions import Fraction
from pathlib import Path

import torch

from common import (RECIPES, AttendedCounter, attended_means, needs_key_codes, policy_from_label, pyplot,
                    selection_from_label)

SMOLLM2 = "SmolLM2-135M-Instruct (dequantized Q4_1)"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("docs/smollm2"))
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--windows", type=int, default=1)
    p.add_argument("--buckets", default="2048,4096,8160", help="positions where N tokens are scored")
    p.add_argument("--tokens", type=int, default=32, help="N: tokens scored per bucket")
    p.add_argument("--budgets", default="1/4,1/8,1/32")
    p.add_argument("--page-sizes", default="16")
    p.add_argument("--policies", default="quest,streaming,h2o,oracle",
                   help="comma-separated labels name or name:key=value:... (e.g. quest:gamma=0.25 or "
                        "quest:gamma=0.25:top_p=0.9: the quest selection's box estimate and top-p budget, "
                        "SparsityConfig's gamma / top_p; quest:gamma=0.25:top_p=0.8:rerank=int4 or "
                        "quest:gamma=0.25:rerank=int4:candidates=2: the re-rank of the candidates by 4-bit key codes, "
                        "SparsityConfig's rerank / candidates, the cache then keeps the codes; questmass:gamma=0.5: "
                        "questmass's own argument)")
    p.add_argument("--recipes", default="default",
                   help=f"sparse-decode recipes (num_sink_pages, dense_layers), any of: "
                        f"{'; '.join(f'{k} {v}' for k, v in RECIPES.items())}")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--backend", choices=["torch", "triton"], default=None,
                   help="tinyattn's attention backend (default: by device: torch on the CPU, triton on CUDA; "
                        "TRITON_INTERPRET=1 makes it the slow Triton interpreter on the CPU)")
    p.add_argument("--model", default="smollm2",
                   help="a tinyattn model source: 'smollm2' (default), a llama GGUF or a Hugging Face folder; the text "
                        "is encoded by its tokenizer")
    p.add_argument("--merge", default=None, metavar="DIR1,DIR2,...",
                   help="merge the long_text.json of these output folders (runs over the same windows and buckets) "
                        "into --out (rows, plot, summary) and exit")
    args = p.parse_args(argv)
    if args.merge:
        return _merge(args)
    torch.set_num_threads(args.threads)

    from tqdm.auto import tqdm

    from tinyattn.assets import data_path
    from tinyattn.layer import PagedAttention, SparsityConfig
    from tinyattn.models import sources
    from tinyattn.retrieval.evaluate import page_budget_for, prefill

    model, tok = sources.load_model(args.model), sources.load_tokenizer(args.model)
    ids = tok.encode(data_path("book_of_mormon_1nephi.txt").read_text(encoding="utf-8"))
    buckets = [int(b) for b in args.buckets.split(",")]
    fractions = [Fraction(b) for b in args.budgets.split(",")]
    policies = args.policies.split(",")
    page_sizes = [int(s) for s in args.page_sizes.split(",")]
    n = args.tokens
    if max(buckets) + n > args.context or args.windows * args.context > len(ids):
        raise SystemExit(f"buckets + tokens must fit the context, and windows x context the text ({len(ids)} tokens)")
    rows, t0 = [], time.perf_counter()
    recipes = {r: RECIPES[r] for r in args.recipes.split(",")}
    key_codes = needs_key_codes(policies)               # 4-bit key codes beside the pool only for a re-rank
    total = args.windows * len(page_sizes) * len(buckets) * (1 + len(recipes) * len(policies) * len(fractions))
    bar = tqdm(total=total, desc="long text", unit="config")
    for w in range(args.windows):
        window = ids[w * args.context:(w + 1) * args.context]
        for ps in page_sizes:
            cache = model.new_cache(page_size=ps, num_pages=-(-args.context // ps) + 1, key_codes=key_codes)
            sid = cache.add_sequence()
            dense_att = PagedAttention(None, backend=args.backend)
            done = 0
            for b in buckets:
                logits = prefill(model, cache, sid, window[done:b], attention=dense_att)
                done = b
                target = window[b:b + n]

                def score(attention, page_budget) -> tuple[float, float | None, float | None]:
                    """Mean NLL of the bucket's tokens, mean pages and tokens attended of its decode steps."""
                    counter = AttendedCounter(ps)       # as the RULER bench counts them
                    counted = counter.hook(attention)
                    nll, prev = 0.0, logits
                    for i, t in enumerate(target):
                        nll -= torch.log_softmax(prev.float(), -1)[t].item()
                        if i + 1 < len(target):
                            prev = model(torch.tensor([[t]]), cache, [sid], sparse=True, attention=attention,
                                         last_only=True)[0]
                    cache.truncate(sid, b)
                    pages, ntok = attended_means(counter, counted, sid, prompt_len=b, steps=len(target) - 1,
                                                 page_budget=page_budget)
                    return nll / len(target), pages, ntok

                dense, pages, ntok = score(dense_att, None)
                bar.update(1)
                rows.append(dict(window=w, position=b, page_size=ps, recipe="dense", policy="dense",
                                 budget_fraction=None, page_budget=None, nll=dense, dense_nll=dense, ratio=1.0,
                                 pages_attended=pages, tokens_attended=ntok))
                for rname, recipe in recipes.items():
                    for pol, f in ((pol, f) for pol in policies for f in fractions):
                        budget = page_budget_for(b, ps, f, num_sink_pages=recipe["num_sink_pages"],
                                                 num_recent_pages=recipe["num_recent_pages"])
                        att = PagedAttention(SparsityConfig(page_budget=budget, policy=policy_from_label(pol), **recipe,
                                                            **selection_from_label(pol)), backend=args.backend)
                        v, pages, ntok = score(att, budget)
                        rows.append(dict(window=w, position=b, page_size=ps, recipe=rname, policy=pol,
                                         budget_fraction=float(f), page_budget=budget, nll=v, dense_nll=dense,
                                         ratio=v / dense, pages_attended=pages, tokens_attended=ntok))
                        bar.update(1)
                _write(args, rows, time.perf_counter() - t0)
    bar.close()
    return 0


def _write(args, rows, seconds, merged=None) -> None:
    from tinyattn.results_io import write_csv, write_json

    args.out.mkdir(parents=True, exist_ok=True)
    meta = dict(vars(args), out=str(args.out), seconds=round(seconds, 1), merged=merged,
                recipes={r: RECIPES[r] for r in args.recipes.split(",")},
                model=SMOLLM2 if getattr(args, "model", "smollm2") == "smollm2" else str(args.model),
                text="tinyattn/data/book_of_mormon_1nephi.txt (public domain)",
                h2o="statistics from the teacher-forced decode steps only (no prefill observation)")
    write_json(args.out / "long_text.json", {"meta": meta, "rows": rows})
    # the columns of every row (merged older rows lack the attended ones: empty cells)
    write_csv(args.out / "long_text.csv", list(dict.fromkeys(k for r in rows for k in r)), rows)
    (args.out / "long_text_summary.md").write_text(
        f"# Long text on SmolLM2-135M-Instruct: NLL vs dense\n\nmeta: `{json.dumps(meta)}`\n\n"
        f"{summary_table(rows)}\n")
    _plot(args, rows)


def _merge(args) -> int:
    runs = [json.loads((Path(d) / "long_text.json").read_text()) for d in args.merge.split(",")]
    rows, seen = [], set()
    for run in runs:
        for r in run["rows"]:
            key = (r["window"], r["position"], r["page_size"], r.get("recipe"), r["policy"], r["budget_fraction"])
            if key not in seen:                 # each run scores dense again: keep one copy
                seen.add(key)
                rows.append(r)
    # the merged file says what its parts ran, not this command's defaults: each setting the union of the parts'
    for key in ("context", "windows", "buckets", "tokens", "budgets", "page_sizes", "policies", "threads", "model"):
        setattr(args, key, _union(run["meta"][key] for run in runs if key in run["meta"]))
    names = (run["meta"]["recipes"] for run in runs)          # a dict, or the option's text in older runs
    args.recipes = ",".join(dict.fromkeys(r for n in names for r in (n.split(",") if isinstance(n, str) else n)))
    _write(args, rows, sum(run["meta"]["seconds"] for run in runs), merged=args.merge.split(","))
    return 0


def _union(values):
    """The parts' values of one setting: the value when they agree, else a comma-joined union of their items."""
    values = list(values)
    if len(set(map(str, values))) == 1:
        return values[0]
    return ",".join(dict.fromkeys(item for v in values for item in str(v).split(",")))


def summary_table(rows) -> str:
    """Markdown: mean NLL per (page size, recipe, policy, budget) over every scored token, its change vs dense on the
    same tokens, and the mean tokens attended per (KV head, sparse layer, decode step) ("-" for rows written before
    it was recorded)."""
    groups: dict[tuple, list] = {}
    for r in rows:
        if r["policy"] != "dense":
            groups.setdefault((r["page_size"], r["recipe"], r["policy"], r["budget_fraction"]), []).append(r)
    out = ["| page size | recipe | policy | budget | mean NLL | dense NLL | vs dense | tokens attended |",
           "|---:|---|---|---|---:|---:|---:|---:|"]
    for (ps, recipe, pol, f), rs in sorted(groups.items(), key=lambda kv: (-kv[0][0], kv[0][1], kv[0][3], kv[0][2])):
        nll = sum(r["nll"] for r in rs) / len(rs)
        dense = sum(r["dense_nll"] for r in rs) / len(rs)
        attended = [r["tokens_attended"] for r in rs if r.get("tokens_attended") is not None]
        tokens = f"{sum(attended) / len(attended):.0f}" if len(attended) == len(rs) else "-"
        out.append(f"| {ps} | {recipe} | {pol} | 1/{round(1 / f)} | {nll:.4f} | {dense:.4f} | "
                   f"{100 * (nll / dense - 1):+.2f}% | {tokens} |")
    return "\n".join(out)


def _plot(args, rows) -> None:
    """NLL vs dense (%) by position bucket, one panel per budget, a line per (page size, recipe, policy); the
    mean over the windows; nothing without matplotlib (the plots extra)."""
    plt = pyplot()
    if plt is None:
        return
    budgets = sorted({r["budget_fraction"] for r in rows if r["policy"] != "dense"}, reverse=True)
    fig, axes = plt.subplots(1, len(budgets), figsize=(9 * len(budgets), 4.5), squeeze=False)
    colors = {pol: f"C{i}" for i, pol in enumerate(sorted({r["policy"] for r in rows}))}
    styles = {name: st for name, st in zip(sorted({r["recipe"] for r in rows}), ["-", "--", ":", "-.", (0, (5, 1)),
                                                                                 (0, (1, 3)), (0, (3, 1, 1, 1))])}
    for ax, f in zip(axes[0], budgets):
        lines = sorted({(r["page_size"], r["recipe"], r["policy"]) for r in rows if r["budget_fraction"] == f})
        for ps, rname, pol in lines:
            sel = [r for r in rows if (r["page_size"], r["recipe"], r["policy"], r["budget_fraction"]) ==
                   (ps, rname, pol, f)]
            xs = sorted({r["position"] for r in sel})
            ys = [100 * (sum(r["nll"] for r in sel if r["position"] == x) /
                         sum(r["dense_nll"] for r in sel if r["position"] == x) - 1) for x in xs]
            ax.plot(xs, ys, marker="o" if ps == 16 else "s" if ps == 8 else "^", color=colors[pol],
                    linestyle=styles.get(rname, "-"), label=f"{pol}, {rname}, page {ps}")
        ax.axhline(0, color="k", lw=0.5)
        ax.set_title(f"budget 1/{round(1 / f)} of the context, {args.tokens} tokens per bucket")
        ax.set_xlabel("position (tokens) of the scored bucket")
        ax.set_ylabel("NLL vs dense (%)")
        ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.suptitle("SmolLM2-135M-Instruct (dequantized Q4_1), real text: sparse decode NLL vs dense", fontsize=9)
    fig.tight_layout()
    fig.savefig(args.out / "long_text.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
