"""The torch backend's plan: a planned step run with PyTorch ops (the CPU path, and fp64 everywhere).

Per step (:meth:`TorchPlan.plan`), once: the tables are copied, and what every layer reuses is built on first use —
the pool rows of every key a dense layer reads (per window) and which queries see them, the rows and masks of every
page a selecting layer may pick, the selection keys (forced recent and sink pages) and the physical pages.

Per layer (:meth:`TorchPlan.attend`), three routes, all built from :mod:`tinyattn.ops.attention.torch_impl` and
:mod:`tinyattn.ops.selection.torch_impl`:

- **prefill** (dense, ``Tq > 1``, no lse, no gradient): one ``index_select`` of the K and V rows, then SDPA on
  ``q`` ``[B, Hq, Tq, D]`` with ``enable_gqa`` — ``is_causal`` when every row is a fresh prefill (its
  ``seq_len == Tq``, no window: the flash kernel then skips the masked half), else a boolean ``[B, 1, Tq, keys]``
  mask (chunked prefill, prefix reuse, windows);
- **decode** (no lse, no gradient): the Quest selection when the layer selects, then one ``index_select`` of the
  rows and one SDPA with the group's query heads folded into the rows of their KV head (the fastest SDPA form on a
  CPU), large gathers in cache-sized chunks merged by lse;
- **exact** (an lse is asked, or autograd records): the NaN-safe masked softmax with its lse,
  :func:`~tinyattn.ops.attention.torch_impl.attend_rows`, differentiable (``index_select``'s backward accumulates
  into the pool).

Layout of the rows (docs/layout.md): the pool ``[num_pages, page_size, Hkv, D]`` is read as flat rows
``(page * page_size + slot) * Hkv + head`` (:func:`~tinyattn.ops.attention.torch_impl.page_rows`, the masking rule
of this backend: causal bottom-right, windows, ragged tails). A slot that must not count points at a valid key of
its row and is hidden by the mask, so NaN or garbage in unused slots is never read.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from . import custom_ops, quant
from . import spans as _spans
from .attention import torch_impl as attention_torch
from .layout import NEG_INF, cdiv_pages, group_queries, num_candidates, ungroup
from .selection import torch_impl as selection_torch
from .spans import span
from .step import Step

__all__ = ["TorchPlan"]

_WORKSPACE_MAX_BYTES = 512 * 2**20       # gathers above this size are not kept between calls
_WORKSPACE_MIN_BYTES = 256 * 2**10       # ... nor those below (no page faults to save)
_WINDOW_QUERY_BLOCK = 256                # a windowed prefill runs in query blocks of max(this, window) tokens
_EXACT = (torch.float32, torch.float64)  # dtypes the math runs in directly (others: fp32)


@functools.lru_cache(maxsize=None)
def _sdpa_zeroes_empty_rows() -> bool:
    """Whether this torch's SDPA returns 0 (not NaN) for a query whose keys are all masked (torch >= 2.5)."""
    q = torch.ones(1, 1, 1, 2)
    mask = torch.full((1, 1, 1, 1), float("-inf"))
    out = F.scaled_dot_product_attention(q, q[:, :, :1], q[:, :, :1], attn_mask=mask)
    return bool((out == 0).all())


