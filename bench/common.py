"""Shared helpers of the benchmark scripts: problems, timing, the bytes-moved model, CSV and plots.

Timing (DESIGN.md §6: ratios against a baseline measured in the same run):

- CUDA: ``triton.testing.do_bench`` (it flushes the L2 cache before each call and returns the median).
- CPU: ``time.perf_counter_ns`` around each call after a warm-up, **interleaved**: every repeat calls each
  method once, in turn, so that a slow spell of the machine hits all methods alike; the median of the
  repeats is reported (and the minimum kept in the CSV). ``torch.set_num_threads`` is set by each script
  (2 by default, the machine's cores). ``cold=True`` also overwrites a buffer larger than the last-level
  cache before each call (what ``do_bench`` does on a GPU).

Bytes moved per decode step (DESIGN.md §1, per KV head, page size ``S``, context ``L``, budget ``K`` pages):
``dense = 2·L·D·e`` and ``sparse = 2·⌈L/S⌉·D·e_box + 2·min(K·S, L)·D·e`` (page boxes ``k_min``/``k_max``
of every page, then K and V of the selected pages), times ``B·Hkv``, plus the queries and outputs ``2·B·Hq·D·e``.
The ideal speedup of a memory-bound step is ``dense / sparse``; efficiency = measured speedup / ideal.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "out" / "bench"     # scratch (git-ignored); the committed figures: --out docs/bench
#: sparse-decode recipes of the SmolLM2 benches (docs/smollm2.md): name -> the SparsityConfig fields besides the budget
#: and the policy. Quest keeps its first two layers dense; StreamingLLM shows why the first tokens matter; recent
#: pages guarantee the newest tokens (with one, the page being written may hold a single token)
RECIPES = {name: dict(num_sink_pages=s, dense_layers=d, num_recent_pages=r) for name, (s, d, r) in {
    "default": (0, 0, 1), "sink1": (1, 0, 1), "dense2": (0, 2, 1), "sink1_dense2": (1, 2, 1),
    "sink1_recent2": (1, 0, 2), "sink1_recent4": (1, 0, 4), "sink1_dense2_recent2": (1, 2, 2)}.items()}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

if str(ROOT) not in sys.path:           # run as `python bench/x.py` from a checkout without installing
    sys.path.insert(0, str(ROOT))


# ---------------------------------------------------------------------------- policy labels
#: keys of a label that are settings of the fused quest selection (tinyattn.SparsityConfig's gamma / top_p / rerank /
#: candidates), not constructor arguments of its policy (questmass:gamma=... stays questmass's own constructor argument)
SELECTION_KEYS = ("gamma", "top_p", "rerank", "candidates")
#: ``gamma`` of a bare ``quest`` label: Quest's upper bound (Quest §3.2), not tinyattn.layer.DEFAULT_GAMMA
QUEST_GAMMA = 1.0


def _label_parts(label: str) -> tuple[str, dict, dict]:
    """``name`` or ``name:key=value:...`` -> ``(name, policy kwargs, selection settings)``; values parsed as JSON
    where they parse; ``gamma`` / ``top_p`` / ``rerank`` / ``candidates`` of a fused policy (quest) go to the
    selection settings. ``ValueError`` for ``candidates`` without ``rerank`` (the label would name a re-rank that
    does not run)."""
    from tinyattn.selection import get_policy

    name, *pairs = label.split(":")
    fused = get_policy(name).fused                     # the name's check and message
    kwargs, selection = {}, {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        try:
            value = json.loads(value)
        except ValueError:
            pass
        (selection if fused and key in SELECTION_KEYS else kwargs)[key] = value
    if fused:
        # a label names its selection whatever the library's default: ``quest`` is Quest's bound (gamma = 1), as in
        # every committed result, and the recipe's default box estimate is ``quest:gamma=0.25``
        selection.setdefault("gamma", QUEST_GAMMA)
        if "candidates" in selection and selection.get("rerank") is None:
            raise ValueError(f"policy label {label!r}: candidates is the re-rank's (a multiple of the page budget); "
                             f"add rerank=int4 (e.g. quest:gamma=0.25:rerank=int4:candidates=2)")
    return name, kwargs, selection


def policy_from_label(label: str):
    """A fresh policy from ``name`` or ``name:key=value:...`` (values parsed as JSON where they parse); the
    selection settings of :func:`selection_from_label` are not its constructor's."""
    from tinyattn.selection import POLICIES, get_policy

    name, kwargs, _ = _label_parts(label)
    if not kwargs:
        return get_policy(name)
    return POLICIES[name.strip().lower()](**kwargs)


