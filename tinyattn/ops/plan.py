"""Plan once per step, run per layer: the decode path of tinyattn (FlashInfer's plan/run pattern).

A decode step runs the same attention geometry in every layer: the same ``block_table``, ``seq_lens``,
head counts and selection rules, only ``q`` and the layer's pool change. :class:`PagedAttentionPlan`
does everything that depends on the step alone once, in :meth:`~PagedAttentionPlan.plan`:

- validates the tables and options (at most one host sync, none with ``trusted=True``);
- converts the tables (int32 for the Triton kernels; flat pool-row indices, masks and the forced-page
  keys of the selection for the torch backend);
- preallocates what the layers reuse: scores, selected pages, the two-stage selection's candidate workspace,
  split-K partials, lse.

:meth:`~PagedAttentionPlan.run` then does, per layer, only the arithmetic: no validation of step data, no
host sync, no allocation whose size depends on values. With the Triton backend and ``out=`` given it
allocates nothing at all, so a CUDA graph can capture it. The public :func:`tinyattn.paged_attention` and
:func:`tinyattn.sparse_paged_attention` are a plan and one run.

Example (one decode step of a model with ``L`` layers)::

    plan = tinyattn.PagedAttentionPlan()                      # keep it: buffers are reused across steps
    plan.plan(block_table, seq_lens, num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
              page_budget=128, dtype=torch.bfloat16)          # once per step
    for layer in range(L):
        out = plan.run(q[layer], k_cache[layer], v_cache[layer],
                       k_min=k_min[layer], k_max=k_max[layer])  # Quest selection, then sparse attention
        dense = plan.run(q[layer], k_cache[layer], v_cache[layer])  # no boxes: dense over every valid page
        local = plan.run(q[layer], k_cache[layer], v_cache[layer], window_left=4095)  # sliding window of 4096

Sliding windows are a :meth:`~PagedAttentionPlan.run` argument (``window_left``, FlashInfer's convention), so
layers with different windows (Mistral / Gemma hybrids) share one plan; the torch backend builds the index
tables of each window once per step, the Triton kernels take the window as a runtime argument.

On CPU tensors the torch backend runs decode-sized steps (up to 16 queries per row, no autograd, float pools) in
the compiled CPU kernel (:mod:`tinyattn.kernels_cpu`: scoring, top-k and attention in one call); everything else,
and every step where the kernel is unavailable or :func:`tinyattn.kernels_cpu.disabled`, runs the PyTorch
implementation, which gathers the rows of the keys a step reads with one ``index_select`` per tensor
and runs :func:`torch.nn.functional.scaled_dot_product_attention` over them (grouped query heads folded
into the rows of their KV head), so that a decode step costs a handful of PyTorch calls. Selection is a
stable descending sort of the Quest bound with forced pages keyed above every score: ties go to the lower
page index, NaN counts as ``-inf``, exactly as :func:`tinyattn.select_pages`.

Method: Quest (Tang et al., ICML 2024, §3.2-3.3), TinyServe (Liu & Yu, arXiv 2509.12211, eq. 2).
Pattern: FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper.plan`` / ``run``.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import torch.nn.functional as F

from . import chunked, core, quant, tables
from . import validation as V
from .autograd import attention as differentiable_attention, needs_grad
from .spans import span
from . import spans as _spans

__all__ = ["PagedAttentionPlan", "resolve_backend", "BACKENDS"]

BACKENDS = ("torch", "triton")
_FLT_MAX = torch.finfo(torch.float32).max
_SINK_KEY = _FLT_MAX             # forced keys: recent pages (+inf) > sink pages (FLT_MAX) > every score
_SCORE_CAP = 3.0e38              # real +inf bounds are capped below the sink key
_WORKSPACE_MAX_BYTES = 512 * 2**20       # gathers above this size are not kept between calls
_WORKSPACE_MIN_BYTES = 256 * 2**10       # ... nor those below (no page faults to save)
_WINDOW_QUERY_BLOCK = 256                # a windowed prefill runs in query blocks of max(this, window) tokens
_POOL_SCORES_BYTES = 64 * 2**20          # pool-wide scoring while its [Hkv, B*M, num_pages] bounds fit this
_EXACT = (torch.float32, torch.float64)   # dtypes the torch path computes in directly (others: fp32)


_INTERPRET: bool | None = None


def _interpreting() -> bool:
    """TRITON_INTERPRET=1? Read once (the variable only counts when set before triton is imported); code that
    sets it later, as the CLI does for ``--backend triton`` on a CPU, resets ``_INTERPRET`` to ``None``."""
    global _INTERPRET
    if _INTERPRET is None:
        _INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
    return _INTERPRET


def resolve_backend(backend, device: torch.device) -> str:
    """``"triton"`` for CUDA tensors or under ``TRITON_INTERPRET=1``, else ``"torch"``; validate a forced one."""
    if backend is None:
        return "triton" if device.type == "cuda" or _interpreting() else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS} or None, got {backend!r}")
    if backend == "triton" and device.type != "cuda" and not _interpreting():
        raise ValueError(f"backend: 'triton' needs CUDA tensors or TRITON_INTERPRET=1 set before triton is "
                         f"imported, got tensors on {device}")
    return backend


@functools.lru_cache(maxsize=None)
def _sdpa_zeroes_empty_rows() -> bool:
    """Whether this torch's SDPA returns 0 (not NaN) for a query whose keys are all masked (torch >= 2.5)."""
    q = torch.ones(1, 1, 1, 2)
    mask = torch.full((1, 1, 1, 1), float("-inf"))
    out = F.scaled_dot_product_attention(q, q[:, :, :1], q[:, :, :1], attn_mask=mask)
    return bool((out == 0).all())


def _kernels():
    from .. import kernels        # imported lazily: a CPU-only user never needs triton
    return kernels