class TorchPlan:
    """One step on the torch backend; built by :class:`tinyattn.PagedAttentionPlan` (use that)."""

    def __init__(self):
        self._buffers: dict[str, torch.Tensor] = {}     # gather workspaces, reused across layers and steps
        self._sub_plans: list[TorchPlan] = []            # query blocks of long windowed prefills

    # ------------------------------------------------------------------------------------------- plan
    def plan(self, step: Step, block_table: torch.Tensor, seq_lens: torch.Tensor, *, max_batch=None,
             max_pages_per_seq=None) -> None:
        """Copy the step's tables (the caller may change or reuse its tensors afterwards)."""
        self.step = step
        self.block_table = block_table.to(torch.int64, copy=True)
        self.seq_lens = seq_lens.to(torch.int64, copy=True)
        lens = step.lens if step.lens is not None else tuple(self.seq_lens.tolist())
        self._lens = lens
        # the pages any row holds (a selecting layer scores these)
        self._num_pages = min(step.max_pages, max((cdiv_pages(n, step.page_size) for n in lens), default=0))
        # every row a fresh prefill (its queries are all its tokens): causal SDPA, top-left = bottom-right
        self._fresh = step.num_query_tokens > 1 and all(n == step.num_query_tokens for n in lens)
        self._group = step.group
        self._run = False                # the one row's pages in pool order (see _pool_run), not known yet
        self._tables: dict = {}          # ("every" | "dense" | "sparse", window_left) -> rows / masks of the step
        self._keys = None                # selection keys (selection_torch.selection_keys)
        self._candidate_keys = None      # those of the re-rank's candidates (rerank='int4')
        self._last = None                # (pages, keep) of the last selecting run (see last_selection)
        self._blocks: dict = {}          # window_left -> [(t0, t1, sub-plan)]

    def last_selection(self) -> torch.Tensor | None:
        """The pages the last selecting run attended (rank order; top-p's dropped pages ``-1``), or ``None``."""
        if self._last is None:
            return None
        pages, keep = self._last
        return pages if keep is None else torch.where(keep, pages, -1)

    # ------------------------------------------------------------------------------------------- run
    def run(self, q, k_cache, v_cache, k_min, k_max, page_indices, return_lse, out, scale, scales, window_left,
            k_code=None):
        """Attention of one layer (see :meth:`tinyattn.PagedAttentionPlan.run`): :meth:`attend`, its lse cast to fp32
        (DESIGN.md §2), written into ``out`` if given. The torch forms are differentiable, so eager autograd runs
        them itself; while ``torch.compile`` traces, the custom ops (:func:`tinyattn.ops.custom_ops.differentiable`)
        run them opaquely."""
        if torch.compiler.is_compiling():
            step = self.step
            o, lse = custom_ops.differentiable(
                q, k_cache, v_cache, self.block_table, self.seq_lens, page_size=step.page_size, backend="torch",
                scale=scale, window_left=window_left, k_min=k_min, k_max=k_max, page_indices=page_indices,
                selection=step.selection if step.selects else None, scales=scales, nothing=step.nothing)
            return attention_torch.finish_output(q, o, lse, return_lse, out)
        o, lse = self.attend(q, k_cache, v_cache, k_min, k_max, page_indices, return_lse, scale, scales, window_left,
                             k_code)
        if out is None and not return_lse:
            return o
        return attention_torch.finish_output(q, o.unsqueeze(1) if q.dim() == 3 else o, lse, return_lse, out)

    def attend(self, q, k_cache, v_cache, k_min, k_max, page_indices, need_lse, scale, scales, window_left,
               k_code=None):
        """``(out, lse)`` of one layer: ``out`` shaped and typed like ``q``; ``lse`` ``[B, Tq, Hq]`` in the math
        dtype (fp32, fp64 for fp64), or ``None`` unless ``need_lse``. Differentiable in ``q``, ``k_cache``,
        ``v_cache`` (float pools)."""
        step = self.step
        if page_indices is not None and page_indices.shape[-1]:
            # ascending, de-duplicated, -1 past the end: duplicates never count twice (DESIGN.md §3)
            page_indices = selection_torch.canonical_page_indices(page_indices, self.seq_lens, step.page_size)
        if step.nothing or k_cache.shape[0] == 0 or (page_indices is not None and page_indices.shape[-1] == 0):
            o, lse = attention_torch.empty_attention(q.unsqueeze(1) if q.dim() == 3 else q, k_cache, v_cache)
            return o.view(q.shape), lse if need_lse else None
        selects = k_min is not None and step.selects
        # autograd records (then no out= workspace, no chunks, no SDPA): inline, this runs once per layer
        recording = torch.is_grad_enabled() and (q.requires_grad or k_cache.requires_grad or v_cache.requires_grad)
        if page_indices is None and not selects:
            if window_left >= 0 and self._query_blocks(window_left):
                return self._attend_query_blocks(q, k_cache, v_cache, need_lse, scale, scales, window_left)
            # the SDPA routes (no lse, no autograd; a profile records the spans of the tables' route)
            if not (need_lse or recording) and _spans.recorder is None and _sdpa_zeroes_empty_rows():
                if window_left < 0 and scales is None and self._pool_run() is not None:
                    return self._attend_run(q, k_cache, v_cache, scale), None
                if step.num_query_tokens > 1:
                    return self._prefill(q, k_cache, v_cache, scale, scales, window_left), None
        dt = q.dtype if q.dtype in _EXACT else torch.float32
        if q.dim() == 3 and q.dtype == dt and q.is_contiguous():      # decode: a free view, [B, Hkv, G, D]
            qg = q.view(step.batch, step.num_kv_heads, self._group, step.head_dim)
        else:
            qg = group_queries(q.unsqueeze(1) if q.dim() == 3 else q, step.num_kv_heads, dt)   # [B, Hkv, M, D]
        selection = None              # the rules the pages were chosen under (read by the profiler's oracle)
        if selects:
            codes = None if k_code is None else (k_code, k_cache, None if scales is None else scales[0])
            page_indices, keep = self._select_ranked(q, k_min, k_max, window_left, qg, scale, codes)
            self._last = (page_indices, keep)
            rows, bias, n_keys = self._selected_rows(page_indices, window_left, keep)
            if _spans.recorder is not None:          # the profiler reads canonical page lists and the rules
                if keep is not None:
                    page_indices = torch.where(keep, page_indices, -1)
                page_indices = selection_torch.canonical_page_indices(page_indices, self.seq_lens, step.page_size)
                selection = step.selection
        elif page_indices is not None:
            rows, bias, n_keys = self._listed_rows(page_indices, window_left)
            selection = dict(step.selection, page_budget=page_indices.shape[-1])
        else:
            rows, bias, n_keys = self._dense_rows(window_left)
        if _spans.recorder is None:
            o, lse = self._attend_grouped(qg, k_cache, v_cache, rows, bias, n_keys, scale, scales, need_lse,
                                          recording)
        else:
            with span("attention", q=q.unsqueeze(1) if q.dim() == 3 else q, k_cache=k_cache,
                      block_table=self.block_table, seq_lens=self.seq_lens, page_indices=page_indices, scale=scale,
                      selection=selection, window_left=window_left):
                o, lse = self._attend_grouped(qg, k_cache, v_cache, rows, bias, n_keys, scale, scales, need_lse,
                                              recording)
        Tq = step.num_query_tokens
        if Tq == 1 and q.dim() == 3 and o.dtype == q.dtype:
            # decode: [B, Hkv, G, D] is [B, Hq, D]; a view unless SDPA on CUDA handed back another layout
            o = o.reshape(q.shape)
        else:
            o = ungroup(o, Tq)
            o = (o if o.dtype == q.dtype else o.to(q.dtype)).reshape(q.shape)
        return o, None if lse is None or not need_lse else ungroup(lse, Tq)

    def select(self, q4, k_min, k_max, window_left: int = -1, qg=None, scale: float | None = None,
               codes=None) -> torch.Tensor:
        """Logical pages ``[B, Hkv, K]`` the Quest selection keeps for this layer (rank order; a row with fewer
        than ``K`` valid pages also lists pages past its end, which the tables hide; with top-p the pages it drops
        read ``-1``). ``q4``: ``[B, Tq, Hq, D]`` (or a decode ``[B, Hq, D]``); ``qg``: its grouped form when the
        caller has it; ``scale``: the softmax scale of top-p's mass (``None``: the plan's); ``codes``: ``(k_code,
        k_cache, k_scale)`` for a plan with ``rerank``."""
        pages, keep = self._select_ranked(q4, k_min, k_max, window_left, qg, scale, codes)
        return pages if keep is None else torch.where(keep, pages, -1)

    def _select_ranked(self, q4, k_min, k_max, window_left: int, qg, scale, codes=None):
        """``(pages [B, Hkv, K] in rank order, keep [B, Hkv, K] bool or None)``: the capacity's pages and, with
        top-p, which of them it keeps (:func:`~tinyattn.ops.selection.torch_impl.top_p_keep`)."""
        step = self.step
        if q4.dim() == 3 and (qg is None or _spans.recorder is not None or window_left >= 0):
            q4 = q4.unsqueeze(1)
        if qg is None:
            qg = group_queries(q4, step.num_kv_heads, q4.dtype if q4.dtype in _EXACT else torch.float32)
        if self._keys is None:
            num_pages = self._num_pages
            self._keys = selection_torch.selection_keys(
                self.seq_lens, num_pages, page_size=step.page_size, page_budget=step.page_budget,
                num_sink_pages=step.num_sink_pages, num_recent_pages=step.num_recent_pages,
                num_query_tokens=step.num_query_tokens)
            if all(cdiv_pages(n, step.page_size) >= num_pages for n in self._lens):
                self._phys = (self.block_table[:, :num_pages], None)   # every page valid: the table itself, no mask
            else:
                self._phys = selection_torch.physical_pages(self.block_table[:, :num_pages], self.seq_lens,
                                                            step.page_size)
        top_p = step.top_p if step.top_p is not None and step.top_p < 1.0 else None
        if step.rerank is not None:
            return self._rerank_ranked(q4, k_min, k_max, window_left, qg, scale, codes, top_p)
        if _spans.recorder is None and window_left < 0 and top_p is None:      # the decode layer: no span, no window
            # the bound is not differentiated (detach only when autograd could record: an op less per layer)
            return selection_torch.top_pages(selection_torch.page_bounds(
                qg.detach() if qg.requires_grad else qg, k_min, k_max, *self._phys, step.gamma), self._keys), None
        with span("score", q=q4, k_min=k_min, block_table=self.block_table, seq_lens=self.seq_lens,
                  page_size=step.page_size):
            scores = selection_torch.page_bounds(qg.detach(), k_min, k_max, *self._phys, step.gamma)   # [B, Hkv, pages]
            scores = selection_torch.mask_pages_before_window(scores, self.seq_lens, step.page_size,
                                                              step.num_query_tokens, window_left)
        with span("topk", scores=scores, seq_lens=self.seq_lens, page_budget=step.page_budget):
            pages = selection_torch.top_pages(scores, self._keys)
            if top_p is None:
                return pages, None
            return pages, selection_torch.top_p_keep(scores, pages, self._keys, top_p,
                                                     step.scale if scale is None else scale)

    def _rerank_ranked(self, q4, k_min, k_max, window_left: int, qg, scale, codes, top_p):
        """The re-ranked selection (issue 35's second stage): the estimate's ``ceil(candidates · page_budget)``
        best pages (forced pages first), their log attention mass from 4-bit keys
        (:func:`~tinyattn.ops.selection.torch_impl.rerank_scores`), then the selection of :meth:`_select_ranked`
        over that mass (top-p with softmax scale 1: the scores are log-masses)."""
        step = self.step
        if codes is None:
            raise ValueError("k_code: expected the pool's 4-bit key codes for a plan with rerank='int4' (PagedKVCache("
                             "..., key_codes=True).k_code[layer]), got None")
        k_code, k_cache, k_scale = codes
        scale = step.scale if scale is None else scale
        q4 = q4.unsqueeze(1) if q4.dim() == 3 else q4
        if self._candidate_keys is None:
            self._candidate_keys = selection_torch.selection_keys(
                self.seq_lens, self._num_pages, page_size=step.page_size,
                page_budget=num_candidates(step.page_budget, step.candidates, self._num_pages),
                num_sink_pages=step.num_sink_pages, num_recent_pages=step.num_recent_pages,
                num_query_tokens=step.num_query_tokens)
        with span("score", q=q4, k_min=k_min, block_table=self.block_table, seq_lens=self.seq_lens,
                  page_size=step.page_size):
            scores = selection_torch.page_bounds(qg.detach(), k_min, k_max, *self._phys, step.gamma)
            scores = selection_torch.mask_pages_before_window(scores, self.seq_lens, step.page_size,
                                                              step.num_query_tokens, window_left)
            candidates = selection_torch.top_pages(scores, self._candidate_keys)          # [B, Hkv, C]
            mass = selection_torch.rerank_scores(q4.detach(), k_code, k_cache, k_min, k_max, candidates,
                                                 self.block_table[:, : self._num_pages], self.seq_lens,
                                                 page_size=step.page_size, scale=scale, window_left=window_left,
                                                 k_scale=k_scale)
        with span("topk", scores=mass, seq_lens=self.seq_lens, page_budget=step.page_budget):
            pages = selection_torch.top_pages(mass, self._keys)
            if top_p is None:
                return pages, None
            return pages, selection_torch.top_p_keep(mass, pages, self._keys, top_p, 1.0)

    # ------------------------------------------------------------------------------ rows and masks
    def _page_tables(self, pages: torch.Tensor, window_left: int):
        """Rows ``[B, Hkv, K, page_size]`` and visibility ``[B, Hkv, Tq, K, page_size]`` of logical ``pages``
        ``[B, Hkv, K]``."""
        step = self.step
        rows, _, visible = attention_torch.page_rows(
            self.block_table, self.seq_lens, pages, page_size=step.page_size, num_kv_heads=step.num_kv_heads,
            num_query_tokens=step.num_query_tokens, window_left=window_left)
        return rows, visible

    @staticmethod
    def _additive(visible: torch.Tensor) -> torch.Tensor:
        """A boolean mask as SDPA's additive one (``0`` visible, ``-inf`` hidden)."""
        return torch.zeros(visible.shape, device=visible.device).masked_fill_(~visible, NEG_INF)

    def _every_page(self, window_left: int):
        """Rows ``[B, Hkv, pages, page_size]`` and additive mask ``[B, Hkv, Tq, pages, page_size]`` of every page of the
        step (``pages`` = the
        longest row's), once per step and window."""
        key = ("every", window_left)
        if key not in self._tables:
            step = self.step
            rows, _, visible = attention_torch.page_rows(
                self.block_table, self.seq_lens, None, num_pages=self._num_pages, page_size=step.page_size,
                num_kv_heads=step.num_kv_heads, num_query_tokens=step.num_query_tokens, window_left=window_left)
            self._tables[key] = (rows, self._additive(visible), visible)
        return self._tables[key]

    def _grouped(self, bias: torch.Tensor) -> torch.Tensor:
        """``[B, Hkv, Tq, n]`` mask -> ``[B, Hkv, Tq * G, n]`` (query rows ordered ``(t, g)``, as
        :func:`~tinyattn.ops.layout.group_queries`); decode masks (``Tq = 1``) broadcast over the group."""
        B, Hkv, Tq, n = bias.shape
        if Tq == 1:
            return bias
        G = self.step.group
        return bias[:, :, :, None].expand(B, Hkv, Tq, G, n).reshape(B, Hkv, Tq * G, n)

    def _dense_keys(self, window_left: int):
        """Every key a dense layer reads: flat rows ``[B * Hkv * n]``, visibility ``[B, Hkv, Tq, n]`` (``None`` when
        every query sees every key) and ``n``, once per step and window.

        With a window each row starts at the page of the first key its earliest query sees, so ``n`` is the longest
        window rounded out to whole pages, not the longest row: a sliding layer reads ``O(window)`` keys."""
        key = ("dense", window_left)
        if key not in self._tables:
            step, lens = self.step, self._lens
            page_size, Tq, B, Hkv = step.page_size, step.num_query_tokens, step.batch, step.num_kv_heads
            if window_left < 0:               # every page of the step: the tables a selecting layer uses too
                num_pages = self._num_pages
                rows, _, visible = self._every_page(window_left)
            else:
                first = [max(attention_torch.window_start(n - Tq, window_left), 0) // page_size for n in lens]
                num_pages = max((cdiv_pages(n, page_size) - f for n, f in zip(lens, first)), default=0)
                pages = (torch.tensor(first, dtype=torch.int64)[:, None] + torch.arange(num_pages))[:, None, :]
                pages = pages.expand(B, Hkv, num_pages).to(self.block_table.device)
                rows, visible = self._page_tables(pages, window_left)
            n = num_pages * page_size
            all_visible = window_left < 0 and Tq == 1 and all(length == n for length in lens)
            self._tables[key] = (rows.reshape(-1), None if all_visible else visible.reshape(B, Hkv, Tq, n), n)
        return self._tables[key]

    def _dense_rows(self, window_left: int):
        """:meth:`_dense_keys` with the grouped additive mask SDPA / :func:`attend_rows` read (once per window)."""
        key = ("dense-grouped", window_left)
        if key not in self._tables:
            rows, visible, n = self._dense_keys(window_left)
            self._tables[key] = (rows, None if visible is None else self._grouped(self._additive(visible)), n)
        return self._tables[key]

    def _selected_rows(self, pages: torch.Tensor, window_left: int, keep: torch.Tensor | None = None):
        """Rows and mask of the pages a selection kept (:meth:`select`, rank order), gathered from the step's tables
        of every page.

        Without a window the mask is the step's: in rank order each position holds a page of a known kind (recent
        pages first, then sinks, then scored pages, then pages past a short row's end;
        :func:`~tinyattn.ops.selection.torch_impl.top_pages`), and only recent pages and invalid ones hide slots. So
        it is the mask of the template selection made with equal scores, gathered once per step; a window's mask
        depends on the pages and is gathered per call. ``keep`` ``[B, Hkv, K]`` (top-p): the pages it drops are
        hidden whole (the shapes stay the capacity's)."""
        key = ("sparse", window_left)
        step = self.step
        B, Hkv, page_size = step.batch, step.num_kv_heads, step.page_size
        K = pages.shape[-1]
        if key not in self._tables:
            rows, bias, _ = self._every_page(window_left)       # [B, Hkv, pages, page_size], [B, Hkv, Tq, pages, ...]
            fixed = None
            if window_left < 0:
                template = selection_torch.top_pages(torch.zeros(B, Hkv, self._num_pages, device=rows.device),
                                                     self._keys)                              # [B, Hkv, K]
                fixed = self._gathered_bias(bias, template)
            self._tables[key] = (rows, bias, fixed)
        rows, bias, fixed = self._tables[key]
        rows = rows.gather(2, pages[..., None].expand(B, Hkv, K, page_size))                 # [B, Hkv, K, page_size]
        bias = fixed if fixed is not None else self._gathered_bias(bias, pages)              # [B, Hkv, M, K * ps]
        if keep is not None:
            dropped = torch.where(keep, 0.0, NEG_INF)[:, :, None, :, None].expand(B, Hkv, 1, K, page_size)
            bias = bias + dropped.reshape(B, Hkv, 1, K * page_size).to(bias.dtype)
        return rows.view(-1), bias, K * page_size

    def _gathered_bias(self, bias: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
        """The ``[B, Hkv, Tq, pages, page_size]`` mask table at ``pages`` ``[B, Hkv, K]``, as SDPA's
        ``[B, Hkv, M, K * page_size]``."""
        B, Hkv, Tq, _, page_size = bias.shape
        K = pages.shape[-1]
        bias = bias.gather(3, pages[:, :, None, :, None].expand(B, Hkv, Tq, K, page_size))   # [B, Hkv, Tq, K, ...]
        return self._grouped(bias.reshape(B, Hkv, Tq, K * page_size))

    def _listed_rows(self, page_indices: torch.Tensor, window_left: int):
        """Rows and mask of pages listed by a caller (canonical: ascending, ``-1`` padded)."""
        step = self.step
        B, Hkv, K = page_indices.shape
        rows, visible = self._page_tables(page_indices, window_left)
        bias = self._additive(visible).reshape(B, Hkv, step.num_query_tokens, K * step.page_size)
        return rows.reshape(-1), self._grouped(bias), K * step.page_size

    def _pool_run(self):
        """``(first_page, tokens)`` when the step is one row whose pages lie in the pool in order (``block_table[0,
        j] = first_page + j``, as :class:`tinyattn.PagedKVCache` allocates a sequence's pages): its keys are then a
        strided view of the pool and dense attention reads them in place, with no gather (a third of the time of
        the gather and SDPA at 8K). ``None`` otherwise; decided once per step."""
        if self._run is False:
            self._run = None
            step, lens = self.step, self._lens
            if step.batch == 1 and lens[0] > 0 and self.block_table.is_cpu:
                n = cdiv_pages(lens[0], step.page_size)
                pages = self.block_table[0, :n]
                if bool((pages == pages[0] + torch.arange(n)).all()):
                    self._run = (int(pages[0]), lens[0])
        return self._run

    def _attend_run(self, q, k_cache, v_cache, scale: float) -> torch.Tensor:
        """Dense attention of the one row of :meth:`_pool_run` over pool views: SDPA on the group-folded queries at
        decode, causal (or under the step's mask) on the query heads at prefill."""
        step = self.step
        first, length = self._run
        Hkv, D, page_size = step.num_kv_heads, step.head_dim, step.page_size
        pages = slice(first, first + cdiv_pages(length, page_size))
        dt = q.dtype if q.dtype in _EXACT else torch.float32
        # [pages, page_size, Hkv, D] -> [1, Hkv, length, D]: a view (strides passed to SDPA), cast if the math dtype
        k, v = (x[pages].reshape(-1, Hkv, D)[:length].permute(1, 0, 2)[None].to(dt) for x in (k_cache, v_cache))
        if step.num_query_tokens == 1:
            qg = group_queries(q.unsqueeze(1) if q.dim() == 3 else q, Hkv, dt)            # [1, Hkv, G, D]
            return F.scaled_dot_product_attention(qg, k, v, scale=scale).to(q.dtype).view(q.shape)
        qh = q.transpose(1, 2).to(dt)                                                    # [1, Hq, Tq, D]
        if self._fresh:
            o = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            _, visible, _ = self._dense_keys(-1)
            o = F.scaled_dot_product_attention(qh, k, v, attn_mask=visible[:, :1, :, :length], scale=scale,
                                               enable_gqa=True)
        return o.transpose(1, 2).to(q.dtype)

    # ------------------------------------------------------------------------------------- attention
    def _prefill(self, q, k_cache, v_cache, scale: float, scales, window_left: int) -> torch.Tensor:
        """Dense attention of ``q`` ``[B, Tq, Hq, D]`` (``Tq > 1``) with SDPA on the query heads as they are
        (``enable_gqa``): causal when every row is a fresh prefill, else under the boolean mask of the step."""
        rows, visible, n = self._dense_keys(window_left)
        dt = q.dtype if q.dtype in _EXACT else torch.float32
        k, v = self._gather_kv(k_cache, v_cache, rows, n, dt, scales)                   # [B, Hkv, n, D]
        qh = q.transpose(1, 2).to(dt)                                                    # [B, Hq, Tq, D]
        if self._fresh and window_left < 0:
            o = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            # dense pages are the same for every KV head: one [B, 1, Tq, n] mask serves all query heads
            mask = None if visible is None else visible[:, :1]
            o = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        return o.transpose(1, 2).to(q.dtype)

    def _attend_grouped(self, qg, k_cache, v_cache, rows, bias, n_keys: int, scale: float, scales, need_lse: bool,
                        recording: bool):
        """Attention of ``qg`` ``[B, Hkv, M, D]`` over the pool ``rows``: ``(out [B, Hkv, M, D], lse or None)``.

        Large steps run in cache-sized chunks merged by lse (not while autograd records: the chunks write into
        preallocated partials); an lse, autograd or an SDPA that gives NaN for empty rows take the NaN-safe softmax
        (:func:`~tinyattn.ops.attention.torch_impl.attend_rows`); everything else one SDPA call."""
        B, Hkv, M, D = qg.shape
        chunk = None
        if not recording and n_keys * B * Hkv * D * k_cache.element_size() >= attention_torch.MIN_BYTES:
            chunk = attention_torch.chunk_keys(n_keys, B * Hkv, D, k_cache.element_size())
        if chunk is not None:                                          # a large step: in cache-sized chunks
            def gather(flat_rows, n):
                return self._gather_kv(k_cache, v_cache, flat_rows, n, qg.dtype, scales)
            return attention_torch.attend_chunked(qg, gather, rows.view(B, Hkv, n_keys), bias, scale, chunk)
        k, v = self._gather_kv(k_cache, v_cache, rows, n_keys, qg.dtype, scales)
        if need_lse or recording or not _sdpa_zeroes_empty_rows():
            # the NaN-safe core with its lse (a query that sees no key: zeros and -inf)
            return attention_torch.attend_rows(qg, k, v, None if bias is None else bias == 0, scale)
        if bias is not None and bias.dtype != qg.dtype:    # fp64 SDPA with an fp32 mask is wrong on torch 2.13's CPU
            bias = bias.to(qg.dtype)
        return F.scaled_dot_product_attention(qg, k, v, attn_mask=bias, scale=scale), None

    def attend_backward(self, q4, k_cache, v_cache, page_indices, dout, dlse, scale: float, window_left: int):
        """Gradients ``(dq, dk_cache, dv_cache)`` of :meth:`attend` (dense, or over canonical ``page_indices``) for
        ``dout`` ``[B, Tq, Hq, D]`` and ``dlse`` ``[B, Tq, Hq]`` (or ``None``): the same rows and mask, then
        :func:`~tinyattn.ops.attention.torch_impl.attend_rows_backward`, accumulated into pool-shaped gradients (a
        page read by several rows or heads sums; slots never read get exactly 0)."""
        step = self.step
        Tq, Hkv, D = step.num_query_tokens, step.num_kv_heads, step.head_dim
        dt = q4.dtype if q4.dtype in _EXACT else torch.float32
        dk_pool = torch.zeros(k_cache.numel() // D, D, dtype=dt, device=q4.device)
        dv_pool = torch.zeros(v_cache.numel() // D, D, dtype=dt, device=q4.device)
        if not (step.nothing or k_cache.shape[0] == 0 or (page_indices is not None and page_indices.shape[-1] == 0)):
            if page_indices is None:
                rows, bias, n_keys = self._dense_rows(window_left)
            else:
                rows, bias, n_keys = self._listed_rows(page_indices, window_left)
            k, v = self._gather_kv(k_cache, v_cache, rows, n_keys, dt)
            grads = attention_torch.attend_rows_backward(
                group_queries(q4, Hkv, dt), k, v, None if bias is None else bias == 0, scale,
                group_queries(dout, Hkv, dt), None if dlse is None else group_queries(dlse[..., None], Hkv, dt)[..., 0])
            dq = ungroup(grads[0], Tq)
            dk_pool.index_add_(0, rows, grads[1].reshape(-1, D))
            dv_pool.index_add_(0, rows, grads[2].reshape(-1, D))
        else:
            dq = torch.zeros(q4.shape, dtype=dt, device=q4.device)
        return (dq.to(q4.dtype).contiguous(), dk_pool.view(k_cache.shape).to(k_cache.dtype),
                dv_pool.view(v_cache.shape).to(v_cache.dtype))

    def _gather_kv(self, k_cache, v_cache, rows, n_keys: int, dtype, scales=None):
        """K and V of the pool ``rows`` as ``[B, Hkv, n_keys, D]`` in the math ``dtype``; quantized pools
        (``scales = (k_scale, v_scale)``) are dequantized row by row: ``row.float() * scale[page, head]``.

        Large gathers go into workspaces reused across layers and steps: a fresh large output at every call costs
        page faults that triple the gather time on a CPU; the gathered K/V only live until the attention of the
        same call returns. Small ones (the lookup costs more than it saves), huge ones and gathers autograd records
        (``out=`` has no autograd) are plain ``index_select``.
        """
        step = self.step
        B, Hkv, D = step.batch, step.num_kv_heads, step.head_dim
        kv = []
        for name, x in (("k", k_cache), ("v", v_cache)):
            flat = x.view(-1, D) if x.is_contiguous() else x.reshape(-1, D)
            numel = rows.shape[0] * D
            if numel < _WORKSPACE_MIN_BYTES // 8 or numel * flat.element_size() > _WORKSPACE_MAX_BYTES or (
                    x.requires_grad and torch.is_grad_enabled()):
                kv.append(flat.index_select(0, rows))
                continue
            buf = self._buffers.get(name)
            if buf is None or buf.dtype != flat.dtype or buf.device != flat.device or buf.numel() < numel:
                buf = self._buffers[name] = torch.empty(numel, dtype=flat.dtype, device=flat.device)
            kv.append(torch.index_select(flat, 0, rows, out=buf[:numel].view(rows.shape[0], D)))
        k, v = kv
        if scales is None and k.dtype == dtype:
            return k.view(B, Hkv, n_keys, D), v.view(B, Hkv, n_keys, D)
        if scales is not None:
            idx = quant.scale_rows(rows, step.page_size, Hkv)
            k = quant.dequantize_rows(k, scales[0], idx, dtype)
            v = quant.dequantize_rows(v, scales[1], idx, dtype)
        k, v = k.view(B, Hkv, n_keys, D), v.view(B, Hkv, n_keys, D)
        return (k, v) if k.dtype == dtype else (k.to(dtype), v.to(dtype))

    # ------------------------------------------------------------------ long windowed prefills
    def _query_blocks(self, window_left: int):
        """The query blocks of a long windowed dense prefill, or ``None``.

        A sliding layer's query ``t`` only needs the keys ``[p - window_left, p]``; one gather for all ``Tq``
        queries would read (and mask) ``Tq x L`` logits. Cut into blocks of ``Qb = max(256, window_left + 1)``
        queries, each block is planned as its own step whose rows end at its last query (``seq_lens - (Tq -
        t1)``: the same positions, so the same mask), and reads at most ``window_left + Qb`` keys: ``O(Tq · W)``.
        Planned once per step and window."""
        step = self.step
        Tq = step.num_query_tokens
        if Tq <= 2 * max(_WINDOW_QUERY_BLOCK, window_left + 1):
            return None
        if window_left not in self._blocks:
            Qb = max(_WINDOW_QUERY_BLOCK, window_left + 1)
            blocks = []
            for i, t0 in enumerate(range(0, Tq, Qb)):
                t1 = min(t0 + Qb, Tq)
                if i == len(self._sub_plans):
                    self._sub_plans.append(TorchPlan())
                lens = tuple(max(n - (Tq - t1), 0) for n in self._lens)
                sub = step._replace(num_query_tokens=t1 - t0, lens=lens, page_budget=None, selects=False,
                                    nothing=not any(lens))
                self._sub_plans[i].plan(sub, self.block_table, (self.seq_lens - (Tq - t1)).clamp(min=0))
                blocks.append((t0, t1, self._sub_plans[i]))
            self._blocks[window_left] = blocks
        return self._blocks[window_left]

    def _attend_query_blocks(self, q, k_cache, v_cache, need_lse, scale, scales, window_left):
        """:meth:`attend` of each query block (:meth:`_query_blocks`), concatenated over ``Tq``."""
        outs, lses = [], []
        for t0, t1, sub in self._blocks[window_left]:
            o, lse = sub.attend(q[:, t0:t1], k_cache, v_cache, None, None, None, need_lse, scale, scales,
                                window_left)
            outs.append(o)
            lses.append(lse)
        return torch.cat(outs, 1), torch.cat(lses, 1) if need_lse else None
