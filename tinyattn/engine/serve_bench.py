"""``python -m tinyattn serve-bench``: a stream of requests through the engine; TTFT, TPOT, throughput.

The command's help (:data:`DESCRIPTION`) says what it measures; docs/engine.md shows the results.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..layer import DEFAULT_GAMMA, quest_settings

__all__ = ["add_arguments", "run", "BenchRow", "FIELDS", "parse_config", "make_workload", "bench_config"]

POLICY_NAMES = ("quest", "questmass", "meanstd", "oracle", "streaming", "h2o", "random")
MODIFIERS = ("exit", "approx")
FIELDS = ("config", "completed", "num_requests", "duration_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms",
          "tpot_p99_ms", "output_throughput_tok_s", "output_tokens", "peak_kv_pages", "num_pages", "preemptions",
          "mean_decode_batch", "steps", "layers_skipped_per_token", "nll")

DESCRIPTION = """Requests arrive as a Poisson process at --request-rate (exponential gaps, seeded; inf = all at once);
request i's prompt is the start of story i of the text (BOS + a length drawn in
[prompt_len / 2, prompt_len]), and its output length is drawn from --output-len-dist. Each engine
configuration (--configs) serves the same stream with the same KV pool (--num-pages), wall
clock in real time: a request's TTFT counts its wait in the queue. Per configuration:

- completed: requests finished (all of them, or the run is a failure);
- ttft_p50_ms, ttft_p99_ms: time to first token (arrival to first token);
- tpot_p50_ms, tpot_p99_ms: time per output token after the first, per request;
- output_throughput_tok_s: output tokens / (last finish - first arrival);
- peak_kv_pages of num_pages, preemptions, mean_decode_batch;
- layers_skipped_per_token (early exit), and nll: teacher-forced NLL of the same configuration on the
  text (tinyattn.engine.teacher_forced_nll), the quality it pays for its speed.

Configurations are BASE[+exit][+approx]: BASE dense or a policy (quest, h2o, ...) at
--page-budget; +exit adds EarlyExit, +approx
ApproximateAttention (dense first and last layers, a tapered budget between).
"""

EPILOG = """examples:
  python -m tinyattn serve-bench                         # dense, quest, quest+exit; the shipped model and text
  python -m tinyattn serve-bench --request-rate 20 --num-requests 64 --num-pages 48 \\
      --configs dense,quest,quest+exit,quest+approx,h2o,streaming \\
      --json out/serve.json --csv out/serve.csv --plot out/serve.png
