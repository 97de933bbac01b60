"""The torch backend's plan: a planned step run with PyTorch ops (the CPU path, and fp64 everywhere).

Per step (:meth:`TorchPlan.plan`), once: the tables are copied, and what every layer reuses is built on first
use — the pool rows of every key a dense layer reads (per window), the rows and masks of every page a selecting
layer may pick, the selection keys (forced recent and sink pages) and the physical pages of the step.

Per layer (:meth:`TorchPlan.forward`): the Quest bound (:func:`tinyattn.ops.torch_backend.page_bounds`) and the
selection (:func:`tinyattn.ops.torch_backend.top_pages`) when the layer selects, then one ``index_select`` of the
K and V rows the layer reads and one :func:`torch.nn.functional.scaled_dot_product_attention` over them (grouped
query heads folded into the rows of their KV head; the NaN-safe :func:`tinyattn.ops.core.attend_rows` when an lse
is asked). So a decode layer costs a handful of PyTorch calls.

Layout of the rows (docs/layout.md): the pool ``[num_pages, page_size, Hkv, D]`` is read as flat rows
``(page * page_size + slot) * Hkv + head`` (:func:`tinyattn.ops.core.page_rows`, the one masking rule of this
backend: causal bottom-right, windows, ragged tails). A slot that must not count points at a valid key of its row
and is hidden by the additive mask (``0`` visible, ``-inf`` hidden), so NaN or garbage in unused slots is never
read. Large steps attend in cache-sized chunks merged by lse (:mod:`tinyattn.ops.chunked`).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from . import chunked, core, quant
from . import torch_backend as T
from . import spans as _spans
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
        self._num_pages = min(step.max_pages, max((core.cdiv_pages(n, step.page_size) for n in lens), default=0))
        self._tables: dict = {}          # ("every" | "dense" | "sparse", window_left) -> rows / masks of the step
        self._keys = None                # selection keys (torch_backend.selection_keys)
        self._blocks: dict = {}          # window_left -> [(t0, t1, sub-plan)]

    # ------------------------------------------------------------------------------------------- run
    def forward(self, q, k_cache, v_cache, k_min, k_max, page_indices, return_lse, out, scale, scales,
                window_left):
        """Attention of one layer with no autograd; see :meth:`tinyattn.PagedAttentionPlan.run`."""
        step = self.step
        q4 = q.unsqueeze(1) if q.dim() == 3 else q
        if page_indices is not None and page_indices.shape[-1]:
            # ascending, de-duplicated, -1 past the end: duplicates never count twice (DESIGN.md §3)
            page_indices = core.canonical_page_indices(page_indices, self.seq_lens, step.page_size)
        if step.nothing or k_cache.shape[0] == 0 or (page_indices is not None and page_indices.shape[-1] == 0):
            return core.finish_output(q, *core.empty_attention(q4, k_cache, v_cache), return_lse, out)
        selects = k_min is not None and step.selects
        if window_left >= 0 and page_indices is None and not selects and self._query_blocks(window_left):
            return self._run_query_blocks(window_left, q, k_cache, v_cache, return_lse, out, scale, scales)
        dt = q.dtype if q.dtype in _EXACT else torch.float32
        if q.dim() == 3 and q.dtype == dt and q.is_contiguous():      # decode: a free view, [B, Hkv, G, D]
            qg = q.view(step.batch, step.num_kv_heads, step.group, step.head_dim)
        else:
            qg = core.group_queries(q4, step.num_kv_heads, dt)                              # [B, Hkv, M, D]
        selection = None              # the rules the pages were chosen under (read by the profiler's oracle)
        if selects:
            page_indices = self.select(q4, k_min, k_max, window_left, qg)
            rows, bias, n_keys = self._selected_rows(page_indices, window_left)
            selection = step.selection
            if _spans.recorder is not None:          # the profiler reads canonical page lists
                page_indices = core.canonical_page_indices(page_indices, self.seq_lens, step.page_size)
        elif page_indices is not None:
            rows, bias, n_keys = self._listed_rows(page_indices, window_left)
            selection = dict(step.selection, page_budget=page_indices.shape[-1])
        else:
            rows, bias, n_keys = self._dense_rows(window_left)
        if _spans.recorder is None:
            o, lse = self._attend(qg, k_cache, v_cache, rows, bias, n_keys, scale, scales, return_lse)
        else:
            with span("attention", q=q4, k_cache=k_cache, block_table=self.block_table, seq_lens=self.seq_lens,
                      page_indices=page_indices, scale=scale, selection=selection, window_left=window_left):
                o, lse = self._attend(qg, k_cache, v_cache, rows, bias, n_keys, scale, scales, return_lse)
        Tq = step.num_query_tokens
        if out is None and not return_lse and q.dim() == 3 and o.dtype == q.dtype:
            return o.view(q.shape)                                    # decode: [B, Hkv, G, D] is [B, Hq, D]
        o = core.ungroup(o, Tq)
        o = o if o.dtype == q.dtype else o.to(q.dtype)
        return core.finish_output(q, o, None if lse is None else core.ungroup(lse, Tq), return_lse, out)

    def select(self, q4, k_min, k_max, window_left: int = -1, qg=None) -> torch.Tensor:
        """Logical pages ``[B, Hkv, K]`` the Quest selection keeps for this layer (rank order; a row with fewer
        than ``K`` valid pages also lists pages past its end, which the tables hide)."""
        step = self.step
        if qg is None:
            qg = core.group_queries(q4, step.num_kv_heads, q4.dtype if q4.dtype in _EXACT else torch.float32)
        if self._keys is None:
            P = self._num_pages
            self._keys = T.selection_keys(self.seq_lens, P, page_size=step.page_size, page_budget=step.page_budget,
                                          num_sink_pages=step.num_sink_pages,
                                          num_recent_pages=step.num_recent_pages,
                                          num_query_tokens=step.num_query_tokens)
            phys, valid = T.physical_pages(self.block_table[:, :P], self.seq_lens, step.page_size)
            every = all(core.cdiv_pages(n, step.page_size) >= P for n in self._lens)
            self._phys = (phys, None if every else valid)          # no mask to apply when every page is valid
        if _spans.recorder is None and window_left < 0:              # the decode layer: no span, no window
            return T.top_pages(T.page_bounds(qg.detach(), k_min, k_max, *self._phys), self._keys)
        with span("score", q=q4, k_min=k_min, block_table=self.block_table, seq_lens=self.seq_lens,
                  page_size=step.page_size):
            scores = T.page_bounds(qg.detach(), k_min, k_max, *self._phys)                 # [B, Hkv, P]
            scores = core.mask_pages_before_window(scores, self.seq_lens, step.page_size, step.num_query_tokens,
                                                   window_left)
        with span("topk", scores=scores, seq_lens=self.seq_lens, page_budget=step.page_budget):
            return T.top_pages(scores, self._keys)

    # ------------------------------------------------------------------------------ rows and masks
    def _page_tables(self, pages: torch.Tensor, window_left: int):
        """Rows ``[B, Hkv, K, S]`` and additive mask ``[B, Hkv, Tq, K, S]`` of logical ``pages`` ``[B, Hkv, K]``."""
        step = self.step
        rows, _, visible = core.page_rows(self.block_table, self.seq_lens, pages, page_size=step.page_size,
                                          num_kv_heads=step.num_kv_heads, num_query_tokens=step.num_query_tokens,
                                          window_left=window_left)
        return rows, torch.zeros(visible.shape, device=visible.device).masked_fill_(~visible, core.NEG_INF)

    def _every_page(self, window_left: int):
        """:meth:`_page_tables` of every page of the step (``P`` = the longest row's), once per step and window."""
        key = ("every", window_left)
        if key not in self._tables:
            step, P = self.step, self._num_pages
            every = torch.arange(P, device=self.block_table.device).expand(step.batch, step.num_kv_heads, P)
            self._tables[key] = self._page_tables(every, window_left)
        return self._tables[key]

    def _bias(self, bias: torch.Tensor, all_visible: bool):
        """``[B, Hkv, Tq, n]`` mask -> ``[B, Hkv, Tq * G or 1, n]`` (query rows ordered ``(t, g)``), ``None`` when
        every query sees every key."""
        if all_visible:
            return None
        B, Hkv, Tq, n = bias.shape
        if Tq == 1:
            return bias
        G = self.step.group
        return bias[:, :, :, None].expand(B, Hkv, Tq, G, n).reshape(B, Hkv, Tq * G, n)

    def _dense_rows(self, window_left: int):
        """Every key a dense layer reads: rows ``[B * Hkv * L]``, mask, ``L`` (once per step and window).

        With a window each row starts at the page of the first key its earliest query sees, so ``L`` is the
        longest window rounded out to whole pages, not the longest row: a sliding layer reads ``O(window)`` keys."""
        key = ("dense", window_left)
        if key not in self._tables:
            step, lens = self.step, self._lens
            S, Tq = step.page_size, step.num_query_tokens
            if window_left < 0:               # every page of the step: the tables a selecting layer uses too
                P = self._num_pages
                rows, bias = self._every_page(window_left)
            else:
                first = [max(n - Tq - window_left, 0) // S for n in lens]
                P = max((core.cdiv_pages(n, S) - f for n, f in zip(lens, first)), default=0)
                pages = (torch.tensor(first, dtype=torch.int64)[:, None] + torch.arange(P))[:, None, :]
                pages = pages.expand(step.batch, step.num_kv_heads, P).to(self.block_table.device)
                rows, bias = self._page_tables(pages, window_left)
            B, Hkv = step.batch, step.num_kv_heads
            all_visible = window_left < 0 and Tq == 1 and all(n == P * S for n in lens)
            bias = self._bias(bias.reshape(B, Hkv, Tq, P * S), all_visible)
            self._tables[key] = (rows.reshape(-1), bias, P * S)
        return self._tables[key]

    def _selected_rows(self, pages: torch.Tensor, window_left: int):
        """Rows and mask of the pages a selection kept (:meth:`select`, rank order), gathered from the step's tables
        of every page.

        Without a window the mask is the step's: in rank order each position holds a page of a known kind (recent
        pages first, then sinks, then scored pages, then pages past a short row's end; :func:`top_pages`), and
        only recent pages and invalid ones hide slots. So it is the mask of the template selection made with equal
        scores, gathered once per step; a window's mask depends on the pages and is gathered per call."""
        key = ("sparse", window_left)
        step = self.step
        B, Hkv, S, Tq = step.batch, step.num_kv_heads, step.page_size, step.num_query_tokens
        K = pages.shape[-1]
        if key not in self._tables:
            P = self._num_pages
            rows, bias = self._every_page(window_left)                        # [B, Hkv, P, S], [B, Hkv, Tq, P, S]
            fixed = None
            if window_left < 0:
                template = T.top_pages(torch.zeros(B, Hkv, P, device=rows.device), self._keys)      # [B, Hkv, K]
                fixed = self._gathered_bias(bias, template)
            self._tables[key] = (rows, bias, fixed)
        rows, bias, fixed = self._tables[key]
        rows = rows.gather(2, pages[..., None].expand(B, Hkv, K, S))                       # [B, Hkv, K, S]
        return rows.view(-1), fixed if fixed is not None else self._gathered_bias(bias, pages), K * S

    def _gathered_bias(self, bias: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
        """The ``[B, Hkv, Tq, P, S]`` mask table at ``pages`` ``[B, Hkv, K]``, as SDPA's ``[B, Hkv, M, K * S]``."""
        B, Hkv, Tq, _, S = bias.shape
        K = pages.shape[-1]
        bias = bias.gather(3, pages[:, :, None, :, None].expand(B, Hkv, Tq, K, S))        # [B, Hkv, Tq, K, S]
        return self._bias(bias.reshape(B, Hkv, Tq, K * S), False)

    def _listed_rows(self, page_indices: torch.Tensor, window_left: int):
        """Rows and mask of pages listed by a caller (canonical: ascending, ``-1`` padded)."""
        step = self.step
        B, Hkv, K = page_indices.shape
        rows, bias = self._page_tables(page_indices, window_left)
        bias = self._bias(bias.reshape(B, Hkv, step.num_query_tokens, K * step.page_size), False)
        return rows.reshape(-1), bias, K * step.page_size

    # ------------------------------------------------------------------------------------- attention
    def _attend(self, qg, k_cache, v_cache, rows, bias, n_keys: int, scale: float, scales, need_lse: bool):
        """Attention of ``qg`` ``[B, Hkv, M, D]`` over the pool ``rows``: ``(out [B, Hkv, M, D], lse or None)``."""
        B, Hkv, M, D = qg.shape
        chunk = chunked.chunk_keys(n_keys, B * Hkv, D, k_cache.element_size())
        if chunk is not None:                                          # a large step: in cache-sized chunks
            def gather(flat_rows, n):
                return self._gather_kv(k_cache, v_cache, flat_rows, n, qg.dtype, scales)
            return chunked.attend_chunked(qg, gather, rows.view(B, Hkv, n_keys), bias, scale, chunk)
        k, v = self._gather_kv(k_cache, v_cache, rows, n_keys, qg.dtype, scales)
        if need_lse or not _sdpa_zeroes_empty_rows():
            # the NaN-safe core with its lse (a query that sees no key: zeros and -inf)
            return core.attend_rows(qg, k, v, None if bias is None else bias == 0, scale)
        if bias is not None and bias.dtype != qg.dtype:    # fp64 SDPA with an fp32 mask is wrong on torch 2.13's CPU
            bias = bias.to(qg.dtype)
        return F.scaled_dot_product_attention(qg, k, v, attn_mask=bias, scale=scale), None

    def _gather_kv(self, k_cache, v_cache, rows, n_keys: int, dtype, scales=None):
        """K and V of the pool ``rows`` as ``[B, Hkv, n_keys, D]`` in the math ``dtype``; quantized pools
        (``scales = (k_scale, v_scale)``) are dequantized row by row: ``row.float() * scale[page, head]``."""
        step = self.step
        B, Hkv, D = step.batch, step.num_kv_heads, step.head_dim
        k = self._gather_rows("k", k_cache, rows)
        v = self._gather_rows("v", v_cache, rows)
        if scales is None and k.dtype == dtype:
            return k.view(B, Hkv, n_keys, D), v.view(B, Hkv, n_keys, D)
        if scales is not None:
            idx = quant.scale_rows(rows, step.page_size, Hkv)
            k = quant.dequantize_rows(k, scales[0], idx, dtype)
            v = quant.dequantize_rows(v, scales[1], idx, dtype)
        k, v = k.view(B, Hkv, n_keys, D), v.view(B, Hkv, n_keys, D)
        return (k, v) if k.dtype == dtype else (k.to(dtype), v.to(dtype))

    def _gather_rows(self, name: str, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``x`` viewed as ``[-1, D]``, rows ``rows``, into a workspace reused across layers and steps.

        A fresh large output at every call costs page faults that triple the gather time on a CPU; the
        gathered K/V only live until the attention of the same call returns.
        """
        flat = x.view(-1, x.shape[-1]) if x.is_contiguous() else x.reshape(-1, x.shape[-1])
        numel = rows.shape[0] * flat.shape[1]
        if numel < _WORKSPACE_MIN_BYTES // 8 or numel * flat.element_size() > _WORKSPACE_MAX_BYTES:
            return flat.index_select(0, rows)    # small: the workspace lookup costs more than it saves
        buf = self._buffers.get(name)
        if buf is None or buf.dtype != flat.dtype or buf.device != flat.device or buf.numel() < numel:
            buf = self._buffers[name] = torch.empty(numel, dtype=flat.dtype, device=flat.device)
        return torch.index_select(flat, 0, rows, out=buf[:numel].view(rows.shape[0], flat.shape[1]))

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

    def _run_query_blocks(self, window_left, q, k_cache, v_cache, return_lse, out, scale, scales):
        """:meth:`forward` of each query block (:meth:`_query_blocks`), outputs (and lse) concatenated over ``Tq``."""
        outs, lses = [], []
        for t0, t1, sub in self._blocks[window_left]:
            r = sub.forward(q[:, t0:t1], k_cache, v_cache, None, None, None, return_lse, None, scale, scales,
                            window_left)
            outs.append(r[0] if return_lse else r)
            if return_lse:
                lses.append(r[1])
        return core.finish_output(q, torch.cat(outs, 1), torch.cat(lses, 1) if return_lse else None, return_lse, out)
