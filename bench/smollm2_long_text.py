"""NLL of real long text on SmolLM2-135M-Instruct (dequantized Q4_1) under sparse decode, by position bucket.

The text is the public-domain excerpt shipped in ``tinyattn/data/book_of_mormon_1nephi.txt`` (1 Nephi, ~16.6K
SmolLM2 tokens; attribution in tinyattn/data/README.md). Per window of ``--context`` tokens, one dense prefill
grows through the window; at each bucket position ``p`` (e.g. 1K, 2K, 4K, 8K - N) the next ``N`` tokens are
teacher-forced one at a time through the decode path under every (policy, budget) and under dense, their NLL
recorded, and the cache truncated back to ``p`` (:meth:`tinyattn.PagedKVCache.truncate`) before the next
configuration; then the prefill continues to the next bucket. The budget of a bucket is a fraction of *its*
context: ``page_budget = ceil(p / page_size * fraction)``.

Writes ``OUT/long_text.json`` / ``.csv`` (one row per window, bucket, page size, policy, budget: mean NLL in
nats/token over the bucket's ``N`` tokens, the dense NLL of the same tokens, the ratio) and
``OUT/long_text.png`` (NLL / dense - 1 vs budget, per bucket).

    nice -n 5 python bench/smollm2_long_text.py --out docs/smollm2 --context 8192 --buckets 2048,4096,8160 \\
        --tokens 32 --budgets 1/4,1/8,1/32 --policies quest,streaming,h2o,oracle
"""

from __future__ import annotations

import argparse
import json
import math
import time
from fractions import Fraction
from pathlib import Path

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("docs/smollm2"))
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--windows", type=int, default=1)
    p.add_argument("--buckets", default="2048,4096,8160", help="positions where N tokens are scored")
    p.add_argument("--tokens", type=int, default=32, help="N: tokens scored per bucket")
    p.add_argument("--budgets", default="1/4,1/8,1/32")
    p.add_argument("--page-sizes", default="16")
    p.add_argument("--policies", default="quest,streaming,h2o,oracle")
    p.add_argument("--num-sink-pages", type=int, default=0)
    p.add_argument("--dense-layers", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from tqdm.auto import tqdm

    from tinyattn.assets import data_path
    from tinyattn.layer import PagedAttention, SparsityConfig
    from tinyattn.models import sources
    from tinyattn.retrieval.evaluate import prefill
    from tinyattn.selection import get_policy

    model, tok = sources.load_model("smollm2"), sources.load_tokenizer("smollm2")
    ids = tok.encode(data_path("book_of_mormon_1nephi.txt").read_text(encoding="utf-8"))
    buckets = [int(b) for b in args.buckets.split(",")]
    fractions = [Fraction(b) for b in args.budgets.split(",")]
    policies = args.policies.split(",")
    page_sizes = [int(s) for s in args.page_sizes.split(",")]
    n = args.tokens
    if max(buckets) + n > args.context or args.windows * args.context > len(ids):
        raise SystemExit(f"buckets + tokens must fit the context, and windows x context the text ({len(ids)} tokens)")
    rows, t0 = [], time.perf_counter()
    total = args.windows * len(page_sizes) * len(buckets) * (1 + len(policies) * len(fractions))
    bar = tqdm(total=total, desc="long text", unit="config")
    for w in range(args.windows):
        window = ids[w * args.context:(w + 1) * args.context]
        for ps in page_sizes:
            cache = model.new_cache(page_size=ps, num_pages=-(-args.context // ps) + 1)
            sid = cache.add_sequence()
            dense_att = PagedAttention(None)
            done = 0
            for b in buckets:
                logits = prefill(model, cache, sid, window[done:b], attention=dense_att)
                done = b
                target = window[b:b + n]

                def score(attention) -> float:
                    nll, prev = 0.0, logits
                    for i, t in enumerate(target):
                        nll -= torch.log_softmax(prev.float(), -1)[t].item()
                        if i + 1 < len(target):
                            prev = model(torch.tensor([[t]]), cache, [sid], sparse=True, attention=attention,
                                         last_only=True)[0]
                    cache.truncate(sid, b)
                    return nll / len(target)

                dense = score(dense_att)
                bar.update(1)
                rows.append(dict(window=w, position=b, page_size=ps, policy="dense", budget_fraction=None,
                                 page_budget=None, nll=dense, dense_nll=dense, ratio=1.0))
                for pol in policies:
                    for f in fractions:
                        budget = max(math.ceil(Fraction(b, ps) * f), args.num_sink_pages + 1)
                        att = PagedAttention(SparsityConfig(page_budget=budget, num_sink_pages=args.num_sink_pages,
                                                            num_recent_pages=1, dense_layers=args.dense_layers,
                                                            policy=get_policy(pol)))
                        v = score(att)
                        rows.append(dict(window=w, position=b, page_size=ps, policy=pol, budget_fraction=float(f),
                                         page_budget=budget, nll=v, dense_nll=dense, ratio=v / dense))
                        bar.update(1)
                _write(args, rows, time.perf_counter() - t0)
    bar.close()
    return 0


def _write(args, rows, seconds) -> None:
    from tinyattn.results_io import write_csv, write_json

    args.out.mkdir(parents=True, exist_ok=True)
    meta = dict(vars(args), out=str(args.out), seconds=round(seconds, 1),
                model="SmolLM2-135M-Instruct (dequantized Q4_1)",
                text="tinyattn/data/book_of_mormon_1nephi.txt (public domain)",
                h2o="statistics from the teacher-forced decode steps only (no prefill observation)")
    write_json(args.out / "long_text.json", {"meta": meta, "rows": rows})
    write_csv(args.out / "long_text.csv", list(rows[0]), rows)
    _plot(args, rows)


def _plot(args, rows) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    positions = sorted({r["position"] for r in rows})
    fig, axes = plt.subplots(1, len(positions), figsize=(4 * len(positions), 3.2), squeeze=False)
    for ax, pos in zip(axes[0], positions):
        for pol in sorted({r["policy"] for r in rows if r["policy"] != "dense"}):
            pts = sorted((r["budget_fraction"], r["ratio"]) for r in rows
                         if r["position"] == pos and r["policy"] == pol)
            fr = sorted({x for x, _ in pts})
            ys = [sum(y for x, y in pts if x == f) / sum(1 for x, _ in pts if x == f) for f in fr]
            ax.plot(fr, [100 * (y - 1) for y in ys], marker="o", label=pol)
        ax.set_xscale("log", base=2)
        ax.axhline(0, color="k", lw=0.5)
        ax.set_title(f"tokens at {pos}..{pos + args.tokens}")
        ax.set_xlabel("budget (fraction of the context's pages)")
        ax.set_ylabel("NLL vs dense (%)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out / "long_text.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
