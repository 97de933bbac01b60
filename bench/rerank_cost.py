"""Cost of the 4-bit re-rank (issue 35's second stage) beside the sparse decode step it refines, on the CPU.

Issue 35's cost bar: "the selection's extra time <= 10% of a sparse step at 32K with a 2048-token capacity (CPU,
one run side by side)". One decode step of one layer, batch 1, 32 query / 8 KV heads, head_dim 128, fp32, page
size 16, ``--context`` tokens (32K: 2048 pages), capacity ``--budget`` pages (128 = 2048 tokens), one sink page,
the torch backend. The pool, its boxes and its 4-bit key codes are built by
``tinyattn.PagedKVCache(1, 8, 128, page_size=16, num_pages=pages + 8, key_codes=True)`` from random normal keys
and values (a few outlier channels per KV head, ``--outlier-channels`` x ``--outlier-scale``) written through
``cache.write``. One :class:`tinyattn.PagedAttentionPlan` (``backend="torch"``) per variant, planned once:

- ``A``  ``plan(..., page_budget=K, num_sink_pages=1, gamma=0.25)``, ``run(q, k, v, k_min=, k_max=)``: today's
  default sparse step (box estimate, fixed budget);
- ``B``  the same with ``rerank="int4", candidates=1.0`` and ``run(..., k_code=)``: the capacity's candidates
  ranked again by their 4-bit attention mass;
- ``B2`` ``B`` with ``top_p=0.8`` (the torch plan keeps the capacity's shape and masks the dropped pages, so its
  attention reads as many rows as ``B``);
- ``B3`` ``B`` with ``candidates=2.0`` (2K candidate pages);
- ``D``  the dense step (``plan`` without a budget, ``run(q, k, v)``), for reference (the cache hands out its pages
  in order, so the dense step takes the torch plan's contiguous-run route: pool views, no gather);

and, to break ``B``'s extra time down, the public ops alone (under ``tinyattn.value_checks(False)``, the plan's
trust): ``score`` = ``page_scores(gamma=0.25)``, ``select C`` = ``select_pages(scores, page_budget=C,
num_sink_pages=1)`` (the candidates), ``rerank C`` = ``rerank_scores(q, k_code, k, k_min, k_max, candidates, ...,
backend="torch")`` with ``C = K`` and ``C = 2K`` candidates.

Timing: one torch thread, every method once per round in a fresh random order (seeded), ``--repeats`` rounds after
``--warmup`` calls each; medians (and quartiles) per method, the ratio of medians and the median of the per-round
(paired) ratios. Run it niced on a shared machine. With ``--profile`` (default on) one torch.profiler run of
``rerank C`` lists the ops it spends its time in.

Beside the times, the bytes-moved ideal (DESIGN.md §1, docs/benchmarks.md, :mod:`tinyattn.metrics`): per (row, KV
head) the sparse step reads the boxes of every page and K and V of the selected pages (``2·P·D·e_box + 2·K·S·D·e``,
plus the queries / outputs); the re-rank adds the candidates' codes (``C·S·D/2`` bytes), their boxes again
(``2·C·D·e_box``; an upper count: a GPU may still hold them in L2 from the scoring pass) and the exact keys of the
row's last page (``S·D·e``): the ratio a memory-bound GPU step would show, for fp32 and bf16 pools.

Reproduce (about a minute at the defaults on a 2-core VM):

    nice -n 5 .venv/bin/python bench/rerank_cost.py --out docs/bench/rerank_cost

writes ``OUT/rerank_cost.json`` (settings, machine, every sample) and ``OUT/rerank_cost.md`` (the tables).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402

import tinyattn  # noqa: E402
from tinyattn import metrics  # noqa: E402

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE = 32, 8, 128, 16
VARIANTS = ("A", "B", "B2", "B3", "D")


# ---------------------------------------------------------------------------- problem
def build_cache(context: int, *, seed: int, outlier_channels: int, outlier_scale: float, chunk: int = 4096):
    """A one-layer :class:`tinyattn.PagedKVCache` with key codes holding ``context`` random tokens of one sequence:
    ``(cache, seq_id)``. Keys and values are standard normal; ``outlier_channels`` channels of each KV head (fixed,
    random) are multiplied by ``outlier_scale`` in the keys (the outlier channels of real post-RoPE keys)."""
    pages = -(-context // PAGE_SIZE)
    cache = tinyattn.PagedKVCache(1, NUM_KV_HEADS, HEAD_DIM, page_size=PAGE_SIZE, num_pages=pages + 8,
                                  key_codes=True)
    sid = cache.add_sequence()
    slots = cache.extend([sid], context)
    g = torch.Generator().manual_seed(seed)
    gain = torch.ones(NUM_KV_HEADS, HEAD_DIM)
    for h in range(NUM_KV_HEADS):
        gain[h, torch.randperm(HEAD_DIM, generator=g)[:outlier_channels]] = outlier_scale
    for i in range(0, context, chunk):      # in chunks: the temporaries stay small
        n = min(chunk, context - i)
        k = torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=g) * gain
        v = torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=g)
        cache.write(0, slots[i:i + n], k, v)
    return cache, sid


# ---------------------------------------------------------------------------- bytes model
def ideal_bytes(context: int, budget: int, candidates: list[int], elem: int, box_elem: int) -> dict:
    """The bytes-moved model of one step (all rows and KV heads, batch 1): ``sparse`` (A), ``dense`` (D) and, per
    candidate count ``C``, what the re-rank adds (codes, the candidates' boxes, the last page's exact keys)."""
    D, S, Hkv = HEAD_DIM, PAGE_SIZE, NUM_KV_HEADS
    io = metrics.io_bytes(1, NUM_Q_HEADS, D, elem)
    sparse = Hkv * metrics.sparse_bytes(context, D, S, budget, elem, box_elem) + io
    dense = Hkv * metrics.dense_bytes(context, D, elem) + io
    rows = []
    for c in candidates:
        codes = Hkv * c * S * D // 2
        boxes = Hkv * 2 * c * D * box_elem
        last = Hkv * S * D * elem
        rows.append(dict(candidates=c, codes_bytes=codes, boxes_bytes=boxes, last_page_bytes=last,
                         extra_codes_boxes=(codes + boxes) / sparse, extra_codes_only=codes / sparse,
                         extra_all=(codes + boxes + last) / sparse))
    return dict(elem=elem, box_elem=box_elem, sparse_bytes=sparse, dense_bytes=dense, dense_over_sparse=dense / sparse,
                rerank=rows)


# ---------------------------------------------------------------------------- timing
def time_interleaved(methods: dict, *, repeats: int, warmup: int, seed: int, progress: bool) -> dict[str, list]:
    """Microseconds of each zero-argument callable: ``warmup`` untimed calls each, then ``repeats`` rounds that call
    every method once in a fresh random order (a slow spell of a shared machine hits every method alike, and no
    method always follows the same one)."""
    from tqdm.auto import tqdm

    for fn in tqdm(list(methods.values()), desc="warm-up", unit="method", disable=not progress):
        for _ in range(warmup):
            fn()
    rng = random.Random(seed)
    names = list(methods)
    samples: dict[str, list] = {n: [] for n in names}
    for _ in tqdm(range(repeats), desc="rounds", unit="round", disable=not progress):
        rng.shuffle(names)
        for name in names:
            fn = methods[name]
            t0 = time.perf_counter_ns()
            fn()
            samples[name].append((time.perf_counter_ns() - t0) / 1e3)
    return samples


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], statistics.median(xs), q[2]


def profile_ops(fn, calls: int = 5, rows: int = 12) -> list[dict]:
    """One torch.profiler run of ``calls`` calls: the ops by self CPU time (per call)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in ops) or 1.0
    return [dict(op=e.key, self_ms_per_call=e.self_cpu_time_total / calls / 1e3,
                 share=e.self_cpu_time_total / total, calls_per_call=e.count / calls) for e in ops[:rows]]


