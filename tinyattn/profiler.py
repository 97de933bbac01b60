"""Per-layer, per-op profiler of tinyattn: times, pages and bytes read, and selection quality.

Usage::

    import tinyattn.profiler as tp

    with tp.profile() as prof:                    # oracle=True: also hit rate and captured mass
        runtime.generate(prompts, max_new_tokens=64)
    print(prof.summary())                         # one table: per layer x op, then per layer quality
    prof.export_chrome_trace("trace.json")        # chrome://tracing or https://ui.perfetto.dev

What it records, for every call of a tinyattn op inside the block (the ``span`` hooks of
:mod:`tinyattn.ops.spans`):

- **time** of each phase, ``metadata`` (page bounding-box upkeep), ``score`` (page upper bounds), ``topk``
  (selection) and ``attention``, in microseconds: CUDA events on a GPU (resolved once, at the end), or
  ``time.perf_counter_ns`` on the CPU;
- **pages and bytes read** by the phase (K/V of the valid tokens of the pages attended, the page boxes
  scored, the keys folded into boxes), so that each op's effective GB/s can be read off;
- for sparse attention (a selection narrower than the row), the **page hit rate** against the oracle
  selection and the **attention mass captured** by the selection, as :class:`tinyattn.selection.SelectionMetrics`
  defines them (the one definition, also used by ``docs/accuracy.md``): the oracle keeps the same forced
  pages as the selection (recent / sink pages) and fills the budget with the pages of most true attention
  mass (summed over the query heads of the KV head's group); captured mass is the share of the full
  attention's softmax mass on the selected pages; only rows holding more pages than the budget count.
  These need a dense pass over each row: it runs after the span's clock has stopped and is not counted
  in any time.

The current layer comes from :func:`layer` (a runtime wraps each layer in ``with layer(i):``); ops
outside any layer are attributed to layer ``-1`` (shown as ``-``).

With ``torch_profiler=True`` the block also runs :class:`torch.profiler.profile` and opens a
``record_function`` range per span, so :meth:`Profile.export_chrome_trace` writes torch's trace: aten
ops and CUDA kernels nested under ``tinyattn.<op>[L<layer>]`` ranges. Otherwise the trace holds the
spans only (one track per layer).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from . import metrics as M
from .ops import spans as _spans
from .ops.attention.torch_impl import first_window_key

__all__ = ["profile", "layer", "cli_profile", "print_cli_report", "add_cli_option", "Profile", "SpanRecord",
           "LayerQuality", "oracle_quality"]

OPS = ("metadata", "score", "topk", "attention")


def layer(index: int):
    """Attribute the ops inside the block to model layer ``index``; a no-op when no profiler is active."""
    return _spans.layer(index)


@dataclass
class SpanRecord:
    """One timed phase of one op call."""

    op: str
    layer: int
    start_us: float              # from the start of the profile block
    duration_us: float
    pages: int = 0               # pages (x KV heads) whose data the phase read
    bytes: int = 0               # bytes the phase read (the DESIGN.md §1 model, valid tokens only)
    sparse: bool = False         # attention over a selection narrower than the row
    hit_rate: float | None = None
    captured_mass: float | None = None


@dataclass
class LayerQuality:
    """Selection quality of one layer, averaged over its sparse attention calls (page-weighted)."""

    calls: int = 0
    pages_selected: int = 0      # pages of the oracle's selections (= pages selected: both keep the budget)
    pages_hit: int = 0
    mass_sum: float = 0.0        # sum over (row, KV head) of captured mass
    mass_count: int = 0

    @property
    def hit_rate(self) -> float:
        return M.hit_rate(self.pages_hit, self.pages_selected)

    @property
    def captured_mass(self) -> float:
        return M.captured_mass(self.mass_sum, self.mass_count)


class _CpuClock:
    def __init__(self, origin_ns: int):
        self.origin_ns = origin_ns

    def start(self):
        return time.perf_counter_ns()

    def stop(self, token):
        return token, time.perf_counter_ns()

    def resolve(self, pair) -> tuple[float, float]:
        t0, t1 = pair
        return (t0 - self.origin_ns) / 1e3, (t1 - t0) / 1e3


class _CudaClock:
    """CUDA events on the current stream; a reference event at the block start gives start offsets."""

    def __init__(self, device):
        self.device = device
        self.origin = torch.cuda.Event(enable_timing=True)
        self.origin.record()

    def start(self):
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def stop(self, token):
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return token, ev

    def resolve(self, pair) -> tuple[float, float]:
        e0, e1 = pair
        return self.origin.elapsed_time(e0) * 1e3, e0.elapsed_time(e1) * 1e3


def _device_of(info) -> torch.device:
    for key in ("q", "k_cache", "scores", "k_min", "k_new"):
        t = info.get(key)
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cpu")


class Profile:
    """Records of one :func:`profile` block; see the module docstring. Read it after the block ends."""

    def __init__(self, *, oracle: bool = True, torch_profiler: bool = False, max_oracle_elements: int = 1 << 26):
        self.oracle = oracle
        self.max_oracle_elements = max_oracle_elements
        self.oracle_skipped = 0      # sparse calls too large for the dense oracle pass
        self.error: str | None = None
        self.records: list[SpanRecord] = []
        self.quality: dict[int, LayerQuality] = defaultdict(LayerQuality)
        self.device_name = "cpu"
        self._pending: list[tuple[SpanRecord, object, object]] = []   # (record, clock, raw times)
        self._layer = -1
        self._clocks: dict[str, object] = {}
        self._origin_ns = time.perf_counter_ns()
        self._torch_profiler_enabled = torch_profiler
        self._torch_prof = None
        self._wall_s = 0.0

    # ---- hooks called by tinyattn.ops.spans ------------------------------------------------------------
    @contextlib.contextmanager
    def layer(self, index: int):
        previous, self._layer = self._layer, int(index)
        try:
            yield
        finally:
            self._layer = previous

    @contextlib.contextmanager
    def span(self, name: str, **info):
        clock = self._clock(_device_of(info))
        label = f"tinyattn.{name}[L{self._layer}]" if self._layer >= 0 else f"tinyattn.{name}"
        rf = torch.profiler.record_function(label) if self._torch_prof is not None else contextlib.nullcontext()
        with rf:
            token = clock.start()
            try:
                yield
            finally:
                raw = clock.stop(token)
        record = SpanRecord(op=name, layer=self._layer, start_us=0.0, duration_us=0.0)
        self._pending.append((record, clock, raw))
        self.records.append(record)
        # counting (and the oracle pass) runs after the clock stopped: never inside a timed span, and the
        # oracle's own selection (a select_pages call) is not recorded
        saved, _spans.recorder = _spans.recorder, None
        with torch.no_grad():
            try:
                _count(record, info)
                if name == "attention" and record.sparse and self.oracle:
                    self._oracle(record, info)
            except Exception as exc:  # a profiler must never break the run it observes
                record.hit_rate = record.captured_mass = None
                self.error = f"{name}: {exc!r}"
            finally:
                _spans.recorder = saved

    def _clock(self, device: torch.device):
        key = str(device)
        clock = self._clocks.get(key)
        if clock is None:
            if device.type == "cuda":
                with torch.cuda.device(device):
                    clock = _CudaClock(device)
                self.device_name = torch.cuda.get_device_name(device)
            else:
                clock = _CpuClock(self._origin_ns)
            self._clocks[key] = clock
        return clock

    # ---- oracle selection ------------------------------------------------------------------------------
    def _oracle(self, record: SpanRecord, info) -> None:
        q, k_cache, block_table, seq_lens = info["q"], info["k_cache"], info["block_table"], info["seq_lens"]
        page_indices, scale = info["page_indices"], info["scale"]
        B, Tq, Hq, D = q.shape
        tokens = B * block_table.shape[1] * k_cache.shape[1]
        if tokens * Tq * Hq > self.max_oracle_elements or tokens * k_cache.shape[2] * D > 4 * self.max_oracle_elements:
            self.oracle_skipped += 1                                 # too large for a dense pass
            return
        hits, selected, mass_sum, mass_n = oracle_quality(q, k_cache, block_table, seq_lens, page_indices, scale,
                                                          **_selection_rules(info))
        if not mass_n:                                               # no row holds more pages than the budget
            return
        record.hit_rate = M.hit_rate(hits, selected)
        record.captured_mass = M.captured_mass(mass_sum, mass_n)
        qual = self.quality[record.layer]
        qual.calls += 1
        qual.pages_selected += selected
        qual.pages_hit += hits
        qual.mass_sum += mass_sum
        qual.mass_count += mass_n

    # ---- lifecycle -------------------------------------------------------------------------------------
    def _start(self):
        if self._torch_profiler_enabled:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._torch_prof = torch.profiler.profile(activities=activities, record_shapes=False)
            self._torch_prof.__enter__()
        self._t0 = time.perf_counter()

    def _stop(self):
        for clock in self._clocks.values():
            if isinstance(clock, _CudaClock):
                with torch.cuda.device(clock.device):
                    torch.cuda.synchronize()
        for record, clock, raw in self._pending:
            record.start_us, record.duration_us = clock.resolve(raw)
        self._pending.clear()
        self._wall_s = time.perf_counter() - self._t0
        if self._torch_prof is not None:
            self._torch_prof.__exit__(None, None, None)

    # ---- reports ---------------------------------------------------------------------------------------
    def table(self) -> list[dict]:
        """One row per (layer, op): calls, total / mean time, share of the layer's op time, pages, bytes, GB/s."""
        groups: dict[tuple[int, str], list[SpanRecord]] = defaultdict(list)
        for r in self.records:
            groups[(r.layer, r.op)].append(r)
        layer_total: dict[int, float] = defaultdict(float)
        for (lay, _), rs in groups.items():
            layer_total[lay] += sum(r.duration_us for r in rs)
        rows = []
        order = {op: i for i, op in enumerate(OPS)}
        for (lay, op), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], order.get(kv[0][1], 99), kv[0][1])):
            total = sum(r.duration_us for r in rs)
            nbytes = sum(r.bytes for r in rs)
            rows.append(dict(layer=lay, op=op, calls=len(rs), total_us=total, mean_us=total / len(rs),
                             share=total / layer_total[lay] if layer_total[lay] else float("nan"),
                             pages_per_call=sum(r.pages for r in rs) / len(rs), bytes_per_call=nbytes / len(rs),
                             gb_per_s=nbytes / (total * 1e3) if total else float("nan")))
        return rows

    def totals(self) -> dict[str, dict]:
        """Per op over all layers: calls, total_us, share of all op time, bytes."""
        out: dict[str, dict] = {}
        all_us = sum(r.duration_us for r in self.records)
        for r in self.records:
            d = out.setdefault(r.op, dict(calls=0, total_us=0.0, bytes=0))
            d["calls"] += 1
            d["total_us"] += r.duration_us
            d["bytes"] += r.bytes
        for d in out.values():
            d["share"] = d["total_us"] / all_us if all_us else float("nan")
        return out

    def summary(self) -> str:
        """The summary table as text (also what :meth:`print_summary` prints)."""
        lines = [f"tinyattn profile: {len(self.records)} op calls on {self.device_name}, "
                 f"{self._wall_s * 1e3:.1f} ms wall in the block "
                 f"({'CUDA events' if self.device_name != 'cpu' else 'perf_counter_ns'})"]
        head = f"{'layer':>5} {'op':<10} {'calls':>6} {'total ms':>9} {'mean us':>9} {'share':>6} " \
               f"{'pages/call':>10} {'KiB/call':>9} {'GB/s':>6}"
        lines += [head, "-" * len(head)]
        for row in self.table():
            lines.append(f"{_layer_name(row['layer']):>5} {row['op']:<10} {row['calls']:>6} "
                         f"{row['total_us'] / 1e3:>9.3f} "
                         f"{row['mean_us']:>9.1f} {row['share']:>6.1%} {row['pages_per_call']:>10.1f} "
                         f"{row['bytes_per_call'] / 1024:>9.1f} {row['gb_per_s']:>6.2f}")
        tot = self.totals()
        if tot:
            lines.append("-" * len(head))
            for op in sorted(tot, key=lambda o: (OPS.index(o) if o in OPS else 99, o)):
                d = tot[op]
                gbs = d["bytes"] / (d["total_us"] * 1e3) if d["total_us"] else float("nan")
                lines.append(f"{'all':>5} {op:<10} {d['calls']:>6} {d['total_us'] / 1e3:>9.3f} "
                             f"{d['total_us'] / d['calls']:>9.1f} {d['share']:>6.1%} {'':>10} "
                             f"{d['bytes'] / d['calls'] / 1024:>9.1f} {gbs:>6.2f}")
        if self.quality:
            lines.append("")
            lines.append("selection quality (sparse attention calls; oracle = same forced pages, then the pages "
                         "of most true attention mass)")
            qh = f"{'layer':>5} {'calls':>6} {'pages sel':>10} {'hit rate':>9} {'captured mass':>14}"
            lines += [qh, "-" * len(qh)]
            all_q = LayerQuality()
            for lay in sorted(self.quality):
                q = self.quality[lay]
                lines.append(f"{_layer_name(lay):>5} {q.calls:>6} {q.pages_selected:>10} {q.hit_rate:>9.1%} "
                             f"{q.captured_mass:>14.1%}")
                all_q.calls += q.calls
                all_q.pages_selected += q.pages_selected
                all_q.pages_hit += q.pages_hit
                all_q.mass_sum += q.mass_sum
                all_q.mass_count += q.mass_count
            lines.append(f"{'all':>5} {all_q.calls:>6} {all_q.pages_selected:>10} {all_q.hit_rate:>9.1%} "
                         f"{all_q.captured_mass:>14.1%}")
        if self.oracle_skipped:
            lines.append(f"(oracle skipped for {self.oracle_skipped} sparse calls too large for a dense pass)")
        if self.error:
            lines.append(f"(profiler error, numbers may be partial: {self.error})")
        if not self.quality and self.oracle and any(r.op == "attention" for r in self.records) \
                and not self.oracle_skipped:
            lines.append("(no sparse attention call: every selection held the whole row, hit rate is trivially 100%)")
        return "\n".join(lines)

    def print_summary(self, file=None) -> None:
        print(self.summary(), file=file)

    def export_chrome_trace(self, path) -> None:
        """Write a Chrome / Perfetto trace (JSON): torch's own when ``torch_profiler=True``, else the spans."""
        if self._torch_prof is not None:
            self._torch_prof.export_chrome_trace(str(path))
            return
        events = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": f"tinyattn ({self.device_name})"}}]
        for lay in sorted({r.layer for r in self.records}):
            events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": lay + 1,
                           "args": {"name": f"layer {lay}" if lay >= 0 else "no layer"}})
        for r in self.records:
            args = {"pages": r.pages, "bytes": r.bytes, "sparse": r.sparse}
            if r.hit_rate is not None:
                args.update(hit_rate=r.hit_rate, captured_mass=r.captured_mass)
            events.append({"name": r.op, "cat": "tinyattn", "ph": "X", "pid": 0, "tid": r.layer + 1,
                           "ts": round(r.start_us, 3), "dur": round(r.duration_us, 3), "args": args})
        with open(path, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ns"}, f)


def _layer_name(lay: int) -> str:
    return "-" if lay < 0 else str(lay)


@contextlib.contextmanager
def profile(*, oracle: bool = True, torch_profiler: bool = False, trace=None):
    """Profile the tinyattn ops run inside the block; yields a :class:`Profile` (complete after the block).

    Args:
        oracle: also compute, for each sparse attention call, the page hit rate against the oracle selection
            and the attention mass captured (a dense pass per call, outside the timings).
        torch_profiler: also run :class:`torch.profiler.profile`; the trace then holds aten ops / kernels.
        trace: if given, a path the Chrome / Perfetto trace is written to when the block ends.

    Profiles do not nest: entering one while another is active raises ``RuntimeError``.
    """
    if _spans.recorder is not None:
        raise RuntimeError("tinyattn.profiler.profile: another profile() block is already active")
    prof = Profile(oracle=oracle, torch_profiler=torch_profiler)
    prof._start()
    _spans.recorder = prof
    try:
        yield prof
    finally:
        _spans.recorder = None
        prof._stop()
        if trace is not None:
            prof.export_chrome_trace(trace)


def add_cli_option(parser) -> None:
    """Add ``--profile [TRACE.json]`` to an argparse parser or group (the ``generate`` / ``eval`` commands)."""
    parser.add_argument("--profile", nargs="?", const="", default=None, metavar="TRACE.json",
                        help="profile the attention ops: print a per-layer / per-op table (times, pages, bytes, "
                             "page hit rate and attention mass captured vs the oracle selection) after the run; "
                             "with a path, also write a Chrome / Perfetto trace there")


@contextlib.contextmanager
def cli_profile(value):
    """What ``--profile [TRACE.json]`` does around a command's work: ``None`` -> nothing (yields ``None``);
    ``""`` -> profile the block; a path -> also write the Chrome / Perfetto trace there when it ends.
    Print the result afterwards with :func:`print_cli_report`."""
    if value is None:
        yield None
        return
    if value:                                   # like the other output options: missing folders are created
        Path(value).parent.mkdir(parents=True, exist_ok=True)
    with profile(trace=value or None) as prof:
        yield prof


def print_cli_report(prof, value, *, file=None) -> None:
    """Print the summary of a :func:`cli_profile` block (nothing when ``prof`` is ``None``)."""
    if prof is None:
        return
    print("--- profile", file=file)
    prof.print_summary(file=file)
    if value:
        print(f"trace written to {value} (open it in https://ui.perfetto.dev or chrome://tracing)", file=file)


# ---------------------------------------------------------------------------- counting
def _esize(t: torch.Tensor) -> int:
    return t.element_size()


def _count(record: SpanRecord, info) -> None:
    """Pages and bytes read by a phase, from the tensors the op handed to its span (:mod:`tinyattn.metrics`,
    the DESIGN.md §1 model, counted on the actual tables: valid tokens of the pages attended)."""
    op = record.op
    if op == "attention":
        q, k_cache, block_table, seq_lens = info["q"], info["k_cache"], info["block_table"], info["seq_lens"]
        page_indices = info.get("page_indices")
        page_size, Hkv, D = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
        lens = seq_lens.to(torch.int64)
        n = M.num_pages(lens, page_size)                                                   # [B]
        if page_indices is None:             # dense: every valid page from the one holding the first key in the window
            first = first_window_key(lens, q.shape[1], info.get("window_left", -1)).clamp(min=0)          # [B]
            tokens = int((lens - first).clamp(min=0).sum()) * Hkv
            record.pages = int((n - first // page_size).clamp(min=0).sum()) * Hkv
        else:
            pages, tok = M.selection_reads(page_indices, lens, page_size)                  # [B, Hkv] each
            tokens = int(tok.sum())
            record.pages = int(pages.sum())
            record.sparse = page_indices.shape[-1] < block_table.shape[1] and bool((pages < n[:, None]).any())
        record.bytes = M.kv_bytes(tokens, D, _esize(k_cache)) + 2 * q.numel() * _esize(q)   # + queries, outputs
    elif op == "score":
        q, k_min, seq_lens, page_size = info["q"], info["k_min"], info["seq_lens"], info["page_size"]
        Hkv, D = k_min.shape[1], k_min.shape[2]
        pages = int(M.num_pages(seq_lens, page_size).sum()) * Hkv
        record.pages = pages
        record.bytes = M.box_bytes(pages, D, _esize(k_min)) + q.numel() * _esize(q)
    elif op == "topk":
        scores = info["scores"]
        record.pages = scores.numel()
        record.bytes = scores.numel() * _esize(scores)
    elif op == "metadata":
        k_cache = info.get("k_cache")
        if "k_new" in info:                       # incremental upkeep: new keys folded into their pages' boxes
            k_new = info["k_new"]
            record.pages = int(info.get("pages", k_new.shape[0]))
            record.bytes = k_new.numel() * _esize(k_new) + 2 * record.pages * k_new[0].numel() * _esize(k_new)
        elif k_cache is not None:                 # full recompute of the pages the rows touch
            page_size, Hkv, D = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
            lens = info["seq_lens"].to(torch.int64)
            record.pages = int(M.num_pages(lens, page_size).sum()) * Hkv
            record.bytes = int(lens.sum()) * Hkv * D * _esize(k_cache)


# ---------------------------------------------------------------------------- oracle
_DEFAULT_RULES = dict(num_sink_pages=0, num_recent_pages=1)   # the ops' and the runtime's defaults


def _selection_rules(info) -> dict:
    """``page_budget`` / ``num_sink_pages`` / ``num_recent_pages`` the attended pages were selected under.

    The sparse op passes them in its attention span (``selection``); without them (a direct call with
    hand-made ``page_indices``) the width of ``page_indices`` and the ops' defaults.
    """
    rules = info.get("selection")
    if rules:
        return {k: int(rules[k]) for k in ("page_budget", "num_sink_pages", "num_recent_pages")}
    return dict(page_budget=info["page_indices"].shape[-1], **_DEFAULT_RULES)


def oracle_quality(q4, k_cache, block_table, seq_lens, page_indices, scale, *, page_budget=None,
                   num_sink_pages=0, num_recent_pages=1):
    """Compare a selection with the oracle one: :class:`tinyattn.selection.SelectionMetrics` on one call.

    The oracle is :class:`tinyattn.selection.OraclePolicy`'s selection: the same forced pages (the last
    ``max(num_recent_pages, 1)``, the first ``num_sink_pages``), then the pages of most true attention
    mass (:func:`tinyattn.selection.page_attention_mass` of a dense softmax, summed over the group's query
    heads and the ``Tq`` queries), ``page_budget`` pages in all. Only the (row, KV head) pairs whose row
    holds more pages than the budget count (a row that fits is read whole, hit rate and mass trivially 1).

    Args:
        q4: ``[B, Tq, Hq, D]`` (or ``[B, Hq, D]``); k_cache: ``[num_pages, page_size, Hkv, D]``; block_table,
            seq_lens: as the ops. page_indices: ``[B, Hkv, K]`` selected logical pages (``-1`` padding).
        scale: softmax scale. page_budget: default ``K``. num_sink_pages, num_recent_pages: the forced pages.

    Returns:
        ``(hits, oracle_pages, mass_sum, mass_count)``: pages of the oracle's selections the selection also
        holds, pages of the oracle's selections, and the sum / count over (row, KV head) of the share of
        true attention mass on the selected pages.
    """
    from .selection import SelectionContext, SelectionMetrics

    ctx = SelectionContext(layer=0, q=q4, k_cache=k_cache, v_cache=None, k_min=None, k_max=None,
                           block_table=block_table, seq_lens=seq_lens,
                           page_budget=page_indices.shape[-1] if page_budget is None else int(page_budget),
                           num_sink_pages=num_sink_pages, num_recent_pages=num_recent_pages, scale=scale,
                           backend="torch")
    metrics = SelectionMetrics()
    metrics.record(ctx, page_indices)
    return (int(round(metrics.hits.get(0, 0.0))), int(round(metrics.oracle_pages.get(0, 0.0))),
            metrics.mass.get(0, 0.0), metrics.count.get(0, 0))