class PagedAttentionPlan:
    """Per-step plan of paged (dense or query-aware sparse) attention; reusable across steps.

    Args:
        backend: ``None`` (by device: Triton for CUDA tensors or under ``TRITON_INTERPRET=1``, torch
            otherwise), ``"torch"`` or ``"triton"``.

    Call :meth:`plan` once per step, then :meth:`run` once per layer. A plan is not thread-safe, and the
    tensors given to :meth:`plan` must not change until the last :meth:`run` of the step.
    """

    def __init__(self, *, backend: str | None = None):
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {BACKENDS} or None, got {backend!r}")
        self._backend_arg = backend
        self._buffers: dict[str, torch.Tensor] = {}
        self._block_plans: list = []      # sub-plans of long windowed prefills (their buffers reused across steps)
        # the page-level tables of the last step (tables.sparse_tables / dense_tables): reused while pages stand
        self._page_memo: dict = {}
        self._dense_memo: dict = {}       # window_left -> that window's page-level memo
        self._planned = False

    def __repr__(self) -> str:
        if not self._planned:
            return "PagedAttentionPlan(not planned)"
        return (f"PagedAttentionPlan(backend={self.backend!r}, batch={self.batch}, "
                f"num_query_tokens={self.num_query_tokens}, heads={self.num_q_heads}/{self.num_kv_heads}, "
                f"head_dim={self.head_dim}, page_size={self.page_size}, page_budget={self.page_budget})")

    # ------------------------------------------------------------------------------------------- plan
    def plan(self, block_table: torch.Tensor, seq_lens: torch.Tensor, *, num_q_heads: int, num_kv_heads: int,
             head_dim: int, page_size: int, num_query_tokens: int = 1, page_budget: int | None = None,
             num_sink_pages: int = 0, num_recent_pages: int = 1, scale: float | None = None,
             num_pages: int | None = None, trusted: bool = False) -> "PagedAttentionPlan":
        """Validate and convert the step's tables and settings; returns ``self``.

        Args:
            block_table: ``[B, max_pages_per_seq]`` int32 (int64 accepted): physical page of each logical page.
            seq_lens: ``[B]`` int32 (int64 accepted): valid tokens per row including the ``Tq`` queries.
            num_q_heads, num_kv_heads, head_dim: ``Hq`` (a multiple of ``Hkv``), ``Hkv``, ``D``.
            page_size: tokens per page (a power of two for the Triton backend).
            num_query_tokens: ``Tq``, queries per row (1 = decode); causal bottom-right.
            page_budget: pages kept per (row, KV head) when :meth:`run` selects (``None``: :meth:`run` with
                boxes is dense). num_sink_pages, num_recent_pages: pages always kept (see
                :func:`tinyattn.select_pages`); ``num_sink_pages + max(num_recent_pages, 1) <= page_budget``.
            scale: softmax scale, default ``head_dim ** -0.5``.
            num_pages: pages in the pool the layers' caches hold; when given, the block-table ids of valid
                pages are checked against it (else only against the id dtype).
            trusted: skip the data-dependent checks (``seq_lens`` within the table, page ids in range),
                e.g. for tables made by :class:`tinyattn.PagedKVCache`: then planning makes no host sync.

        Raises:
            TypeError / ValueError naming the argument, the expected and the actual value.
        """
        self._planned = False         # until this step's checks pass: a plan that failed must not run the last step
        for name, value, low in (("num_q_heads", num_q_heads, 1), ("num_kv_heads", num_kv_heads, 1),
                                 ("head_dim", head_dim, 1), ("page_size", page_size, 1),
                                 ("num_query_tokens", num_query_tokens, 0)):
            V.expect_int(name, value, low)
        if num_pages is not None:
            V.expect_int("num_pages", num_pages, 0)
        if num_q_heads % num_kv_heads:
            raise ValueError(f"num_q_heads: expected a multiple of num_kv_heads={num_kv_heads}, got {num_q_heads}")
        V.check_tables(block_table, seq_lens, None, block_table.device if isinstance(block_table, torch.Tensor)
                       else None)
        if page_budget is not None:
            page_budget, num_sink_pages, num_recent_pages = V.check_selection_options(
                page_budget, num_sink_pages, num_recent_pages)
        self.backend = resolve_backend(self._backend_arg, block_table.device)
        if self.backend == "triton":
            V.check_kernel_page_size(page_size)
        self.scale = V.check_scale(scale, head_dim)
        self.device = block_table.device
        self.batch, self.max_pages = block_table.shape
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.page_size, self.num_query_tokens = page_size, num_query_tokens
        self.page_budget, self.num_sink_pages, self.num_recent_pages = page_budget, num_sink_pages, num_recent_pages
        self.block_table, self.seq_lens = block_table, seq_lens
        # the torch backend builds its index tables on the host (one device -> host copy off the CPU); on the CPU
        # the copy waits for the PyTorch path's first use (_host_tables): the compiled kernel reads the tensors
        self._host = None
        if self.backend == "torch":
            self._host = (tables.host_copy(block_table), tables.host_copy(seq_lens))
            self._lens = self._host[1].tolist()
        else:
            self._lens = None if trusted and self.device.type != "cpu" else seq_lens.tolist()
        self._max_page_id = None            # the largest page id the tables use, when checked (run compares)
        if not trusted:
            self._check_values(num_pages)
        elif page_budget is not None and num_query_tokens > 1 and self._lens is not None:
            V.check_query_pages_fit_host(self._lens, num_query_tokens, page_size, page_budget)  # no sync: host lengths
        self._sparse = self._last_selection = None   # torch-backend tables, built on first use
        self._dense: dict = {}                       # window_left -> dense tables of the step (torch backend)
        self._window_blocks: dict = {}               # window_left -> [(t0, t1, plan)] of a long windowed prefill
        self._nothing = (self.batch == 0 or num_query_tokens == 0 or self.max_pages == 0
                         or (self._lens is not None and not any(self._lens)))        # no key anywhere
        self._selects = self.selects
        self._fast_ok = not self._nothing and _sdpa_zeroes_empty_rows()
        if self.backend == "triton":
            self._plan_triton()
        self._planned = True
        return self

    def rebind(self, block_table: torch.Tensor, seq_lens: torch.Tensor) -> "PagedAttentionPlan":
        """Point the plan at new tensors holding the same values as the planned ones (their tables stand)."""
        self.block_table, self.seq_lens = block_table, seq_lens
        if self.backend == "triton":
            self._bt32 = block_table.to(torch.int32).contiguous()
            self._sl32 = seq_lens.to(torch.int32).contiguous()
        return self

    def _check_values(self, num_pages: int | None) -> None:
        """Data-dependent checks (one host sync): the ops' own, so that the errors read the same."""
        with V.value_checks(True):
            self._max_page_id = V.check_table_values(self.block_table, self.seq_lens, self.page_size, num_pages)
            if self.page_budget is not None:
                V.check_query_pages_fit(self.seq_lens, self.num_query_tokens, self.page_size, self.page_budget)

    @property
    def selects(self) -> bool:
        """True when :meth:`run` with boxes really selects: some row holds more pages than ``page_budget``.

        ``False`` when every row fits its budget (the sparse step is then the dense one, and :meth:`run`
        skips scoring and top-k), or with no budget.
        """
        if self.page_budget is None:
            return False
        if self._lens is None:
            return True
        return max((core.cdiv_pages(n, self.page_size) for n in self._lens), default=0) > self.page_budget

    # -------------------------------------------------------------------------------------------- run
    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *, k_min=None, k_max=None,
            page_indices=None, return_lse: bool = False, out: torch.Tensor | None = None,
            scale: float | None = None, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
            window_left: int = -1):
        """Attention of one layer under this plan.

        Args:
            q: ``[B, Hq, D]`` (decode) or ``[B, Tq, Hq, D]``, the dtype of the pool.
            k_cache, v_cache: ``[num_pages, page_size, Hkv, D]`` this layer's pool.
            k_min, k_max: ``[num_pages, Hkv, D]`` page boxes: select ``page_budget`` pages by the Quest bound
                (when the plan has a budget and some row exceeds it), then attend to them.
            page_indices: ``[B, Hkv, K]`` logical pages chosen elsewhere (e.g. a selection policy), ``-1``
                padded, no duplicates; exclusive with ``k_min``/``k_max``. Neither: dense attention.
            return_lse: also return fp32 lse ``[B, Hq]`` / ``[B, Tq, Hq]`` (natural log, ``-inf`` where a
                query sees no key).
            out: optional output tensor like ``q`` (Triton backend: then ``run`` allocates nothing).
            scale: this layer's softmax scale when it differs from the plan's (e.g. GPT-2's per-layer
                scaling); ``None``: the plan's.
            k_scale, v_scale: fp32 ``[num_pages, Hkv]`` scales of int8 / float8_e4m3fn pools
                (:class:`tinyattn.PagedKVCache` ``k_scale[layer]`` / ``v_scale[layer]``); the torch backend
                dequantizes the rows it gathers (``row.float() * scale``). ``k_min``/``k_max`` are then fp32.
            window_left: this layer's sliding window, FlashInfer's convention: a query at position ``p`` sees the
                keys at positions ``[p - window_left, p]``; ``-1`` (default) = no window. Dense runs read only
                the pages that overlap a window; a selection by boxes ranks the pages wholly before the earliest
                query's window last (``-inf``) and needs ``num_sink_pages = 0``; listed ``page_indices`` are
                attended within the window.

        Nothing is validated here (see :meth:`plan`) beyond the shapes, the dtypes (``TypeError`` for an integer
        ``q``, a ``v_cache`` of another dtype than ``k_cache``, a ``k_max`` of another dtype than ``k_min``) and the
        KV format (a quantized pool needs its scales, ``[num_pages, Hkv]``, and the torch backend: else
        ``ValueError``); differentiable in
        ``q``, ``k_cache``, ``v_cache`` (float pools).
        """
        if not self._planned:
            raise RuntimeError("PagedAttentionPlan.run: call plan(block_table, seq_lens, ...) first (once per step)")
        if k_cache.dim() != 4 or tuple(k_cache.shape[1:]) != (self.page_size, self.num_kv_heads, self.head_dim):
            raise ValueError(f"k_cache: expected [num_pages, page_size={self.page_size}, Hkv={self.num_kv_heads}, "
                             f"D={self.head_dim}] (the plan's), got {tuple(k_cache.shape)}")
        self._check_run_shapes(q, k_cache, v_cache, k_min, k_max, page_indices, out)
        if q.shape[0] != self.batch or q.shape[-2] != self.num_q_heads or q.shape[-1] != self.head_dim or (
                q.dim() == 4 and q.shape[1] != self.num_query_tokens) or (q.dim() == 3 and self.num_query_tokens != 1):
            raise ValueError(f"q: expected shape [B={self.batch}, Hq={self.num_q_heads}, D={self.head_dim}] or "
                             f"[B, Tq={self.num_query_tokens}, Hq, D] (the plan's), got {tuple(q.shape)}")
        if not q.is_floating_point():
            raise TypeError(f"q: expected a floating dtype (fp32 / bf16 / fp16 / fp64), got {q.dtype}")
        window_left = V.check_window_left(window_left)
        if scale is not None and scale != self.scale:
            saved, self.scale = self.scale, float(scale)
            try:
                return self.run(q, k_cache, v_cache, k_min=k_min, k_max=k_max, page_indices=page_indices,
                                return_lse=return_lse, out=out, k_scale=k_scale, v_scale=v_scale,
                                window_left=window_left)
            finally:
                self.scale = saved
        if window_left >= 0 and k_min is not None and self.page_budget is not None:
            V.check_window_selection(window_left, self.num_sink_pages)
        windowed_selection = window_left >= 0 and k_min is not None and self._selects
        if k_scale is not None or v_scale is not None or k_cache.dtype in V.QUANTIZED_DTYPES:
            self._check_kv_format(q, k_cache, v_cache, k_scale, v_scale)
            scales = (k_scale, v_scale)
            if needs_grad(q) or torch.compiler.is_compiling():      # the custom op reads float pools
                dt = q.dtype if self.backend == "triton" or q.dtype == torch.float64 else torch.float32
                k_cache, v_cache = quant.dequantize(k_cache, k_scale, dt), quant.dequantize(v_cache, v_scale, dt)
                scales = None
        else:
            scales = None
        blocks = self._query_blocks(window_left, q, k_cache, v_cache, k_min, page_indices, windowed_selection)
        if blocks is not None:
            return self._run_query_blocks(blocks, q, k_cache, v_cache, window_left, return_lse, out, k_scale, v_scale)
        if (_spans.recorder is None and self.backend == "torch" and not return_lse and out is None
                and not (torch.is_grad_enabled() and (q.requires_grad or k_cache.requires_grad
                                                      or v_cache.requires_grad))
                and page_indices is None and self._fast_ok and not windowed_selection
                and not torch.compiler.is_compiling()):
            return self._run_torch_fast(q, k_cache, v_cache, k_min, k_max, scales, window_left)  # decode hot path
        q4 = q.unsqueeze(1) if q.dim() == 3 else q
        if page_indices is not None and page_indices.shape[-1]:
            # ascending, de-duplicated, -1 past the end: duplicates never count twice (DESIGN.md §3)
            page_indices = core.canonical_page_indices(page_indices, self.seq_lens, self.page_size)
        if self._nothing or k_cache.shape[0] == 0 or (page_indices is not None and page_indices.shape[-1] == 0):
            return self._finish(q, *_empty_attention(q4, k_cache, v_cache), return_lse, out)
        selection = None
        if k_min is not None and self._selects:
            page_indices = self._select(q4.detach(), k_min, k_max, window_left)
            selection = dict(page_budget=self.page_budget, num_sink_pages=self.num_sink_pages,
                             num_recent_pages=self.num_recent_pages)
        elif page_indices is not None:
            selection = dict(page_budget=page_indices.shape[-1], num_sink_pages=self.num_sink_pages,
                             num_recent_pages=self.num_recent_pages)
        with span("attention", q=q4, k_cache=k_cache, block_table=self.block_table, seq_lens=self.seq_lens,
                  page_indices=page_indices, scale=self.scale, selection=selection, window_left=window_left):
            if needs_grad(q4, k_cache, v_cache) or torch.compiler.is_compiling():
                result = self._differentiable(q4, k_cache, v_cache, page_indices, window_left)
            elif self.backend == "triton" and q4.dtype != torch.float64:
                result = self._attend_triton(q4, k_cache, v_cache, page_indices, out, return_lse, scales,
                                             window_left)
            else:
                result = self._attend_torch(q4, k_cache, v_cache, page_indices, return_lse, scales, window_left)
        return self._finish(q, *result, return_lse, out)

    def _check_kv_format(self, q, k_cache, v_cache, k_scale, v_scale) -> None:
        """A quantized pool: same format for K and V, scales ``[num_pages, Hkv]`` fp32, a backend that reads it."""
        if v_cache.dtype != k_cache.dtype or v_cache.shape != k_cache.shape:
            raise ValueError(f"v_cache: expected dtype {k_cache.dtype} and shape {tuple(k_cache.shape)} (those of "
                             f"k_cache), got {v_cache.dtype} and {tuple(v_cache.shape)}")
        V.check_kv_format(q, k_cache, v_cache, k_scale, v_scale)
        V.check_kv_backend(k_cache, self.backend)

    def _check_run_shapes(self, q, k_cache, v_cache, k_min, k_max, page_indices, out) -> None:
        """The shape checks of :meth:`run` (host ints only, no sync): a pool or box of another shape would be read
        out of bounds by a kernel."""
        if v_cache.shape != k_cache.shape:
            raise ValueError(f"v_cache: expected shape {tuple(k_cache.shape)} (that of k_cache), got "
                             f"{tuple(v_cache.shape)}")
        if v_cache.dtype != k_cache.dtype:
            raise TypeError(f"v_cache: expected dtype {k_cache.dtype} (that of k_cache), got {v_cache.dtype}")
        if k_min is not None and k_max is not None and k_max.dtype != k_min.dtype:
            raise TypeError(f"k_max: expected dtype {k_min.dtype} (that of k_min), got {k_max.dtype}")
        if self._max_page_id is not None and self._max_page_id >= k_cache.shape[0]:
            raise ValueError(f"block_table: expected physical page ids in [0, {k_cache.shape[0]}) (the pages of "
                             f"k_cache), got {self._max_page_id}")
        if (k_min is None) != (k_max is None):
            raise ValueError(f"k_min, k_max: expected both or neither, got k_min={'None' if k_min is None else 'a tensor'}"
                             f" and k_max={'None' if k_max is None else 'a tensor'}")
        if k_min is not None:
            if page_indices is not None:
                raise ValueError("page_indices: expected either page_indices or k_min/k_max (exclusive), got both")
            box = (k_cache.shape[0], self.num_kv_heads, self.head_dim)
            for name, x in (("k_min", k_min), ("k_max", k_max)):
                if tuple(x.shape) != box:
                    raise ValueError(f"{name}: expected shape {box} [num_pages, Hkv, D], got {tuple(x.shape)}")
        if out is not None and out.shape != q.shape:
            raise ValueError(f"out: expected shape {tuple(q.shape)} (that of q), got {tuple(out.shape)}")

    def _query_blocks(self, window_left, q, k_cache, v_cache, k_min, page_indices, windowed_selection):
        """The query blocks of a long windowed dense prefill on the torch backend (CPU), or ``None``.

        A sliding layer's query ``t`` only needs the keys ``[p - window_left, p]``; one gather for all ``Tq``
        queries would read (and mask) ``Tq x L`` logits. Cut into blocks of ``Qb = max(256, window_left + 1)``
        queries, each block is planned as its own step whose rows end at its last query (``seq_lens - (Tq -
        t1)``: the same positions, so the same mask), and reads at most ``window_left + Qb`` keys: ``O(Tq · W)``.
        Planned once per step and window; the grad, compile and Triton paths keep the one-call form."""
        Tq = self.num_query_tokens
        if (window_left < 0 or self.backend != "torch" or self.device.type != "cpu" or page_indices is not None
                or windowed_selection or (k_min is not None and self._selects) or self._nothing
                or Tq <= 2 * max(_WINDOW_QUERY_BLOCK, window_left + 1)
                or needs_grad(q, k_cache, v_cache) or torch.compiler.is_compiling()):
            return None
        if window_left not in self._window_blocks:
            Qb = max(_WINDOW_QUERY_BLOCK, window_left + 1)
            blocks = []
            for i, t0 in enumerate(range(0, Tq, Qb)):
                t1 = min(t0 + Qb, Tq)
                sub = self._block_plans[i] if i < len(self._block_plans) else None
                if sub is None:
                    sub = PagedAttentionPlan(backend="torch")
                    self._block_plans.append(sub)
                lens = (self.seq_lens.to(torch.int64) - (Tq - t1)).clamp(min=0)
                sub.plan(self.block_table, lens, num_q_heads=self.num_q_heads, num_kv_heads=self.num_kv_heads,
                         head_dim=self.head_dim, page_size=self.page_size, num_query_tokens=t1 - t0,
                         scale=self.scale, trusted=True)
                blocks.append((t0, t1, sub))
            self._window_blocks[window_left] = blocks
        return self._window_blocks[window_left]

    def _run_query_blocks(self, blocks, q, k_cache, v_cache, window_left, return_lse, out, k_scale, v_scale):
        """:meth:`run` of each query block (:meth:`_query_blocks`), outputs (and lse) concatenated over ``Tq``."""
        outs, lses = [], []
        for t0, t1, sub in blocks:
            sub.scale = self.scale                     # a per-layer scale given to run()
            r = sub.run(q[:, t0:t1], k_cache, v_cache, window_left=window_left, return_lse=return_lse,
                        k_scale=k_scale, v_scale=v_scale)
            outs.append(r[0] if return_lse else r)
            if return_lse:
                lses.append(r[1])
        return self._finish(q, torch.cat(outs, 1), torch.cat(lses, 1) if return_lse else None, return_lse, out)

    def _run_torch_fast(self, q, k_cache, v_cache, k_min, k_max, scales=None, window_left=-1):
        """Torch backend, no lse, no grad, no profiler: the fewest PyTorch calls (see the module docstring)."""
        if k_cache.shape[0] == 0:
            return torch.zeros_like(q)
        B, Hkv, D = self.batch, self.num_kv_heads, self.head_dim
        decode = q.dim() == 3 and q.dtype in _EXACT
        if decode:                                                     # [B, Hq, D] -> [B, Hkv, G, D], a view
            qg = q.reshape(B, Hkv, -1, D)
        else:
            qg = core.group_queries(q.unsqueeze(1) if q.dim() == 3 else q, Hkv,
                                    None if q.dtype in _EXACT else torch.float32)   # [B, Hkv, M, D]
        if k_min is not None and self._selects:
            t = self._sparse or self._sparse_tables()
            self._last_selection = sel = self._top_pages(self._scores_torch(qg, k_min, k_max, t), t)
            rows = t["rows"].gather(2, sel[..., None].expand(t["shape"])).view(-1)
            bias, n_keys = t["sel_bias"], t["K"] * self.page_size
        else:
            t = self._dense.get(window_left) or self._dense_tables(window_left)
            rows, bias, n_keys = t["rows"], t["bias"], t["L"]
        chunk = chunked.chunk_keys(n_keys, B * Hkv, D, k_cache.element_size())
        if chunk is not None:                                          # a large step: in cache-sized chunks
            o = self._attend_in_chunks(qg, k_cache, v_cache, rows, n_keys, bias, chunk, scales)[0]
        else:
            o = self._sdpa(qg, *self._gather_kv(k_cache, v_cache, rows, n_keys, qg.dtype, scales), bias)
        if decode:
            return o.view(q.shape)
        o = core.ungroup(o, 1 if q.dim() == 3 else q.shape[1]).to(q.dtype)
        return o.view(q.shape)

    @staticmethod
    def _finish(q, out4, lse, return_lse, out):
        o = out4.squeeze(1) if q.dim() == 3 else out4
        if out is not None:                   # the caller's tensor itself (written in place by the kernel)
            if o.data_ptr() != out.data_ptr():
                out.copy_(o)
            o = out
        if not return_lse:
            return o
        lse = lse.float()
        return o, (lse.squeeze(1) if q.dim() == 3 else lse)

    # ---------------------------------------------------------------------------- selection (Quest)
    def _select(self, q4, k_min, k_max, window_left: int = -1) -> torch.Tensor:
        """Selected logical pages ``[B, Hkv, K]`` of each (row, KV head) by the Quest bound (pages wholly before
        the earliest query's window, if any, scored ``-inf``)."""
        if self.backend == "triton" and q4.dtype != torch.float64:
            return self._select_triton(q4, k_min, k_max, window_left)
        t = self._sparse_tables()
        qg = core.group_queries(q4, self.num_kv_heads, None if q4.dtype in _EXACT else torch.float32)
        with span("score", q=q4, k_min=k_min, block_table=self.block_table, seq_lens=self.seq_lens,
                  page_size=self.page_size):
            scores = core.mask_pages_before_window(self._scores_torch(qg, k_min, k_max, t), self.seq_lens,
                                                   self.page_size, self.num_query_tokens, window_left)
        with span("topk", scores=scores, seq_lens=self.seq_lens, page_budget=self.page_budget):
            self._last_selection = self._top_pages(scores, t)
        return self._last_selection

    @staticmethod
    def _top_pages(scores, t) -> torch.Tensor:
        """Forced pages first (recent, then sinks), then the highest bounds; NaN counts as ``-inf``.

        Both forms order the pages the same way, ties to the lower page: a stable descending sort of float
        keys for short rows (fewest calls), and for long rows a ``topk`` of unique int64 keys (an
        order-preserving integer image of the bound, then ``Pv - 1 - j``), which is much cheaper than sorting
        thousands of pages.
        """
        if t["packed"] is None:
            # NaN counts as -inf (neginf= keeps a real -inf as -inf: it ties with NaN, lower page first)
            key = torch.where(t["forced"], t["forced_key"],
                              scores.nan_to_num(nan=core.NEG_INF, posinf=_SCORE_CAP, neginf=core.NEG_INF))
            # stable: equal keys keep page order, so ties go to the lower page index (and valid pages come
            # before the invalid ones), which also makes the position of every forced page fixed by the plan
            return torch.sort(key, dim=-1, descending=True, stable=True).indices[..., : t["K"]]
        key = torch.where(t["forced"], t["packed"], core.float_order_key(scores) + t["rank"])
        return torch.topk(key, t["K"], dim=-1, largest=True, sorted=True).indices

    def _scores_torch(self, qg, k_min, k_max, t) -> torch.Tensor:
        """``ub = q⁺·k_max + q⁻·k_min`` (Quest eq.), max over the group and queries: ``[B, Hkv, Pv]`` fp32.

        When the step's pages are most of the pool (one long sequence, a full batch), both products run over
        the pool's boxes in place (strided views: each box read once, no copy) and the step's columns are
        picked afterwards; otherwise the step's boxes are gathered head-major (``[B * Hkv, Pv, D]``) first.
        """
        B, Hkv, D = self.batch, self.num_kv_heads, self.head_dim
        Pv, num_pages = t["Pv"], k_min.shape[0]
        M = qg.shape[2]
        dt = qg.dtype
        if num_pages <= 2 * B * Pv and Hkv * B * M * num_pages * 4 <= _POOL_SCORES_BYTES and k_min.dtype == dt:
            qp = qg.transpose(0, 1).reshape(Hkv, B * M, D)                               # [Hkv, B*M, D]
            lo, hi = k_min.permute(1, 2, 0), k_max.permute(1, 2, 0)          # [Hkv, D, num_pages] views
            # two bmm + add_: baddbmm over these strided views ran 1.4x slower (docs/benchmarks.md)
            ub = torch.bmm(qp.clamp(max=0), lo).add_(torch.bmm(qp.clamp(min=0), hi))  # [Hkv, B*M, num_pages]
            ub = ub.view(Hkv, B, M, num_pages).amax(2)                                   # [Hkv, B, num_pages]
            return ub.gather(2, t["phys_hb"]).transpose(0, 1).float()                    # [B, Hkv, Pv]
        qt = qg.reshape(B * Hkv, -1, D).transpose(1, 2)                                  # [B*Hkv, D, M]
        hi = self._gather_rows("hi", k_max, t["box_rows"]).view(B * Hkv, Pv, D)
        lo = self._gather_rows("lo", k_min, t["box_rows"]).view(B * Hkv, Pv, D)
        if hi.dtype != qt.dtype:
            hi, lo = hi.to(qt.dtype), lo.to(qt.dtype)
        ub = torch.bmm(lo, qt.clamp(max=0)).add_(torch.bmm(hi, qt.clamp(min=0)))       # [B*Hkv, Pv, M]
        return ub.amax(-1).view(B, Hkv, Pv).float()                                      # [B, Hkv, Pv]

    def _sparse_tables(self) -> dict:
        """Torch-backend tables of a selecting step (:func:`tinyattn.ops.tables.sparse_tables`), once per plan."""
        if self._sparse is None:
            table, lens = self._host_tables()
            self._sparse = tables.sparse_tables(
                table, lens, page_size=self.page_size, num_kv_heads=self.num_kv_heads,
                group=self.num_q_heads // self.num_kv_heads, num_query_tokens=self.num_query_tokens,
                page_budget=self.page_budget, num_sink_pages=self.num_sink_pages,
                num_recent_pages=self.num_recent_pages, device=self.device, memo=self._page_memo)
        return self._sparse

    def _host_tables(self):
        if self._host is None:
            self._host = (tables.host_copy(self.block_table), tables.host_copy(self.seq_lens))
        return self._host

    def _dense_tables(self, window_left: int = -1) -> dict:
        """Pool rows of every valid key of each row (in the window) and the additive mask
        (:func:`tinyattn.ops.tables.dense_tables`), once per step and window."""
        if window_left not in self._dense:
            table, lens = self._host_tables()
            self._dense[window_left] = tables.dense_tables(
                table, lens, page_size=self.page_size, num_kv_heads=self.num_kv_heads,
                group=self.num_q_heads // self.num_kv_heads, num_query_tokens=self.num_query_tokens,
                device=self.device, memo=self._dense_memo.setdefault(window_left, {}), window_left=window_left)
        return self._dense[window_left]

    def _attend_torch(self, q4, k_cache, v_cache, page_indices, return_lse, scales=None, window_left=-1):
        B, Tq, Hq, D = q4.shape
        Hkv = self.num_kv_heads
        dt = torch.float64 if q4.dtype == torch.float64 else torch.float32
        qg = core.group_queries(q4, Hkv, dt)                                             # [B, Hkv, M, D]
        if page_indices is None:
            t = self._dense_tables(window_left)
            rows, bias, n_keys = t["rows"], t["bias"], t["L"]
        else:
            rows, bias, n_keys = self._selected_rows(page_indices, window_left)
        chunk = chunked.chunk_keys(n_keys, B * Hkv, D, k_cache.element_size())
        if chunk is not None:                                          # a large step: in cache-sized chunks
            o, lse = self._attend_in_chunks(qg, k_cache, v_cache, rows, n_keys, bias, chunk, scales)
            return core.ungroup(o, Tq).to(q4.dtype), core.ungroup(lse, Tq)
        k, v = self._gather_kv(k_cache, v_cache, rows, n_keys, dt, scales)
        if return_lse or not _sdpa_zeroes_empty_rows() or (page_indices is not None and (
                page_indices is not self._last_selection or window_left >= 0)):
            # the NaN-safe core with its lse; also for pages listed by a caller, which may leave a query
            # with no visible key
            o, lse = core.attend_rows(qg, k, v, None if bias is None else bias == 0, self.scale)
            return core.ungroup(o, Tq).to(q4.dtype), core.ungroup(lse, Tq)
        return core.ungroup(self._sdpa(qg, k, v, bias), Tq).to(q4.dtype), None

    def _attend_in_chunks(self, qg, k_cache, v_cache, rows, n_keys: int, bias, chunk: int, scales=None):
        """:func:`tinyattn.ops.chunked.attend_chunked` over this step's ``rows`` (``[B * Hkv * n_keys]``)."""
        def gather(flat_rows, n):
            return self._gather_kv(k_cache, v_cache, flat_rows, n, qg.dtype, scales)

        rows = rows.view(self.batch, self.num_kv_heads, n_keys)
        return chunked.attend_chunked(qg, gather, rows, bias, self.scale, chunk)

    def _gather_kv(self, k_cache, v_cache, rows, n_keys: int, dtype, scales=None):
        """K and V of the pool ``rows`` as ``[B, Hkv, n_keys, D]`` in the math ``dtype``; quantized pools
        (``scales = (k_scale, v_scale)``) are dequantized row by row: ``row.float() * scale[page, head]``."""
        B, Hkv, D = self.batch, self.num_kv_heads, self.head_dim
        k = self._gather_rows("k", k_cache, rows)
        v = self._gather_rows("v", v_cache, rows)
        if scales is not None:
            idx = quant.scale_rows(rows, self.page_size, Hkv)
            k = quant.dequantize_rows(k, scales[0], idx, dtype)
            v = quant.dequantize_rows(v, scales[1], idx, dtype)
        k, v = k.view(B, Hkv, n_keys, D), v.view(B, Hkv, n_keys, D)
        return (k, v) if k.dtype == dtype else (k.to(dtype), v.to(dtype))

    def _sdpa(self, qg, k, v, bias):
        """SDPA over the gathered keys; the additive mask in the query's dtype (fp64 SDPA with an fp32 mask is
        wrong on torch 2.13's CPU)."""
        if bias is not None and bias.dtype != qg.dtype:
            bias = bias.to(qg.dtype)
        return F.scaled_dot_product_attention(qg, k, v, attn_mask=bias, scale=self.scale)

    def _selected_rows(self, page_indices, window_left: int = -1):
        """Pool rows ``[B*Hkv*K*S]`` and additive mask ``[B, Hkv, M or 1, K*S]`` of the listed pages."""
        B, Hkv, S, Tq = self.batch, self.num_kv_heads, self.page_size, self.num_query_tokens
        K = page_indices.shape[-1]
        if page_indices is self._last_selection and window_left < 0:   # the plan's own: mask fixed by the plan
            t = self._sparse
            rows = t["rows"].gather(2, page_indices[..., None].expand(B, Hkv, K, S))     # [B, Hkv, K, S]
            return rows.reshape(-1), t["sel_bias"], K * S
        rows, _, visible = core.page_rows(self.block_table, self.seq_lens, page_indices, page_size=S,
                                          num_kv_heads=Hkv, num_query_tokens=Tq, window_left=window_left)
        bias = torch.where(visible, 0.0, -math.inf).reshape(B, Hkv, Tq, K * S)
        if Tq > 1:
            G = self.num_q_heads // Hkv
            bias = bias[:, :, :, None].expand(B, Hkv, Tq, G, K * S).reshape(B, Hkv, Tq * G, K * S)
        return rows.reshape(-1), bias, K * S

    _api_key = None            # the validated public-op call this plan was built for (ops.api._planned)
    _selected = None           # the Triton path's selection buffer (preallocated by _plan_triton)
    _chunks = None             # the two-stage selection's sizes (kernels.chunk_topk.chunk_blocks), if it is used
    _last_selection = None     # the pages the torch path selected last (their rows come from the tables)

    # ------------------------------------------------------------------------------------ triton path
    def _plan_triton(self) -> None:
        B, Tq, Hkv, Hq = self.batch, self.num_query_tokens, self.num_kv_heads, self.num_q_heads
        self._bt32 = self.block_table.to(torch.int32).contiguous()
        self._sl32 = self.seq_lens.to(torch.int32).contiguous()
        self._scores = self._buffer("scores", (B, Hkv, self.max_pages), torch.float32)
        self._lse = self._buffer("lse", (B, Tq, Hq), torch.float32)
        self._selected = None if self.page_budget is None else \
            self._buffer("selected", (B, Hkv, self.page_budget), torch.int32)
        k = _kernels()
        # selection in two stages (kernels/chunk_topk.py) when B * Hkv programs would leave the GPU idle or rows
        # are long; its candidate workspace is allocated here, never in run()
        self._chunks = None
        if self.page_budget is not None:
            num_sms = k.attention._num_sms(self.device)
            if k.chunk_topk.use_two_stage(B, Hkv, self.max_pages, self.page_budget, num_sms):
                self._chunks = k.chunk_topk.chunk_blocks(B, Hkv, self.max_pages, self.page_budget, Tq, Hq // Hkv,
                                                         self.head_dim, self.page_size, num_sms)
                shape = k.chunk_topk.workspace_shape(B, Hkv, self._chunks)
                self._ws_key = self._buffer("ws_key", shape, torch.int32)
                self._ws_page = self._buffer("ws_page", shape, torch.int32)
        splits = []
        for sparse in (False, True):
            if (sparse and self.page_budget is None) or self._nothing:      # nothing to split (B or Tq = 0)
                splits.append(1)
                continue
            n_list = self.page_budget if sparse else self.max_pages
            splits.append(k.attention.plan_num_splits(B, Tq, Hq, Hkv, self.head_dim, self.page_size, n_list,
                                                      self.device))
        self._splits = dict(zip((False, True), splits))
        n = max(splits)
        self._ws_o = self._buffer("ws_o", (n, B, Tq, Hq, self.head_dim), torch.float32) if n > 1 else None
        self._ws_lse = self._buffer("ws_lse", (n, B, Tq, Hq), torch.float32) if n > 1 else None

    def _gather_rows(self, name: str, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``x`` viewed as ``[-1, D]``, rows ``rows``, into a workspace reused across layers and steps.

        A fresh large output at every call costs page faults that triple the gather time on a CPU; the
        gathered K/V only live until the attention of the same call returns.
        """
        flat = x.reshape(-1, x.shape[-1])
        nbytes = rows.shape[0] * flat.shape[1] * flat.element_size()
        if nbytes < _WORKSPACE_MIN_BYTES or nbytes > _WORKSPACE_MAX_BYTES:
            return flat.index_select(0, rows)    # small: the workspace lookup costs more than it saves
        return torch.index_select(flat, 0, rows, out=self._buffer(name, (rows.shape[0], flat.shape[1]), flat.dtype))

    def _buffer(self, name: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """A workspace reused across :meth:`plan` calls while it is large enough (no allocation per step)."""
        numel = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.dtype != dtype or buf.device != self.device or buf.numel() < numel:
            buf = self._buffers[name] = torch.empty(max(numel, 1), dtype=dtype, device=self.device)
        return buf[:numel].view(shape)

    def _select_triton(self, q4, k_min, k_max, window_left: int = -1) -> torch.Tensor:
        k = _kernels()
        if self._chunks is not None:
            return self._select_two_stage(k.chunk_topk, q4, k_min, k_max, window_left)
        with span("score", q=q4, k_min=k_min, block_table=self.block_table, seq_lens=self.seq_lens,
                  page_size=self.page_size):
            k.page_scores(q4, k_min, k_max, self._bt32, self._sl32, page_size=self.page_size, out=self._scores)
            core.mask_pages_before_window(self._scores, self._sl32, self.page_size, self.num_query_tokens,
                                          window_left)
        with span("topk", scores=self._scores, seq_lens=self.seq_lens, page_budget=self.page_budget):
            k.select_pages(self._scores, self._sl32, page_size=self.page_size, page_budget=self.page_budget,
                           num_sink_pages=self.num_sink_pages, num_recent_pages=self.num_recent_pages,
                           num_query_tokens=self.num_query_tokens, out=self._selected)
        return self._selected

    def _select_two_stage(self, ct, q4, k_min, k_max, window_left: int) -> torch.Tensor:
        """Fused score + per-chunk top-k, then the merge: the selection of ``page_scores`` + ``select_pages``."""
        opts = dict(page_size=self.page_size, page_budget=self.page_budget, num_sink_pages=self.num_sink_pages,
                    num_recent_pages=self.num_recent_pages, meta=self._chunks)
        with span("score", q=q4, k_min=k_min, block_table=self.block_table, seq_lens=self.seq_lens,
                  page_size=self.page_size):
            ct.score_chunks(q4, k_min, k_max, self._bt32, self._sl32, ws_key=self._ws_key, ws_page=self._ws_page,
                            window_left=window_left, **opts)
        with span("topk", scores=self._ws_key, seq_lens=self.seq_lens, page_budget=self.page_budget):
            ct.merge_chunks(self._ws_key, self._ws_page, self._sl32, max_pages=self.max_pages,
                            num_query_tokens=self.num_query_tokens, out=self._selected, **opts)
        return self._selected

    def _attend_triton(self, q4, k_cache, v_cache, page_indices, out, return_lse, scales=None, window_left=-1):
        o = out if out is not None else torch.empty_like(q4)
        o4 = o.unsqueeze(1) if o.dim() == 3 else o
        sparse = page_indices is not None
        if sparse and page_indices is not self._selected:
            page_indices = page_indices.to(torch.int32).contiguous()
        lse = torch.empty_like(self._lse) if return_lse else self._lse   # the caller keeps a returned lse
        splits = self._splits[True] if sparse and page_indices.shape[-1] == (self.page_budget or -1) else None
        _kernels().paged_attention(q4, k_cache, v_cache, self._bt32, self._sl32, page_indices=page_indices,
                                   scale=self.scale, out=o4, lse=lse,
                                   num_splits=self._splits[False] if not sparse else splits,
                                   ws_o=self._ws_o, ws_lse=self._ws_lse,
                                   k_scale=None if scales is None else scales[0],
                                   v_scale=None if scales is None else scales[1], window_left=window_left)
        return o4, lse

    # ------------------------------------------------------------------------------- autograd path
    def _differentiable(self, q4, k_cache, v_cache, page_indices, window_left: int = -1):
        """The custom op with a backward (training, ``torch.compile``); selection is already done."""
        backend = self.backend
        if page_indices is None and (backend == "torch" or q4.dtype == torch.float64):
            page_indices = core.dense_page_indices(self.seq_lens, self.num_kv_heads, self.max_pages, self.page_size)
        elif page_indices is not None and page_indices is self._last_selection:    # score order -> canonical
            page_indices = core.canonical_page_indices(page_indices, self.seq_lens, self.page_size)
        elif page_indices is not None and page_indices is self._selected:
            # the Triton selection buffer is rewritten by the next call's kernel (no version bump autograd could
            # see): the backward must keep this call's pages
            page_indices = page_indices.clone()
        return differentiable_attention(q4, k_cache, v_cache, self.block_table, self.seq_lens, page_indices,
                                        self.scale, backend, window_left)


def _empty_attention(q4, k_cache, v_cache):
    """out = 0 and lse = -inf everywhere, still connected to q/k/v so that their gradients are zeros.

    Summing an empty slice of each input adds an exact 0 with a gradient path (a ``0 * x`` term would
    turn NaN padding into NaN).
    """
    link = q4.flatten()[:0].sum()
    for x in (k_cache, v_cache):
        if x.is_floating_point() and x.dtype not in V.QUANTIZED_DTYPES:     # int8 / fp8 pools have no gradient
            link = link + x.flatten()[:0].sum()
    out = torch.zeros_like(q4) + link.to(q4.dtype)
    lse = torch.full(q4.shape[:3], float("-inf"), dtype=torch.float32, device=q4.device)
    return out, lse
