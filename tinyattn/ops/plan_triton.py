"""The Triton backend's plan: a planned step run by the kernels of :mod:`tinyattn.kernels` (CUDA, or the CPU
interpreter under ``TRITON_INTERPRET=1``).

:meth:`TritonPlan.plan` copies the step's tables into int32 buffers of its own and sizes every workspace the
layers use (scores, selected pages, the two-stage selection's candidates, split-K partials, lse). Buffers are
allocated at capacity — the step's size, or ``max_batch`` x ``max_pages_per_seq`` when given (graph mode) — and
kept while later steps fit: a later :meth:`~TritonPlan.plan` only copies values into them, and
:meth:`~TritonPlan.forward` makes no allocation (with ``out=``), no host sync and no data-dependent shape, so a
CUDA graph can capture it and be replayed after each new plan.

Per layer: the Quest selection (fused bound + per-chunk top-k + merge when ``B * Hkv`` programs would leave the
GPU idle or rows are long, :mod:`tinyattn.kernels.chunk_topk`; else the bound kernel then the top-k kernel), then
the paged attention kernel (split-K over pages, merged by lse, when rows are few).
"""

from __future__ import annotations

import functools

import torch

from . import custom_ops
from .attention import torch_impl as attention_torch
from .attention import triton_impl as attention_triton
from .layout import num_candidates
from .plan_torch import TorchPlan
from .selection import torch_impl as selection_torch
from .selection import triton_impl as selection_triton
from .spans import span
from .step import Step
from ..kernels import attention as attention_blocks
from ..kernels import chunk_topk

__all__ = ["TritonPlan"]