"""


def parse_config(text: str) -> tuple[str, tuple[str, ...]]:
    """``"quest+exit"`` -> ``("quest", ("exit",))``; raises ``argparse.ArgumentTypeError`` naming the choices."""
    parts = [p.strip().lower() for p in text.split("+")]
    base, mods = parts[0], tuple(parts[1:])
    if base not in ("dense",) + POLICY_NAMES or any(m not in MODIFIERS for m in mods) or len(set(mods)) != len(mods):
        raise argparse.ArgumentTypeError(
            f"expected BASE[+exit][+approx] with BASE one of dense, {', '.join(POLICY_NAMES)}, got {text!r}")
    return base, mods


def _config_list(text: str) -> list[str]:
    items = [t.strip().lower() for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of configurations, got {text!r}")
    for t in items:
        parse_config(t)
    return list(dict.fromkeys(items))


def _rate(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected requests per second > 0 or inf, got {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"expected requests per second > 0 or inf, got {text}")
    return v


def add_arguments(p: argparse.ArgumentParser) -> None:
    from tinyattn.argtypes import add_selection_options, non_negative_float, non_negative_int, positive_int

    g = p.add_argument_group("workload")
    g.add_argument("--data", type=Path, default=None,
                   help="text file the prompts come from (stories split on <|endoftext|> or blank lines); default: "
                        "the TinyStories stories shipped with tinyattn (tinyattn/data/tinystories_sample.txt)")
    g.add_argument("--num-requests", type=positive_int, default=32, metavar="N", help="requests sent (default: 32)")
    g.add_argument("--request-rate", type=_rate, default=10.0, metavar="R",
                   help="mean arrivals per second of a Poisson process; inf = all at time 0 (default: 10)")
    g.add_argument("--prompt-len", type=positive_int, default=48, metavar="N",
                   help="longest prompt in tokens, BOS included: request i's prompt is the first L tokens of "
                        "story i, L drawn uniformly in [N/2, N] (shorter if the story is) (default: 48)")
    g.add_argument("--output-len", type=positive_int, default=64, metavar="N",
                   help="mean output length in tokens (default: 64)")
    g.add_argument("--output-len-dist", choices=("fixed", "uniform", "exponential"), default="uniform",
                   help="output lengths: fixed = N; uniform in [N/2, 3N/2]; exponential with mean N, clipped to "
                        "[1, 4N] (default: uniform)")
    g.add_argument("--temperature", type=non_negative_float, default=0.0,
                   help="sampling temperature, 0 = greedy; request i is seeded with --seed + i (default: 0)")
    g.add_argument("--stop-at-eos", action="store_true",
                   help="end a request at EOS or BOS (a new story) instead of generating its drawn length")
    g.add_argument("--seed", type=int, default=0, help="seed of arrivals, lengths and sampling (default: 0)")
    g = p.add_argument_group("engine (the same for every configuration)")
    g.add_argument("--configs", type=_config_list, default=["dense", "quest", "quest+exit"], metavar="C1,C2,...",
                   help="configurations to compare, each BASE[+exit][+approx]: BASE = dense or a selection policy "
                        f"({', '.join(POLICY_NAMES)}) at --page-budget; +exit = entropy early exit (--exit-threshold); "
                        "+approx = dense first/last layers and a page budget tapering to 2 between "
                        "(default: dense,quest,quest+exit)")
    g.add_argument("--page-size", type=positive_int, default=16, help="tokens per KV page (default: 16)")
    g.add_argument("--num-pages", type=positive_int, default=64, metavar="N",
                   help="pages in the KV pool, the KV memory of every configuration; fewer pages = more "
                        "preemptions (default: 64)")
    from tinyattn.ops.quant import KV_CACHE_DTYPES

    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="KV pool storage format (vLLM's option): auto = the model dtype, fp16, bf16, or int8 / "
                        "fp8_e4m3 with one fp32 scale per (page, KV head): the same --num-pages then holds the "
                        "same tokens in fewer bytes (default: auto)")
    g.add_argument("--page-budget", type=positive_int, default=4, metavar="K",
                   help="pages attended per sequence and KV head at each decode step by the sparse "
                        "configurations (default: 4)")
    add_selection_options(g)            # --gamma, --top-p: the quest configurations' selection
    g.add_argument("--num-sink-pages", type=non_negative_int, default=0, help="leading pages always kept (default: 0)")
    g.add_argument("--num-recent-pages", type=non_negative_int, default=1,
                   help="trailing pages always kept (default: 1)")
    g.add_argument("--dense-layers", type=non_negative_int, default=0,
                   help="leading layers dense during decode in the sparse configurations (default: 0)")
    g.add_argument("--max-num-batched-tokens", type=positive_int, default=256, metavar="N",
                   help="tokens per engine step, decode and prefill chunks together (default: 256)")
    g.add_argument("--max-num-seqs", type=positive_int, default=64, metavar="N",
                   help="requests running at once (default: 64)")
    g.add_argument("--recompute", choices=("replay", "prefill"), default="replay",
                   help="how a preempted request is rebuilt: replay = prompt by prefill then its tokens by decode "
                        "(exact); prefill = all by prefill (vLLM's way, faster) (default: replay)")
    g.add_argument("--exit-threshold", type=non_negative_float, default=0.25, metavar="H",
                   help="+exit: a token stops at a layer whose prediction has entropy below H nats (default: 0.25)")
    g.add_argument("--exit-min-layer", type=non_negative_int, default=None, metavar="L",
                   help="+exit: first layer a token may stop after (default: 3/4 of the depth, layer 3 of "
                        "stories260K's 5; earlier exits cost much NLL with an untrained exit head)")
    g.add_argument("--backend", choices=["torch", "triton"], default=None,
                   help="attention backend (default: by device: triton on CUDA, torch on CPU)")
    g.add_argument("--cuda-graphs", action="store_true",
                   help="replay decode forwards as CUDA graphs per batch-size bucket (Engine(cuda_graphs=True)); "
                        "steps with early exit or per-layer plug-ins run eagerly; off CUDA one warning, eager")
    g = p.add_argument_group("output")
    g.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the rows (and the settings) as JSON")
    g.add_argument("--csv", type=Path, default=None, metavar="PATH", help="write the rows as CSV")
    g.add_argument("--plot", type=Path, default=None, metavar="PATH",
                   help="write a PNG: TTFT, TPOT (p50 and p99), throughput and NLL per configuration")
    g.add_argument("--nll-stories", type=non_negative_int, default=4, metavar="N",
                   help="stories of the text the nll column is measured on, teacher-forced through each "
                        "configuration; 0 = skip (default: 4)")
    g.add_argument("--nll-context", type=positive_int, default=256, metavar="N",
                   help="tokens per story for the nll column, BOS included (default: 256)")
    g.add_argument("--no-warmup", action="store_true",
                   help="skip the short untimed run that precedes each configuration")
    g.add_argument("--no-progress", action="store_true", help="hide the progress bar")


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]
    arrivals: list[float]          # seconds after the start


def make_workload(stories_tokens: list[list[int]], *, num_requests: int, request_rate: float, prompt_len: int,
                  output_len: int, output_len_dist: str, seed: int) -> Workload:
    """Prompts, output lengths and arrival times (seconds from the start), all drawn from ``seed``."""
    import random

    rng = random.Random(seed)
    prompts, outs, arrivals, t = [], [], [], 0.0
    for i in range(num_requests):
        story = stories_tokens[i % len(stories_tokens)]
        n = rng.randint(max(1, prompt_len // 2), prompt_len)
        prompts.append(story[:max(1, min(n, len(story)))])
        if output_len_dist == "fixed":
            m = output_len
        elif output_len_dist == "uniform":
            m = rng.randint(max(1, output_len // 2), max(1, output_len * 3 // 2))
        else:
            m = min(max(1, round(rng.expovariate(1.0 / output_len))), 4 * output_len)
        outs.append(m)
        if i and math.isfinite(request_rate):
            t += rng.expovariate(request_rate)
        arrivals.append(t)
    return Workload(prompts, outs, arrivals)


@dataclass
class BenchRow:
    config: str
    completed: int
    num_requests: int
    duration_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    output_throughput_tok_s: float
    output_tokens: int
    peak_kv_pages: int
    num_pages: int
    preemptions: int
    mean_decode_batch: float
    steps: int
    layers_skipped_per_token: float
    nll: float

    def as_dict(self) -> dict:
        return {f: getattr(self, f) for f in FIELDS}


def _percentile(values: list[float], q: float) -> float:
    vals = sorted(v for v in values if not math.isnan(v))
    if not vals:
        return math.nan
    pos = (len(vals) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)


def build_engine(model, config: str, args, num_pages: int | None = None):
    from .engine import Engine
    from .plugins import ApproximateAttention, EarlyExit

    base, mods = parse_config(config)
    plugins = []
    if "approx" in mods:
        plugins.append(ApproximateAttention(dense_first=1, dense_last=1, page_budgets="taper", min_budget=2))
    if "exit" in mods:
        plugins.append(EarlyExit(threshold=args.exit_threshold, min_layer=args.exit_min_layer))
    sparse = base != "dense"
    return Engine(model, page_size=args.page_size, num_pages=num_pages or args.num_pages,
                  page_budget=args.page_budget if sparse else None, num_sink_pages=args.num_sink_pages,
                  num_recent_pages=args.num_recent_pages, dense_layers=args.dense_layers if sparse else 0,
                  policy=base if sparse else "quest", backend=args.backend,
                  max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                  recompute=args.recompute, plugins=plugins, kv_cache_dtype=args.kv_cache_dtype,
                  cuda_graphs=getattr(args, "cuda_graphs", False), **_selection(base, args))


def _selection(base: str, args) -> dict:
    """``gamma`` / ``top_p`` of the quest configurations (:func:`tinyattn.layer.quest_settings`: the other policies,
    and dense, take none)."""
    if base == "dense":
        return {}
    return quest_settings(base, getattr(args, "gamma", DEFAULT_GAMMA), getattr(args, "top_p", None),
                          getattr(args, "rerank", None), getattr(args, "candidates", 1.0))


def bench_config(model, config: str, workload: Workload, args, *, stop_ids=(), eos_id=2, progress=True) -> BenchRow:
    """Serve ``workload`` with one configuration in real time; its row."""
    from tqdm.auto import tqdm

    from .params import SamplingParams

    engine = build_engine(model, config, args)
    engine.eos_token_id = eos_id
    params = [SamplingParams(n, temperature=args.temperature, seed=args.seed + i, ignore_eos=not args.stop_at_eos,
                             stop_token_ids=stop_ids if args.stop_at_eos else ())
              for i, n in enumerate(workload.output_lens)]
    for p, sp in zip(workload.prompts, params):       # refuse the whole run up front, not mid-way
        most = len(p) + sp.max_new_tokens - 1
        if -(-most // args.page_size) > args.num_pages:
            raise ValueError(f"--num-pages {args.num_pages}: a request of {len(p)} prompt tokens and "
                             f"{sp.max_new_tokens} output tokens needs {-(-most // args.page_size)} pages of "
                             f"{args.page_size} tokens; raise --num-pages or lower --prompt-len / --output-len")
    if not args.no_warmup:                            # untimed: first calls, allocator, plan buffers
        warm = build_engine(model, config, args)
        warm.generate(workload.prompts[:2], SamplingParams(4, ignore_eos=True))
    n = len(workload.prompts)
    outs = []
    bar = tqdm(total=n, desc=config, unit="req", disable=not progress, leave=False, file=sys.stderr)
    clock = engine.clock
    start = clock()
    with model.frozen_weights():                      # weights checked once per run, not per step
        _serve(engine, workload, params, outs, bar, clock, start, n)
    bar.close()
    end = max(o.finish_time for o in outs)
    s = engine.stats
    tokens = sum(len(o.tokens) for o in outs)
    nll = math.nan
    return BenchRow(config=config, completed=sum(o.finish_reason in ("stop", "length") for o in outs),
                    num_requests=n, duration_s=end - start,
                    ttft_p50_ms=_percentile([o.ttft * 1e3 for o in outs], 50),
                    ttft_p99_ms=_percentile([o.ttft * 1e3 for o in outs], 99),
                    tpot_p50_ms=_percentile([o.tpot * 1e3 for o in outs], 50),
                    tpot_p99_ms=_percentile([o.tpot * 1e3 for o in outs], 99),
                    output_throughput_tok_s=tokens / (end - start) if end > start else math.nan,
                    output_tokens=tokens, peak_kv_pages=s.peak_pages, num_pages=s.num_pages,
                    preemptions=s.preemptions, mean_decode_batch=s.mean_decode_batch, steps=s.steps,
                    layers_skipped_per_token=s.layers_skipped_per_token, nll=nll)


def _serve(engine, workload, params, outs: list, bar, clock, start: float, n: int) -> None:
    """Feed the requests at their arrival times and step the engine until all ``n`` finished (into ``outs``)."""
    nxt = 0
    while len(outs) < n:
        now = clock() - start
        while nxt < n and workload.arrivals[nxt] <= now:
            engine.add_request(workload.prompts[nxt], params[nxt], arrival_time=start + workload.arrivals[nxt])
            nxt += 1
        if engine.has_unfinished_requests():
            done = engine.step()
            outs.extend(done)
            bar.update(len(done))
        elif nxt < n:
            time.sleep(max(0.0, workload.arrivals[nxt] - (clock() - start)))


def config_nll(model, config: str, sequences, args) -> float:
    from .nll import teacher_forced_nll

    engine = build_engine(model, config, args, num_pages=1)     # its sparsity and plug-ins
    s = engine.sparsity
    return teacher_forced_nll(model, sequences, page_size=args.page_size, page_budget=s.page_budget,
                              num_sink_pages=s.num_sink_pages, num_recent_pages=s.num_recent_pages,
                              dense_layers=s.dense_layers, policy=s.policy.name, backend=args.backend,
                              plugins=engine.plugins, gamma=s.gamma, top_p=s.top_p, rerank=s.rerank,
                              candidates=s.candidates).nll


def format_table(rows: list[BenchRow]) -> str:
    head = ("config", "done", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "out tok/s", "peak pages",
            "preempt", "batch", "skip/tok", "NLL")
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        lines.append(" | ".join([
            r.config, f"{r.completed}/{r.num_requests}", f"{r.ttft_p50_ms:.1f} ms", f"{r.ttft_p99_ms:.1f} ms",
            f"{r.tpot_p50_ms:.2f} ms", f"{r.tpot_p99_ms:.2f} ms", f"{r.output_throughput_tok_s:.0f}",
            f"{r.peak_kv_pages}/{r.num_pages}", str(r.preemptions), f"{r.mean_decode_batch:.1f}",
            f"{r.layers_skipped_per_token:.2f}", "n/a" if math.isnan(r.nll) else f"{r.nll:.4f}"]))
    return "\n".join("| " + line + " |" for line in lines)


def plot(rows: list[BenchRow], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.config for r in rows]
    x = range(len(rows))
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.8))
    for ax, (label, keys) in zip(axes[:2], (("TTFT (ms)", ("ttft_p50_ms", "ttft_p99_ms")),
                                            ("TPOT (ms)", ("tpot_p50_ms", "tpot_p99_ms")))):
        for j, key in enumerate(keys):
            ax.bar([i + (j - 0.5) * 0.38 for i in x], [getattr(r, key) for r in rows], width=0.38,
                   label=key.split("_")[1])
        ax.set_title(label + (", log scale" if keys[0].startswith("ttft") else ""))
        if keys[0].startswith("ttft"):
            ax.set_yscale("log")            # queueing makes TTFT span orders of magnitude
        ax.legend()
    axes[2].bar(list(x), [r.output_throughput_tok_s for r in rows], color="tab:green")
    axes[2].set_title("output throughput (tokens/s)")
    axes[3].bar(list(x), [r.nll for r in rows], color="tab:purple")
    finite = [r.nll for r in rows if not math.isnan(r.nll)]
    if finite:
        axes[3].set_ylim(min(finite) * 0.97, max(finite) * 1.02)
    axes[3].set_title("teacher-forced NLL (nats/token)")
    for ax in axes:
        ax.set_xticks(list(x))
        ax.set_xticklabels(names, rotation=30, ha="right")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args) -> int:
    """The ``serve-bench`` command (after :func:`add_arguments`); ``args.model`` etc. as the CLI's."""
    import warnings

    from tinyattn import assets
    from tinyattn.models.loading import load_model
    from tinyattn.models import load_stories

    data = assets.resolve_file(args.data, "--data", assets.default_finetune_text_path)
    model, tok = load_model(args)
    stories = load_stories(data)
    if not stories:
        raise ValueError(f"--data: no stories in {data}")
    encoded = [tok.encode(s, bos=True) for s in stories]
    workload = make_workload(encoded, num_requests=args.num_requests, request_rate=args.request_rate,
                             prompt_len=args.prompt_len, output_len=args.output_len,
                             output_len_dist=args.output_len_dist, seed=args.seed)
    nll_seqs = [e[:args.nll_context] for e in encoded[:args.nll_stories] if len(e) >= 2]
    rows = []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="sequences reach")
        for config in args.configs:
            row = bench_config(model, config, workload, args, stop_ids=(tok.bos_id,), eos_id=tok.eos_id,
                               progress=not args.no_progress)
            if nll_seqs:
                row.nll = config_nll(model, config, nll_seqs, args)
            rows.append(row)
            print(f"{config}: {row.completed}/{row.num_requests} completed, output {row.output_throughput_tok_s:.0f} "
                  f"tok/s", file=sys.stderr)
    import torch

    settings = dict(data=str(data) if args.data is not None else data.name, num_requests=args.num_requests,
                    request_rate=args.request_rate, prompt_len=args.prompt_len, output_len=args.output_len,
                    output_len_dist=args.output_len_dist, temperature=args.temperature, seed=args.seed,
                    page_size=args.page_size, num_pages=args.num_pages, kv_cache_dtype=args.kv_cache_dtype,
                    page_budget=args.page_budget, gamma=args.gamma, top_p=args.top_p, rerank=args.rerank,
                    candidates=args.candidates,
                    num_sink_pages=args.num_sink_pages, num_recent_pages=args.num_recent_pages,
                    dense_layers=args.dense_layers, max_num_batched_tokens=args.max_num_batched_tokens,
                    max_num_seqs=args.max_num_seqs, recompute=args.recompute, exit_threshold=args.exit_threshold,
                    exit_min_layer=args.exit_min_layer, nll_stories=args.nll_stories, nll_context=args.nll_context,
                    threads=torch.get_num_threads(), cpus=os.cpu_count(), machine=_machine(),
                    torch=torch.__version__)
    rate = "all at once" if math.isinf(args.request_rate) else f"{args.request_rate:g} req/s"
    kv = "" if args.kv_cache_dtype == "auto" else f" ({args.kv_cache_dtype})"
    title = (f"serve-bench: {args.num_requests} requests, {rate}, {args.num_pages} pages of {args.page_size} tokens"
             f"{kv}, page_budget {args.page_budget}, gamma {args.gamma:g}"
             + ("" if args.top_p is None else f", top_p {args.top_p}")
             + ("" if args.rerank is None else f", rerank {args.rerank} (candidates {args.candidates:g})")
             + f"; {_device_words(model, torch.get_num_threads())}")
    print(title)
    print(format_table(rows))
    for path, write in ((args.json, _write_json), (args.csv, _write_csv)):
        if path is not None:
            write(path, rows, settings)
            print(f"wrote {path}", file=sys.stderr)
    if args.plot is not None:
        from ..results_io import have_matplotlib, no_plots_note

        if have_matplotlib():
            plot(rows, args.plot, title)
            print(f"wrote {args.plot}", file=sys.stderr)
        else:                                  # the plots extra is optional: the plot's data instead
            data = args.plot.with_suffix(".csv")
            if args.csv is None:
                _write_csv(data, rows, settings)
            print(no_plots_note(f"its data is in {args.csv or data}"), file=sys.stderr)
    incomplete = [r.config for r in rows if r.completed != r.num_requests]
    if incomplete:
        print(f"error: not every request completed in {', '.join(incomplete)}", file=sys.stderr)
        return 1
    return 0


def _device_words(model, threads: int) -> str:
    """Where the run ran, for the plot title: "2-core CPU, 1 thread" or the GPU's name."""
    import torch

    if model.device.type == "cuda":
        return torch.cuda.get_device_name(model.device)
    return f"{os.cpu_count()}-core CPU, {threads} thread{'s' if threads != 1 else ''}"


def _machine() -> str:
    """The CPU model, its core count and the load average when the run ended (other work shows there)."""
    import platform

    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    try:
        load = f", load average {os.getloadavg()[0]:.2f}"
    except OSError:
        load = ""
    return f"{name}, {os.cpu_count()} cores{load}"


def _write_json(path: Path, rows, settings) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(settings=settings, rows=[r.as_dict() for r in rows]), indent=2) + "\n")


def _write_csv(path: Path, rows, settings) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow(r.as_dict())