# ---------------------------------------------------------------------------- main
def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=C.parse_sizes, default=[32768],
                   help="tokens in the sequence, e.g. 32K or 32768 (default: 32K)")
    p.add_argument("--budget", type=int, default=128,
                   help="page_budget, the capacity in pages of 16 tokens (default: 128 = 2048 tokens)")
    p.add_argument("--repeats", type=int, default=200,
                   help="interleaved timing rounds; every method is called once per round (default: 200)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls per method first (default: 3)")
    p.add_argument("--gamma", type=float, default=0.25, help="the box estimate's gamma, all variants (default: 0.25)")
    p.add_argument("--top-p", type=float, default=0.8, help="top_p of variant B2 (default: 0.8)")
    p.add_argument("--wide", type=float, default=2.0,
                   help="candidates of variant B3, a multiple of the budget (default: 2.0)")
    p.add_argument("--sink-pages", type=int, default=1, help="num_sink_pages, all variants (default: 1)")
    p.add_argument("--outlier-channels", type=int, default=4,
                   help="key channels per KV head scaled by --outlier-scale (default: 4)")
    p.add_argument("--outlier-scale", type=float, default=8.0, help="their scale (default: 8)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the data and of the call order (default: 0)")
    p.add_argument("--no-profile", action="store_true", help="skip the torch.profiler table of rerank_scores")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    p.add_argument("--quick", action="store_true", help="4K context, budget 16, 5 rounds: proves the script runs")
    p.add_argument("--out", type=Path, default=C.DEFAULT_OUT / "rerank_cost",
                   help="output folder for rerank_cost.json / rerank_cost.md (default: out/bench/rerank_cost, "
                        "git-ignored scratch; the committed run: docs/bench/rerank_cost)")
    args = p.parse_args(argv)
    if len(args.context) != 1:
        p.error("--context: expected one size")
    args.context = args.context[0]
    if args.quick:
        args.context, args.budget, args.repeats, args.warmup = 4096, 16, 5, 1
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    machine = C.machine_name("cpu")
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    print(f"machine: {machine}, nice {os.nice(0)}")

    t0 = time.perf_counter()
    cache, sid = build_cache(args.context, seed=args.seed, outlier_channels=args.outlier_channels,
                             outlier_scale=args.outlier_scale)
    build_s = time.perf_counter() - t0
    bt, sl = cache.block_table([sid]), cache.seq_lens([sid])
    kc, vc = cache.k_cache[0], cache.v_cache[0]
    k_min, k_max, k_code = cache.k_min[0], cache.k_max[0], cache.k_code[0]
    q = torch.randn(1, NUM_Q_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(args.seed + 1))
    K = args.budget
    c_narrow, c_wide = K, math.ceil(args.wide * K - 1e-9)
    num_pages = int(bt.shape[1])
    print(f"cache built in {build_s:.1f}s: {args.context} tokens, {num_pages} pages, budget {K} pages, "
          f"candidates {c_narrow} / {c_wide}")

    shape = dict(num_q_heads=NUM_Q_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, page_size=PAGE_SIZE)
    sparse = dict(page_budget=K, num_sink_pages=args.sink_pages, gamma=args.gamma)
    settings = {
        "A": sparse,
        "B": dict(sparse, rerank="int4", candidates=1.0),
        "B2": dict(sparse, rerank="int4", candidates=1.0, top_p=args.top_p),
        "B3": dict(sparse, rerank="int4", candidates=args.wide),
        "D": {},
    }
    plans = {name: tinyattn.PagedAttentionPlan(backend="torch").plan(bt, sl, **shape, **kw)
             for name, kw in settings.items()}
    boxes = dict(k_min=k_min, k_max=k_max)
    methods = {
        "A": lambda: plans["A"].run(q, kc, vc, **boxes),
        "B": lambda: plans["B"].run(q, kc, vc, **boxes, k_code=k_code),
        "B2": lambda: plans["B2"].run(q, kc, vc, **boxes, k_code=k_code),
        "B3": lambda: plans["B3"].run(q, kc, vc, **boxes, k_code=k_code),
        "D": lambda: plans["D"].run(q, kc, vc),
    }

    # the public ops of B's selection, alone (inputs made once, outside the timing)
    with tinyattn.value_checks(False):
        scores = tinyattn.page_scores(q, k_min, k_max, bt, sl, page_size=PAGE_SIZE, gamma=args.gamma, backend="torch")
        cands = {c: tinyattn.select_pages(scores, sl, page_size=PAGE_SIZE, page_budget=c,
                                          num_sink_pages=args.sink_pages, backend="torch")
                 for c in (c_narrow, c_wide)}

    def op(fn):
        def call():
            with tinyattn.value_checks(False):
                return fn()
        return call

    methods |= {
        "score": op(lambda: tinyattn.page_scores(q, k_min, k_max, bt, sl, page_size=PAGE_SIZE, gamma=args.gamma,
                                                 backend="torch")),
        f"select {c_narrow}": op(lambda: tinyattn.select_pages(scores, sl, page_size=PAGE_SIZE, page_budget=c_narrow,
                                                               num_sink_pages=args.sink_pages, backend="torch")),
        f"rerank {c_narrow}": op(lambda: tinyattn.rerank_scores(q, k_code, kc, k_min, k_max, cands[c_narrow], bt, sl,
                                                                backend="torch")),
        f"rerank {c_wide}": op(lambda: tinyattn.rerank_scores(q, k_code, kc, k_min, k_max, cands[c_wide], bt, sl,
                                                              backend="torch")),
    }

    # what each variant attends (one call each), and a sanity check of the outputs
    outs = {name: methods[name]() for name in VARIANTS}
    attended, overlap = {}, {}
    chosen_a = plans["A"].last_selection
    for name in VARIANTS:
        if not torch.isfinite(outs[name]).all():
            raise SystemExit(f"variant {name}: non-finite output")
        sel = plans[name].last_selection
        if sel is None:
            attended[name] = float(num_pages)
            continue
        attended[name] = float((sel >= 0).sum(-1).float().mean())
        if name != "A":        # share of A's pages the variant also attends, mean over KV heads
            same = [len(set(sel[0, h][sel[0, h] >= 0].tolist()) & set(chosen_a[0, h].tolist())) / K
                    for h in range(NUM_KV_HEADS)]
            overlap[name] = statistics.mean(same)

    samples = time_interleaved(methods, repeats=args.repeats, warmup=args.warmup, seed=args.seed,
                               progress=not args.no_progress)
    load_after = os.getloadavg()
    prof = [] if args.no_profile else profile_ops(methods[f"rerank {c_narrow}"])

    stats = {}
    for name, s in samples.items():
        p25, med, p75 = quartiles(s)
        stats[name] = dict(median_ms=med / 1e3, p25_ms=p25 / 1e3, p75_ms=p75 / 1e3, min_ms=min(s) / 1e3, runs=len(s))

    def paired(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(samples[a], samples[b]))

    ratios = []
    for num, den in (("B", "A"), ("B2", "A"), ("B3", "A"), ("D", "A"), ("A", "D"), ("B", "D")):
        ratios.append(dict(ratio=f"{num}/{den}", of_medians=stats[num]["median_ms"] / stats[den]["median_ms"],
                           paired_median=paired(num, den)))
    extra = {}
    for name, c in (("B", c_narrow), ("B2", c_narrow), ("B3", c_wide)):
        extra[name] = dict(extra_ms=stats[name]["median_ms"] - stats["A"]["median_ms"],
                           extra_share_of_A=stats[name]["median_ms"] / stats["A"]["median_ms"] - 1,
                           rerank_alone_ms=stats[f"rerank {c}"]["median_ms"],
                           rerank_alone_share_of_A=stats[f"rerank {c}"]["median_ms"] / stats["A"]["median_ms"])

    cand_counts = [c_narrow, c_wide]
    ideal = {dt: ideal_bytes(args.context, K, cand_counts, e, e) for dt, e in (("fp32", 4), ("bf16", 2))}

    result = dict(
        what="issue 35 cost bar: the 4-bit re-rank's extra time against a sparse decode step (torch backend, CPU)",
        command="nice -n 5 .venv/bin/python bench/rerank_cost.py " + " ".join(sys.argv[1:] if argv is None else argv),
        started_utc=started, machine=machine, nice=os.nice(0), load_average_before=load_before,
        load_average_after=load_after, torch=torch.__version__, threads=torch.get_num_threads(),
        settings=dict(context=args.context, pages=num_pages, budget_pages=K, page_size=PAGE_SIZE, batch=1,
                      num_q_heads=NUM_Q_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, dtype="fp32",
                      backend="torch", gamma=args.gamma, top_p_B2=args.top_p, candidates_B3=args.wide,
                      num_sink_pages=args.sink_pages, outlier_channels=args.outlier_channels,
                      outlier_scale=args.outlier_scale, repeats=args.repeats, warmup=args.warmup, seed=args.seed,
                      plans={k: {kk: vv for kk, vv in v.items()} for k, v in settings.items()}),
        stats=stats, ratios=ratios, extra=extra, attended_pages=attended, overlap_with_A=overlap,
        ideal=ideal, rerank_profile=prof, samples_us=samples)
    (args.out / "rerank_cost.json").write_text(json.dumps(result, indent=1) + "\n")
    md = markdown(result, c_narrow, c_wide)
    (args.out / "rerank_cost.md").write_text(md)
    print()
    print(md)
    print(f"wrote {args.out / 'rerank_cost.json'}\nwrote {args.out / 'rerank_cost.md'}")
    return 0