def selection_from_label(label: str) -> dict:
    """``{"gamma": ..., "top_p": ..., "rerank": ..., "candidates": ...}`` (the keys the label sets) of a quest label
    (``quest:gamma=0.25:top_p=0.9``, ``quest:gamma=0.25:top_p=0.8:rerank=int4``,
    ``quest:gamma=0.25:rerank=int4:candidates=2``), for :class:`tinyattn.layer.SparsityConfig`: a bare ``quest``
    gives ``{"gamma": 1.0}`` (Quest's bound); ``{}`` for a policy other than quest."""
    return _label_parts(label)[2]


def needs_key_codes(labels) -> bool:
    """Whether any of the policy ``labels`` asks for the re-ranked selection (``...:rerank=int4``): the KV cache must
    then keep 4-bit key codes (``model.new_cache(..., key_codes=True)``; only then: ``D/2`` bytes per key and head
    more). Labels that name no policy of :data:`tinyattn.selection.POLICIES` (the benches' ``dense``, ``hf_stock``)
    ask for nothing."""
    from tinyattn.selection import POLICIES

    return any(label.split(":")[0].strip().lower() in POLICIES
               and selection_from_label(label).get("rerank") is not None for label in labels)


# ---------------------------------------------------------------------------- tokens attended
class AttendedCounter:
    """Pages and tokens each sparse (row, KV head, layer, step) attended, summed per sequence id."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.pages = defaultdict(float)
        self.tokens = defaultdict(float)
        self.count = defaultdict(int)

    def wrap(self, policy):
        """Count the pages ``policy.select`` returns (an instance attribute shadows the method)."""
        select = policy.select

        def counted(ctx):
            idx = select(ctx)
            valid = idx >= 0
            start = idx.clamp(min=0).long() * self.page_size
            lens = ctx.seq_lens.to(idx.device).long()[:, None, None]
            ntok = (lens - start).clamp(0, self.page_size) * valid
            for row, sid in enumerate(ctx.rows().tolist()):
                self.pages[sid] += float(valid[row].sum())
                self.tokens[sid] += float(ntok[row].sum())
                self.count[sid] += idx.shape[1]
            return idx

        policy.select = counted
        return policy

    def plan_counter(self, attention):
        """A ``PagedAttention.attended`` hook for the fused path (Quest with ``top_p``): each sparse layer's pages as
        the plan kept them (``-1`` / past the row's end not attended), per row of ``attention.seq_ids``."""
        from tinyattn import metrics

        counter = self

        class PerRow:
            def add(self, page_indices, seq_lens, page_size, num_kv_heads, width):
                lens = seq_lens.long()
                if page_indices is None:                  # a step that did not select: every valid page
                    pages = metrics.num_pages(lens, page_size)[:, None].expand(-1, num_kv_heads)
                    tokens = lens[:, None].expand(-1, num_kv_heads)
                else:
                    pages, tokens = metrics.selection_reads(page_indices, lens, page_size)      # [B, Hkv]
                for row, sid in enumerate(attention.seq_ids):
                    counter.pages[sid] += float(pages[row].sum())
                    counter.tokens[sid] += float(tokens[row].sum())
                    counter.count[sid] += num_kv_heads

        return PerRow()

    def mean(self, sid: int) -> tuple[float | None, float | None]:
        n = self.count.get(sid, 0)
        return (self.pages[sid] / n, self.tokens[sid] / n) if n else (None, None)

    def hook(self, attention) -> bool:
        """Count what ``attention`` (a :class:`tinyattn.layer.PagedAttention`) attends at its sparse decode steps,
        as the RULER bench does; returns whether this counter counts it (then :meth:`mean` per sequence), False
        where :func:`analytic_attended` gives the count (dense, and Quest's fused path with a fixed budget, which
        keeps ``min(page_budget, valid pages)`` at every step; re-ranked or not). A policy other than Quest's
        fused selection has its ``select`` wrapped (:meth:`wrap`); the fused path with ``top_p`` gets
        :meth:`plan_counter` as ``attention.attended``."""
        s = attention.sparsity
        if s.page_budget is None:
            return False
        if not s.policy.fused:
            self.wrap(s.policy)
            return True
        if s.top_p is not None:                 # top_p keeps a varying count: count the plan's selections
            attention.attended = self.plan_counter(attention)
            return True
        return False


def analytic_attended(prompt_len: int, steps: int, page_size: int, page_budget: int | None):
    """Mean pages / tokens per (KV head, layer, step) of ``steps`` decode steps after a ``prompt_len`` prefill
    when every step keeps ``min(page_budget, valid pages)`` pages, the partial last page among them (the forced
    recent page): dense, and Quest's fused path (whose selection the policy hook does not see)."""
    if steps <= 0:
        return None, None
    pages = tokens = 0.0
    for t in range(1, steps + 1):
        n = prompt_len + t
        valid = -(-n // page_size)
        k = valid if page_budget is None else min(page_budget, valid)
        pages += k
        tokens += n if k == valid else (k - 1) * page_size + (n - (valid - 1) * page_size)
    return pages / steps, tokens / steps


def attended_means(counter: AttendedCounter, counted: bool, sid: int, *, prompt_len: int, steps: int,
                   page_budget: int | None) -> tuple[float | None, float | None]:
    """Mean pages and tokens attended per (KV head, sparse layer, decode step) of sequence ``sid``: the counter's
    when it counted (``counted``, :meth:`AttendedCounter.hook`'s answer), else :func:`analytic_attended` of the
    ``steps`` decode steps after ``prompt_len`` tokens under ``page_budget`` (``None``: dense)."""
    if counted:
        return counter.mean(sid)
    return analytic_attended(prompt_len, steps, counter.page_size, page_budget)


# ---------------------------------------------------------------------------- machine
def machine_name(device: str = "cpu") -> str:
    """The processor or GPU in words, with core / thread counts and the torch version."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} (torch {torch.__version__}, CUDA {torch.version.cuda})"
    name = platform.processor() or "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        load = f", load average {os.getloadavg()[0]:.2f}"      # other tenants' work shows here: compare runs
    except OSError:
        load = ""
    return f"{name}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads{load} (torch {torch.__version__})"


def base_parser(description: str, default_name: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu); cuda runs the Triton kernels")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="K/V and query dtype (default: fp32 on cpu, bf16 on cuda)")
    p.add_argument("--threads", type=int, default=2, help="torch threads on cpu (default: 2)")
    p.add_argument("--repeats", type=int, default=None, help="timed calls per method (default: per script)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls per method first (default: 2)")
    p.add_argument("--cold", action="store_true",
                   help="cpu: evict the caches before each timed call (cuda always does, via do_bench)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help="output folder (default: out/bench/ of the checkout, git-ignored scratch; --out docs/bench "
                        "replaces the figures docs/benchmarks.md shows)")
    p.add_argument("--name", default=default_name, help=f"file stem of the CSV / PNG (default: {default_name})")
    p.add_argument("--no-plot", action="store_true", help="write the CSV only")
    p.add_argument("--quick", action="store_true", help="tiny sizes, a few repeats: proves the script runs")
    p.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                   help="cpu: before each measurement wait up to SECONDS for the machine to be idle (other "
                        "processes share the cores on a shared VM; default: do not wait)")
    return p


def script_parser(description: str, default_name: str, contexts_help: str) -> argparse.ArgumentParser:
    """:func:`base_parser` plus the ``--contexts`` option every context sweep has."""
    p = base_parser(description, default_name)
    p.add_argument("--contexts", type=parse_sizes, default=None, help=contexts_help)
    return p


def add_head_args(p: argparse.ArgumentParser) -> None:
    """The attention problem's shape options: batch, query / KV heads, head_dim and page size."""
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--num-q-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)


def quick_heads(args) -> None:
    """``--quick`` for the attention scripts: a tiny head shape, 3 repeats unless given, 1 warm-up call."""
    args.num_q_heads, args.num_kv_heads, args.head_dim = 8, 2, 64
    args.repeats = args.repeats or 3
    args.warmup = 1


def default_repeats(args) -> None:
    args.repeats = args.repeats or (10 if args.device == "cpu" else 100)


def _cpu_times():
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return sum(fields), fields[3] + fields[4]            # total, idle + iowait


def wait_quiet(max_wait: float, *, idle: float = 0.9, window: float = 1.0) -> float:
    """Wait (up to ``max_wait`` s) for a ``window`` in which the CPUs are at least ``idle`` idle; returns the
    idle share of the last window (1.0 when not on Linux or ``max_wait`` is 0)."""
    if max_wait <= 0 or not os.path.exists("/proc/stat"):
        return 1.0
    deadline = time.monotonic() + max_wait
    share = 0.0
    while True:
        t0, i0 = _cpu_times()
        time.sleep(window)
        t1, i1 = _cpu_times()
        share = (i1 - i0) / max(t1 - t0, 1)
        if share >= idle or time.monotonic() > deadline:
            if share < idle:
                print(f"note: machine still busy after {max_wait:.0f}s ({1 - share:.0%} of the CPUs used by others)")
            return share


def setup(args) -> torch.device:
    """Check the device, set threads and the default dtype; returns the device."""
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: CUDA is not available on this machine")
    if args.device.startswith("cuda") and os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("--device cuda with TRITON_INTERPRET=1 set: unset it to time the compiled kernels")
    torch.set_num_threads(args.threads)
    args.backend = "triton" if args.device.startswith("cuda") else "torch"   # CPU: the torch backend, always
    if args.dtype is None:
        args.dtype = "bf16" if args.device.startswith("cuda") else "fp32"
    args.out.mkdir(parents=True, exist_ok=True)
    return torch.device(args.device)


# ---------------------------------------------------------------------------- problems
@dataclass
class DecodeProblem:
    """One decode step over ``B`` rows of ``L`` tokens, in both layouts (paged and contiguous, same values)."""

    q: torch.Tensor            # [B, Hq, D]
    k_cache: torch.Tensor      # [num_pages, S, Hkv, D] (pages shuffled)
    v_cache: torch.Tensor
    block_table: torch.Tensor  # [B, P] int32
    seq_lens: torch.Tensor     # [B] int32
    k_min: torch.Tensor        # [num_pages, Hkv, D]
    k_max: torch.Tensor
    k_dense: torch.Tensor      # [B, Hkv, L, D] contiguous (the SDPA baseline's cache)
    v_dense: torch.Tensor
    page_size: int

    @property
    def shape(self):
        B, Hq, D = self.q.shape
        return B, Hq, self.k_cache.shape[2], D, int(self.seq_lens[0])


def make_decode_problem(*, batch: int, context: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                        page_size: int, dtype: torch.dtype, device: torch.device, seed: int = 0,
                        dense_copy: bool = True, backend: str | None = None) -> DecodeProblem:
    """Random keys/values in a shuffled page pool (``randperm`` block tables), exact page boxes."""
    import tinyattn

    g = torch.Generator(device="cpu").manual_seed(seed)
    P = -(-context // page_size)
    num_pages = batch * P
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_cache = torch.empty(shape, dtype=dtype, device=device)
    v_cache = torch.empty(shape, dtype=dtype, device=device)
    for t in (k_cache, v_cache):       # chunked so that fp32 temporaries stay small
        flat = t.view(num_pages, -1)
        for i in range(0, num_pages, 4096):
            flat[i:i + 4096] = torch.randn(flat[i:i + 4096].shape, generator=g).to(device=device, dtype=dtype)
    block_table = torch.randperm(num_pages, generator=g).view(batch, P).to(torch.int32).to(device)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, num_q_heads, head_dim, generator=g).to(device=device, dtype=dtype)
    box = (num_pages, num_kv_heads, head_dim)
    k_min = torch.empty(box, dtype=dtype, device=device)
    k_max = torch.empty(box, dtype=dtype, device=device)
    with tinyattn.value_checks(False):
        tinyattn.update_page_metadata(k_cache, block_table, seq_lens, k_min, k_max, backend=backend)
    k_dense = v_dense = None
    if dense_copy:
        idx = block_table.long()                                                # [B, P]
        k_dense = k_cache[idx].flatten(1, 2)[:, :context].permute(0, 2, 1, 3).contiguous()   # [B, Hkv, L, D]
        v_dense = v_cache[idx].flatten(1, 2)[:, :context].permute(0, 2, 1, 3).contiguous()
    return DecodeProblem(q, k_cache, v_cache, block_table, seq_lens, k_min, k_max, k_dense, v_dense, page_size)


# ---------------------------------------------------------------------------- bytes model
def decode_bytes(*, batch: int, context: int, num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                 elem: int, budget_tokens: int | None = None, box_elem: int | None = None) -> int:
    """Bytes a decode step must read (DESIGN.md §1, :mod:`tinyattn.metrics`): dense when ``budget_tokens`` is
    None, else sparse with a budget of ``budget_tokens // page_size`` pages; plus the queries and outputs."""
    from tinyattn import metrics

    budget = None if budget_tokens is None else max(budget_tokens // page_size, 1)
    per_head = metrics.sparse_bytes(context, head_dim, page_size, budget, elem, box_elem)
    return batch * num_kv_heads * per_head + metrics.io_bytes(batch, num_q_heads, head_dim, elem)


# ---------------------------------------------------------------------------- timing
_FLUSH: torch.Tensor | None = None


def _flush_cpu():
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty(512 * 2**20 // 4)
    _FLUSH.fill_(1.0)


def time_methods(methods: dict, *, device: torch.device, repeats: int, warmup: int = 2,
                 cold: bool = False) -> dict[str, dict]:
    """Time each zero-argument callable of ``methods``; returns ``{name: {"median_us", "min_us", "runs"}}``.

    CUDA: ``triton.testing.do_bench`` per method (median, L2 flushed). CPU: interleaved repeats (see module doc).
    """
    results: dict[str, dict] = {}
    if device.type == "cuda":
        import triton.testing

        for name, fn in methods.items():
            ms = triton.testing.do_bench(fn, warmup=25, rep=max(50, repeats * 2), return_mode="median")
            results[name] = {"median_us": ms * 1e3, "min_us": float("nan"), "runs": repeats}
        return results
    for fn in methods.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(repeats):
        for name, fn in methods.items():
            if cold:
                _flush_cpu()
            t0 = time.perf_counter_ns()
            fn()
            samples[name].append((time.perf_counter_ns() - t0) / 1e3)
    for name, s in samples.items():
        results[name] = {"median_us": statistics.median(s), "min_us": min(s), "runs": len(s)}
    return results


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------- output
def write_csv(path: Path, rows: list[dict]) -> None:
    if not rows:
        return
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})
    print(f"wrote {path}")


def pyplot():
    """matplotlib.pyplot with the Agg backend, or None (plots are skipped) when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        print('matplotlib is not installed: skipping the plot (pip install -e ".[plots]")')
        return None


def new_figure(rows: list[dict], *args, **kwargs):
    """``(plt, fig, axes)`` of ``plt.subplots(*args, **kwargs)``, or None (no plot) without matplotlib or rows."""
    plt = pyplot()
    if plt is None or not rows:
        return None
    fig, axes = plt.subplots(*args, **kwargs)
    return plt, fig, axes


def context_axis(ax, contexts) -> None:
    """A log2 x axis of contexts, ticked at each context (``1K``, ``2K``, ...)."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(contexts, [fmt_tokens(c) for c in contexts])
    ax.set_xlabel("context (tokens)")


def shape_title(args) -> str:
    """The machine, dtype and attention shape of a run, for a figure's title."""
    return (f"{machine_name(args.device)} - {args.dtype}, B={args.batch}, Hq={args.num_q_heads}, "
            f"Hkv={args.num_kv_heads}, D={args.head_dim}")


def save_figure(plt, fig, path: Path, title: str, fontsize: float) -> None:
    fig.suptitle(title, fontsize=fontsize)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def print_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """Rows as a Markdown table; ``columns`` = (key, header, format spec). Printed and returned."""
    head = "| " + " | ".join(h for _, h, _ in columns) + " |"
    sep = "|" + "|".join("---:" if f else "---" for _, _, f in columns) + "|"
    lines = [head, sep]
    for r in rows:
        cells = []
        for key, _, fmt in columns:
            v = r.get(key, "")
            if isinstance(v, float) and math.isnan(v):
                cells.append("-")
            elif fmt and isinstance(v, (int, float)):
                cells.append(format(v, fmt))
            else:
                cells.append(str(v))
        lines.append("| " + " | ".join(cells) + " |")
    text = "\n".join(lines)
    print(text)
    return text


def fmt_tokens(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def parse_sizes(text: str) -> list[int]:
    """``"1K,2K,32768"`` -> ``[1024, 2048, 32768]``."""
    out = []
    for item in text.split(","):
        item = item.strip().upper()
        if not item:
            continue
        mult = 1024 if item.endswith("K") else 1
        out.append(int(item.rstrip("K")) * mult)
    return out


def run_main(argv, parse_args, run, plot, columns: list[tuple[str, str, str]]) -> int:
    """A bench script's ``main``: parse, run, write ``<name>.csv`` (and ``<name>.png``), print the table."""
    args = parse_args(argv)
    rows = run(args)
    write_csv(args.out / f"{args.name}.csv", rows)
    if not args.no_plot:
        plot(rows, args, args.out / f"{args.name}.png")
    print()
    print_table(rows, columns)
    return 0