class TritonPlan:
    """One step on the Triton backend; built by :class:`tinyattn.PagedAttentionPlan` (use that)."""

    def __init__(self):
        self._buffers: dict[str, torch.Tensor] = {}
        self._torch = self._torch_step = None        # fp64 steps run the torch backend's plan (see _fp64)

    # ------------------------------------------------------------------------------------------- plan
    def plan(self, step: Step, block_table: torch.Tensor, seq_lens: torch.Tensor, *, max_batch=None,
             max_pages_per_seq=None) -> None:
        """Copy the step's tables into the plan's buffers and size the workspaces (no host sync)."""
        self.step = step
        B, Hkv, Hq, Tq, D = step.batch, step.num_kv_heads, step.num_q_heads, step.num_query_tokens, step.head_dim
        graph = max_pages_per_seq is not None
        cap_b = max(max_batch or B, B)
        width = max_pages_per_seq if graph else step.max_pages          # graph mode: one width for every step
        self._graph = graph
        bt = self._buffer("block_table", (cap_b, width), torch.int32)[:B]
        if width > step.max_pages:
            bt[:, step.max_pages:].fill_(-1)                       # past every row's end: ignored by the kernels
        bt[:, : step.max_pages].copy_(block_table)
        self._bt32 = bt
        self._sl32 = self._buffer("seq_lens", (cap_b,), torch.int32)[:B]
        self._sl32.copy_(seq_lens)
        self.block_table, self.seq_lens = self._bt32, self._sl32
        self._scores = self._buffer("scores", (cap_b, Hkv, width), torch.float32)[:B]
        self._lse = self._buffer("lse", (cap_b, Tq, Hq), torch.float32)[:B]
        budget = step.page_budget
        self._selected = None if budget is None else self._buffer("selected", (cap_b, Hkv, budget), torch.int32)[:B]
        # top-p prunes the capacity selection into a second buffer (the filter reads one and writes the other)
        self._top_p = step.top_p if budget is not None and step.top_p is not None and step.top_p < 1.0 else None
        self._kept = None if self._top_p is None else self._buffer("kept", (cap_b, Hkv, budget), torch.int32)[:B]
        # the re-rank (rerank='int4'): the estimate's candidates, then their log-mass, selected again
        self._rerank = budget is not None and step.rerank is not None
        if self._rerank:
            n_cand = num_candidates(budget, step.candidates, width)
            self._candidates = self._buffer("candidates", (cap_b, Hkv, n_cand), torch.int32)[:B]
            self._mass = self._buffer("mass", (cap_b, Hkv, width), torch.float32)[:B]
        self._last = None            # the buffer the last selecting run attended (see last_selection)
        # selection in two stages (kernels/chunk_topk.py) when B * Hkv programs would leave the GPU idle or rows
        # are long; its candidate workspace is allocated here, never in forward()
        self._chunks = None
        if budget is not None:
            num_sms = attention_blocks.num_sms(step.device)
            if not self._rerank and chunk_topk.use_two_stage(cap_b, Hkv, width, budget, num_sms):
                self._chunks = chunk_topk.chunk_blocks(cap_b, Hkv, width, budget, Tq, Hq // Hkv, D, step.page_size,
                                                         num_sms)
                shape = chunk_topk.workspace_shape(cap_b, Hkv, self._chunks)
                self._ws_key = self._buffer("ws_key", shape, torch.int32)[:B]
                self._ws_page = self._buffer("ws_page", shape, torch.int32)[:B]
        splits = {}
        for sparse in (False, True):
            if (sparse and budget is None) or step.nothing:     # nothing to split (B or Tq = 0)
                splits[sparse] = 1
                continue
            n_list = budget if sparse else width
            splits[sparse] = attention_blocks.plan_num_splits(cap_b, Tq, Hq, Hkv, D, step.page_size, n_list,
                                                              step.device)
        self._splits = splits
        n = max(splits.values())
        self._ws_o = self._buffer("ws_o", (n, cap_b, Tq, Hq, D), torch.float32)[:, :B] if n > 1 else None
        self._ws_lse = self._buffer("ws_lse", (n, cap_b, Tq, Hq), torch.float32)[:, :B] if n > 1 else None

    def _buffer(self, name: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """A buffer kept across plans while it is large enough (same storage: a captured graph stays valid)."""
        numel = 1
        for n in shape:
            numel *= n
        buf = self._buffers.get(name)
        if buf is None or buf.dtype != dtype or buf.device != self.step.device or buf.numel() < numel:
            buf = self._buffers[name] = torch.empty(max(numel, 1), dtype=dtype, device=self.step.device)
        return buf[:numel].view(shape)

    # ------------------------------------------------------------------------------------------- run
    def run(self, q, k_cache, v_cache, k_min, k_max, page_indices, return_lse, out, scale, scales, window_left,
            k_code=None):
        """Attention of one layer; see :meth:`tinyattn.PagedAttentionPlan.run`. With autograd (or while
        ``torch.compile`` traces): the plan's selection, then the custom op with its backward kernel
        (:func:`tinyattn.ops.custom_ops.differentiable`); else :meth:`forward`."""
        if torch.compiler.is_compiling() or custom_ops.needs_grad(q, k_cache, v_cache):
            step = self.step
            o, lse = custom_ops.differentiable(
                q, k_cache, v_cache, self.block_table, self.seq_lens, page_size=step.page_size, backend=step.backend,
                scale=scale, window_left=window_left, k_min=k_min, k_max=k_max, page_indices=page_indices,
                selection=step.selection if step.selects else None, scales=scales, nothing=step.nothing,
                select=None if torch.compiler.is_compiling() else functools.partial(self.select,
                                                                                      codes=self._codes(k_code,
                                                                                                        k_cache,
                                                                                                        scales)))
            return attention_torch.finish_output(q, o, lse, return_lse, out)
        return self.forward(q, k_cache, v_cache, k_min, k_max, page_indices, return_lse, out, scale, scales,
                            window_left, k_code)

    @staticmethod
    def _codes(k_code, k_cache, scales):
        """What the re-rank reads besides the boxes: ``(k_code, k_cache, k_scale)``, or ``None`` without codes."""
        return None if k_code is None else (k_code, k_cache, None if scales is None else scales[0])

    def forward(self, q, k_cache, v_cache, k_min, k_max, page_indices, return_lse, out, scale, scales,
                window_left, k_code=None):
        """Attention of one layer with no autograd (the kernels)."""
        step = self.step
        q4 = q.unsqueeze(1) if q.dim() == 3 else q
        if q4.dtype == torch.float64:      # the kernels compute in fp32 at most: fp64 runs the reference-exact path
            return self._fp64(q, k_cache, v_cache, k_min, k_max, page_indices, return_lse, out, scale, scales,
                              window_left, k_code)
        if page_indices is not None and page_indices.shape[-1]:
            # ascending, de-duplicated, -1 past the end: duplicates never count twice (DESIGN.md §3)
            page_indices = selection_torch.canonical_page_indices(page_indices, self.seq_lens, step.page_size)
        if step.nothing or k_cache.shape[0] == 0 or (page_indices is not None and page_indices.shape[-1] == 0):
            o, lse = attention_torch.empty_attention(q4, k_cache, v_cache)
            return attention_torch.finish_output(q, o, lse, return_lse, out)
        selection = None              # the rules the pages were chosen under (read by the profiler's oracle)
        if k_min is not None and step.selects:
            page_indices = self.select(q4, k_min, k_max, window_left, scale=scale,
                                       codes=self._codes(k_code, k_cache, scales))
            selection = step.selection
        elif page_indices is not None:
            selection = dict(step.selection, page_budget=page_indices.shape[-1])
        with span("attention", q=q4, k_cache=k_cache, block_table=self.block_table, seq_lens=self.seq_lens,
                  page_indices=page_indices, scale=scale, selection=selection, window_left=window_left):
            o = out if out is not None else torch.empty_like(q4)
            o4 = o.unsqueeze(1) if o.dim() == 3 else o
            sparse = page_indices is not None
            if sparse and page_indices is not self._selected:
                page_indices = page_indices.to(torch.int32).contiguous()
            lse = torch.empty_like(self._lse) if return_lse else self._lse   # the caller keeps a returned lse
            splits = self._splits[False] if not sparse else (
                self._splits[True] if page_indices.shape[-1] == (step.page_budget or -1) else None)
            attention_triton.paged_attention(q4, k_cache, v_cache, self._bt32, self._sl32, page_indices=page_indices,
                                       scale=scale, out=o4, lse=lse, num_splits=splits,
                                       ws_o=self._ws_o, ws_lse=self._ws_lse,
                                       k_scale=None if scales is None else scales[0],
                                       v_scale=None if scales is None else scales[1], window_left=window_left)
        return attention_torch.finish_output(q, o4, lse, return_lse, out)

    def select(self, q4, k_min, k_max, window_left: int = -1, qg=None, scale: float | None = None,
               codes=None) -> torch.Tensor:
        """Logical pages ``[B, Hkv, page_budget]`` (ascending, ``-1`` padded) of the Quest selection, written into
        the plan's selection buffer (rewritten by the next layer's call). With top-p the capacity selection is then
        pruned into a second buffer (``kernels/topk.py::top_p_filter_kernel``; the two-stage path has its stage 1
        write every valid page's score for it); ``scale``: the softmax scale of its mass (``None``: the plan's).
        With ``rerank`` (``codes = (k_code, k_cache, k_scale)``): :meth:`_select_reranked`."""
        step = self.step
        if self._rerank:
            return self._select_reranked(q4, k_min, k_max, window_left, scale, codes)
        opts = dict(page_size=step.page_size, page_budget=step.page_budget, num_sink_pages=step.num_sink_pages,
                    num_recent_pages=step.num_recent_pages)
        with span("score", q=q4, k_min=k_min, block_table=self.block_table, seq_lens=self.seq_lens,
                  page_size=step.page_size):
            if self._chunks is not None:       # fused bound + per-chunk top-k
                selection_triton.score_chunks(q4, k_min, k_max, self._bt32, self._sl32, ws_key=self._ws_key,
                                              ws_page=self._ws_page, window_left=window_left, meta=self._chunks,
                                              gamma=step.gamma, scores=None if self._top_p is None else self._scores,
                                              **opts)
            else:
                selection_triton.page_scores(q4, k_min, k_max, self._bt32, self._sl32, page_size=step.page_size,
                                             out=self._scores, gamma=step.gamma)
                if window_left >= 0:
                    selection_torch.mask_pages_before_window(self._scores, self._sl32, step.page_size,
                                                             step.num_query_tokens, window_left)
        with span("topk", scores=self._scores, seq_lens=self.seq_lens, page_budget=step.page_budget):
            if self._chunks is not None:       # merge of the chunks' candidates
                selection_triton.merge_chunks(self._ws_key, self._ws_page, self._sl32, max_pages=self._bt32.shape[1],
                                          num_query_tokens=step.num_query_tokens, out=self._selected,
                                          meta=self._chunks, **opts)
            else:
                selection_triton.select_pages(self._scores, self._sl32, num_query_tokens=step.num_query_tokens,
                                              out=self._selected, **opts)
            if self._top_p is None:
                self._last = self._selected
                return self._selected
            selection_triton.top_p_filter(self._scores, self._selected, self._sl32, page_size=step.page_size,
                                          num_sink_pages=step.num_sink_pages, num_recent_pages=step.num_recent_pages,
                                          num_query_tokens=step.num_query_tokens, top_p=self._top_p,
                                          scale=step.scale if scale is None else scale, out=self._kept)
        self._last = self._kept
        return self._kept

    def _select_reranked(self, q4, k_min, k_max, window_left: int, scale, codes) -> torch.Tensor:
        """The re-ranked selection (issue 35's second stage), five launches into the plan's buffers: the estimate's
        scores, its ``ceil(candidates · page_budget)`` best pages (``kernels/topk.py``), their log attention mass
        from 4-bit keys (``kernels/rerank.py``), the selection over that mass, and top-p (softmax scale 1: the
        scores are log-masses). Fixed shapes, no host sync."""
        step = self.step
        if codes is None:
            raise ValueError("k_code: expected the pool's 4-bit key codes for a plan with rerank='int4' (PagedKVCache("
                             "..., key_codes=True).k_code[layer]), got None")
        k_code, k_cache, k_scale = codes
        opts = dict(page_size=step.page_size, num_sink_pages=step.num_sink_pages,
                    num_recent_pages=step.num_recent_pages, num_query_tokens=step.num_query_tokens)
        with span("score", q=q4, k_min=k_min, block_table=self.block_table, seq_lens=self.seq_lens,
                  page_size=step.page_size):
            selection_triton.page_scores(q4, k_min, k_max, self._bt32, self._sl32, page_size=step.page_size,
                                         out=self._scores, gamma=step.gamma)
            if window_left >= 0:
                selection_torch.mask_pages_before_window(self._scores, self._sl32, step.page_size,
                                                         step.num_query_tokens, window_left)
            selection_triton.select_pages(self._scores, self._sl32, page_budget=self._candidates.shape[-1],
                                          out=self._candidates, **opts)
            selection_triton.rerank_scores(q4, k_code, k_cache, k_min, k_max, self._candidates, self._bt32,
                                           self._sl32, page_size=step.page_size,
                                           scale=step.scale if scale is None else scale, out=self._mass,
                                           window_left=window_left, k_scale=k_scale)
        with span("topk", scores=self._mass, seq_lens=self.seq_lens, page_budget=step.page_budget):
            selection_triton.select_pages(self._mass, self._sl32, page_budget=step.page_budget, out=self._selected,
                                          **opts)
            if self._top_p is None:
                self._last = self._selected
                return self._selected
            selection_triton.top_p_filter(self._mass, self._selected, self._sl32, top_p=self._top_p, scale=1.0,
                                          out=self._kept, **opts)
        self._last = self._kept
        return self._kept

    def last_selection(self) -> torch.Tensor | None:
        """The pages the last selecting run attended (ascending, ``-1`` padded), or ``None``."""
        if self._torch is not None and self._torch_step is self.step and self._torch._last is not None:
            return self._torch.last_selection()                 # an fp64 step ran the torch plan
        return self._last

    def _fp64(self, q, k_cache, v_cache, k_min, k_max, page_indices, return_lse, out, scale, scales, window_left,
              k_code=None):
        """fp64 inputs on the Triton backend run the torch backend's plan (the kernels compute in fp32 at most)."""
        if self._torch is None:
            self._torch = TorchPlan()                  # kept across steps, as its workspaces are
        if self._torch_step is not self.step:
            self._torch.plan(self.step, self._bt32, self._sl32)
            self._torch_step = self.step
        return self._torch.run(q, k_cache, v_cache, k_min, k_max, page_indices, return_lse, out, scale, scales,
                               window_left, k_code)