# ---------------------------------------------------------------------------- report
def markdown(r: dict, c_narrow: int, c_wide: int) -> str:
    s, st = r["settings"], r["stats"]
    K = s["budget_pages"]
    desc = {
        "A": f"sparse step: gamma {s['gamma']}, budget {K}, {s['num_sink_pages']} sink page",
        "B": f"A + rerank='int4', candidates 1.0 ({c_narrow} pages)",
        "B2": f"B + top_p {s['top_p_B2']}",
        "B3": f"A + rerank='int4', candidates {s['candidates_B3']} ({c_wide} pages)",
        "D": "dense step (no budget)",
        "score": f"page_scores(gamma={s['gamma']}) alone",
        f"select {c_narrow}": f"select_pages(page_budget={c_narrow}) alone",
        f"rerank {c_narrow}": f"rerank_scores, {c_narrow} candidates, alone",
        f"rerank {c_wide}": f"rerank_scores, {c_wide} candidates, alone",
    }
    lines = [
        "# Re-rank cost (issue 35): the 4-bit second stage beside the sparse step, CPU",
        "",
        f"Machine: {r['machine']}; nice {r['nice']}; load average before / after "
        f"{r['load_average_before'][0]:.2f} / {r['load_average_after'][0]:.2f}; started {r['started_utc']}.",
        "",
        f"Command: `{r['command']}`",
        "",
        f"One decode step of one layer: batch 1, {s['num_q_heads']} / {s['num_kv_heads']} heads of {s['head_dim']}, "
        f"fp32, page {s['page_size']}, context {s['context']} tokens ({s['pages']} pages), capacity {K} pages "
        f"({K * s['page_size']} tokens), torch backend, {r['threads']} torch thread. Random normal K/V "
        f"({s['outlier_channels']} key channels per KV head x{s['outlier_scale']:g}) written through "
        f"`PagedKVCache(key_codes=True).write`. {s['repeats']} interleaved rounds (random order per round) after "
        f"{s['warmup']} warm-up calls each; median and quartiles in ms.",
        "",
        "| method | what | median ms | p25 | p75 | x A (ratio of medians) | pages attended / KV head |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    a = st["A"]["median_ms"]
    for name, v in st.items():
        att = r["attended_pages"].get(name)
        lines.append(f"| {name} | {desc.get(name, '')} | {v['median_ms']:.2f} | {v['p25_ms']:.2f} | {v['p75_ms']:.2f} "
                     f"| {v['median_ms'] / a:.3f} | {'' if att is None else f'{att:.1f}'} |")
    lines += ["", "Ratios (ratio of medians; median of the per-round ratios, paired, beside it):", "",
              "| ratio | of medians | paired |", "|---|---:|---:|"]
    lines += [f"| {x['ratio']} | {x['of_medians']:.3f} | {x['paired_median']:.3f} |" for x in r["ratios"]]
    lines += ["", "The bar: the selection's extra time <= 10% of the sparse step (A).", "",
              "| variant | extra ms (median - A's) | extra / A | rerank_scores alone, ms | alone / A |",
              "|---|---:|---:|---:|---:|"]
    for name, x in r["extra"].items():
        lines.append(f"| {name} | {x['extra_ms']:.2f} | {x['extra_share_of_A']:.1%} | {x['rerank_alone_ms']:.2f} | "
                     f"{x['rerank_alone_share_of_A']:.1%} |")
    lines += ["", "Pages: share of A's pages each variant also attends (mean over KV heads): " +
              ", ".join(f"{k} {v:.0%}" for k, v in r["overlap_with_A"].items()) + "."]
    lines += ["", "## The bytes-moved ideal (a memory-bound GPU step)", "",
              "Per step (8 KV heads, batch 1): the sparse step reads every page's box and K and V of the budget's "
              "pages (DESIGN.md §1, plus the queries and outputs); the re-rank adds the candidates' 4-bit codes "
              "(`C·S·D/2` bytes per KV head), their boxes again (`2·C·D·e_box`: an upper count, the scoring pass has "
              "just read them) and the last page's exact keys (`S·D·e`). Extra / sparse is the ratio a step at the "
              "bandwidth limit would show.", "",
              "| pool | sparse step MiB | dense MiB | dense / sparse | C | codes KiB | boxes KiB | last page KiB "
              "| codes / sparse | (codes + boxes) / sparse | all / sparse |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for dt, x in r["ideal"].items():
        for c in x["rerank"]:
            lines.append(f"| {dt} | {x['sparse_bytes'] / 2**20:.2f} | {x['dense_bytes'] / 2**20:.1f} | "
                         f"{x['dense_over_sparse']:.2f} | {c['candidates']} | {c['codes_bytes'] / 2**10:.0f} | "
                         f"{c['boxes_bytes'] / 2**10:.0f} | {c['last_page_bytes'] / 2**10:.0f} | "
                         f"{c['extra_codes_only']:.1%} | {c['extra_codes_boxes']:.1%} | {c['extra_all']:.1%} |")
    if r["rerank_profile"]:
        lines += ["", f"## Where `rerank_scores` ({c_narrow} candidates, torch) spends its time", "",
                  "One torch.profiler run of 5 calls, ops by self CPU time (per call; the profiler's own overhead "
                  "included):", "", "| op | self ms / call | share | calls / call |", "|---|---:|---:|---:|"]
        lines += [f"| `{p['op']}` | {p['self_ms_per_call']:.2f} | {p['share']:.0%} | {p['calls_per_call']:g} |"
                  for p in r["rerank_profile"]]
    lines += ["", "Notes:", "",
              "- B2's attention reads as many rows as B: the torch plan keeps the capacity's shape and masks the pages "
              "top-p drops (fixed shapes); its time differs from B's by the top-p rule only.",
              "- D takes the torch plan's contiguous-run route (the cache hands out pages in order; SDPA on pool "
              "views, no gather): a shuffled pool would be slower.",
              "- torch.compile does not apply: the re-ranked selection runs eagerly only (`PagedAttentionPlan.run` "
              "raises NotImplementedError while torch.compile traces with rerank), and the project compiles no CPU "
              "path of its own.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
