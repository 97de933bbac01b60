"""CUDA-graph decode steps of :class:`tinyattn.models.LlamaModel`, captured per batch-size bucket (vLLM's pattern).

A decode step of a small model is mostly host time: a few dozen kernel launches per layer from Python. Serving
engines (vLLM, SGLang) capture the step once per batch size as a CUDA graph and replay it; :class:`DecodeGraphs`
does the same for :class:`LlamaRuntime` (``cuda_graphs=True``) and :class:`tinyattn.engine.Engine`
(``cuda_graphs=True``).

What one step does:

- **host, outside the graph** (:meth:`DecodeGraphs.prepare`): ``cache.extend`` (page allocation, slots), the
  block table and ``seq_lens``; the step's values are copied into static device buffers of the bucket's size
  (token ids, RoPE factors ``cos + i sin`` of the positions, slots) and the attention plan is planned in graph
  mode (:meth:`tinyattn.PagedAttentionPlan.plan` with ``max_batch`` / ``max_pages_per_seq``: its tables and
  workspaces keep their storage, a new plan only copies values);
- **inside the graph** (:meth:`DecodeGraphs.body`): embedding, every layer's qkv, RoPE, K/V write and page-box
  upkeep (:meth:`tinyattn.PagedKVCache.write` with ``trusted=True``), Quest selection and attention (into one
  static output buffer), FFN, final norm and classifier: no host sync, no allocation outside the graph's pool.

Buckets are ``1, 2, 4, 8, ...`` up to ``max_batch`` (itself the last bucket). A batch of ``B`` rows runs in the
smallest bucket ``b >= B``; the ``b - B`` padding rows have ``seq_len`` 0 (attention gives zeros, selection
``-1``) and write their K/V into one scratch page the object holds in the cache (a sequence of its own, one
page), so they touch no real row's pages or boxes. A bucket is captured the first time it is used: that step
runs the body eagerly on a side stream (the real step: it compiles the kernels) and the capture follows; the
next steps of that bucket replay. All buckets share one graph memory pool.

The graphs hold the addresses of the cache's pools, the model's fused weights and the plan's buffers: a new
cache needs a new :class:`DecodeGraphs`; changed weights or a resized pool drop the graphs (recaptured at next
use). Steps that cannot be captured run eagerly through the usual forward (:func:`why_not_graphed` names the
static reasons; :meth:`DecodeGraphs.can_replay` the per-step ones: a profiler, more rows than ``max_batch``).

Pattern: vLLM's ``CUDAGraphRunner`` (``vllm/worker/model_runner.py``; v1: ``CudagraphDispatcher``) and
``torch.cuda.graph`` (PyTorch docs, "CUDA Graphs"). ``tests/gpu/test_gpu_graphs.py`` checks it on a GPU (passed on
an H200, 2026-12-04, for the fixed Quest budget, top-p and the 4-bit re-rank with top-p).
"""

from __future__ import annotations

import torch

from tinyattn.layer import PagedAttention, SparsityConfig
from tinyattn.ops import quant, spans
from tinyattn.ops.plan import resolve_backend

from .step import ForwardStep

__all__ = ["DecodeGraphs", "batch_buckets", "why_not_graphed"]


def batch_buckets(max_batch: int) -> list[int]:
    """The batch sizes captured: ``1, 2, 4, ...`` below ``max_batch``, then ``max_batch`` (vLLM's powers of two).

    Raises ``ValueError`` unless ``max_batch`` is an int >= 1."""
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"max_batch: expected an int >= 1, got {max_batch!r}")
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return sizes + [max_batch]


def why_not_graphed(model, sparsity: SparsityConfig, *, backend=None, kv_cache_dtype: str = "auto",
                    selection_metrics: bool = False) -> str | None:
    """Why decode steps of this setup cannot be captured (a sentence), or ``None`` when they can.

    Static reasons only: a model off CUDA, the torch backend (its plan reads lengths on the host), an int8 / fp8
    cache (its write re-quantizes pages through ``torch.unique`` and a host sync), a selection policy other than
    fused Quest (policies select with host-side logic and state), selection metrics (a dense oracle pass). The box
    estimate, top-p and the re-rank (``rerank="int4"``, its codes written inside the graph) are captured."""
    device = model.device
    if device.type != "cuda":
        return f"the model is on {device.type}, CUDA graphs need a CUDA device"
    if resolve_backend(backend, device) != "triton":
        return "the torch backend is not capturable (its plan reads the lengths on the host); use backend='triton'"
    if quant.is_quantized(quant.storage_dtype(kv_cache_dtype, model.dtype)):
        return (f"kv_cache_dtype={kv_cache_dtype!r}: the quantized write re-quantizes pages with data-dependent "
                f"shapes (torch.unique) and a host sync")
    if not sparsity.is_dense and not sparsity.policy.fused:
        return f"policy {sparsity.policy.name!r} selects on the host (only fused Quest is captured)"
    if selection_metrics and not sparsity.is_dense:
        return "selection metrics run a dense oracle pass per sparse layer with host-side bookkeeping"
    return None


def _profiling() -> bool:
    """A tinyattn profile() block or a torch profiler is active: spans and timings need eager steps."""
    return spans.recorder is not None or torch.autograd.profiler._is_profiler_enabled


class DecodeGraphs:
    """Decode steps (one token per row) of ``model`` over ``cache``, replayed as CUDA graphs per batch bucket.

    Args:
        model: a :class:`tinyattn.models.LlamaModel`.
        cache: its :class:`tinyattn.PagedKVCache`; one free page is taken at construction for the padding rows
            (:class:`tinyattn.cache.CacheFullError` when there is none: build the cache one page larger).
        sparsity: the decode :class:`tinyattn.SparsityConfig` (fused Quest or dense).
        backend: ``None`` (by device) or ``"triton"``.
        max_batch: the largest batch captured (rows beyond it run eagerly).
        max_pages_per_seq: the widest block table a step may have (pages of the longest row).
        capture: ``None`` = on CUDA; ``False`` runs :meth:`body` eagerly in :meth:`step` (the same buffers and
            calls: what the CPU tests check).

    Example (what :class:`LlamaRuntime` does with ``cuda_graphs=True``)::

        graphs = DecodeGraphs(model, cache, sparsity, max_batch=8, max_pages_per_seq=64)
        logits = graphs.step(seq_ids, next_tokens)        # [B, V] fp32; captures the bucket at first use

    Raises:
        ValueError for a bad ``max_batch`` / ``max_pages_per_seq``.
    """

    def __init__(self, model, cache, sparsity: SparsityConfig, *, backend: str | None = None, max_batch: int,
                 max_pages_per_seq: int, capture: bool | None = None):
        self.buckets = batch_buckets(max_batch)
        if isinstance(max_pages_per_seq, bool) or not isinstance(max_pages_per_seq, int) or max_pages_per_seq < 1:
            raise ValueError(f"max_pages_per_seq: expected an int >= 1, got {max_pages_per_seq!r}")
        self.model, self.cache, self.sparsity = model, cache, sparsity
        self.max_batch, self.max_pages_per_seq = max_batch, max_pages_per_seq
        self.capture = model.device.type == "cuda" if capture is None else bool(capture)
        self.attention = PagedAttention(sparsity, backend=backend)      # its own plan: graph-mode buffers only
        cfg, dev = model.config, model.device
        self._pad_seq = cache.add_sequence()                            # the padding rows' scratch page
        cache.extend([self._pad_seq], 1)
        self._pad_slot = cache.pages(self._pad_seq)[0] * cache.page_size
        self._tokens = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self._slots = torch.full((max_batch,), self._pad_slot, dtype=torch.long, device=dev)
        self._cis = torch.ones(max_batch, 1, cfg.head_dim // 2, dtype=torch.complex64, device=dev)
        self._block_table = torch.full((max_batch, max_pages_per_seq), -1, dtype=torch.int32, device=dev)
        self._seq_lens = torch.zeros(max_batch, dtype=torch.int32, device=dev)
        self._attn_out = torch.zeros(max_batch, cfg.n_heads, cfg.head_dim, dtype=model.dtype, device=dev)
        self._graphs: dict[int, tuple] = {}                             # bucket -> (CUDAGraph, its logits)
        self._pool = None
        self._key = None
        self._weights = None
        self.steps = 0                                                  # steps run here (replayed or not)
        self.replays = 0                                                # steps served by a graph replay

    def __repr__(self) -> str:
        return (f"DecodeGraphs(buckets={self.buckets}, max_pages_per_seq={self.max_pages_per_seq}, "
                f"captured={sorted(self._graphs)}, capture={self.capture})")

    # ---------------------------------------------------------------------------------------- per step
    def bucket(self, batch: int) -> int:
        """The smallest bucket holding ``batch`` rows (``ValueError`` past ``max_batch``)."""
        for b in self.buckets:
            if b >= batch:
                return b
        raise ValueError(f"batch: expected at most max_batch={self.max_batch} rows, got {batch}")

    def can_replay(self, batch: int) -> bool:
        """Whether a step of ``batch`` rows can run here: ``1 <= batch <= max_batch`` and no profiler active."""
        return 1 <= batch <= self.max_batch and not _profiling()

    def prepare(self, seq_ids, tokens) -> int:
        """Host side of a step: extend the rows by one token each, copy the step's values into the static
        buffers of its bucket (padding rows: ``seq_len`` 0, the scratch slot) and plan the attention; returns the
        bucket. ``tokens``: ``B`` token ids (a list or a CPU tensor; validated by the caller).

        Raises ``ValueError`` when a row's table is wider than ``max_pages_per_seq`` (nothing extended)."""
        model, cache, cfg = self.model, self.cache, self.model.config
        seq_ids = list(seq_ids)
        B = len(seq_ids)
        b = self.bucket(B)
        start = [cache.length(s) for s in seq_ids]
        widest = max(-(-(n + 1) // cache.page_size) for n in start)
        if widest > self.max_pages_per_seq:
            raise ValueError(f"seq_ids: a row needs {widest} pages, more than max_pages_per_seq="
                             f"{self.max_pages_per_seq}")
        self._check_key()
        dev = model.device
        slots = cache.extend(seq_ids, 1)                                       # [B] int64 on the device
        self._slots[:B].copy_(slots)
        self._slots[B:b].fill_(self._pad_slot)
        self._tokens[:B].copy_(torch.as_tensor(tokens, dtype=torch.long).reshape(B), non_blocking=True)
        self._tokens[B:b].zero_()
        positions = torch.tensor(start, dtype=torch.long).to(dev, non_blocking=True)
        self._cis[:B].copy_(model._rope_cis(positions[:, None], max(start) + 1).view(B, 1, -1))
        self._cis[B:b].fill_(1)
        table = cache.block_table(seq_ids)                                     # [B, width] int32
        self._block_table[:B, : table.shape[1]].copy_(table)
        self._block_table[:B, table.shape[1]:].fill_(-1)
        self._block_table[B:b].fill_(-1)
        self._seq_lens[:B].copy_(cache.seq_lens(seq_ids))
        self._seq_lens[B:b].zero_()
        self.attention.begin(self._block_table[:b], self._seq_lens[:b], num_q_heads=cfg.n_heads,
                             num_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, page_size=cache.page_size,
                             num_query_tokens=1, decode=True, seq_ids=seq_ids, trusted=True, max_batch=self.max_batch,
                             max_pages_per_seq=self.max_pages_per_seq)
        return b

    def body(self, b: int) -> torch.Tensor:
        """The captured part of a step of bucket ``b`` (after :meth:`prepare`): logits ``[b, V]`` fp32."""
        model, cache, cfg = self.model, self.cache, self.model.config
        no_boxes = [None] * cfg.n_layers
        step = ForwardStep(
            tokens=self._tokens[:b].view(b, 1), batch=b, num_tokens=1, cache=cache, slots=self._slots[:b],
            attention=self.attention, cis=self._cis[:b],
            pools=list(zip(cache.k_cache, cache.v_cache, cache.k_min or no_boxes, cache.k_max or no_boxes)),
            scales=[dict(k_scale=ks, v_scale=vs) for ks, vs in zip(cache.k_scale, cache.v_scale)]
            or [{}] * cfg.n_layers,
            weights=self._weights, norm_eps=model._norm_eps,
            codes=cache.k_code or [None] * cfg.n_layers,                 # 4-bit key codes (rerank="int4")
            attn_out=self._attn_out[:b], trusted_slots=True)
        x = model.embed(step)
        for li in range(cfg.n_layers):
            x = model.layer_forward(li, x, step)
        return model.head(x, step, last_only=True)

    @torch.no_grad()
    def step(self, seq_ids, tokens) -> torch.Tensor:
        """One decode step: append ``tokens[i]`` to ``seq_ids[i]``; logits ``[B, V]`` fp32 (a copy of the real
        rows). The first step of a bucket runs eagerly and captures it; later ones replay."""
        B = len(seq_ids)
        b = self.prepare(seq_ids, tokens)
        self.steps += 1
        if not self.capture:
            return self.body(b)[:B]
        if b in self._graphs:
            self.replay(b)
            logits = self._graphs[b][1]
        else:
            logits = self._capture(b)
        return logits[:B].clone()

    def replay(self, b: int) -> torch.Tensor:
        """Replay bucket ``b``'s graph (after :meth:`prepare`); its logits buffer ``[b, V]`` (rewritten by the
        next replay)."""
        graph, logits = self._graphs[b]
        graph.replay()
        self.replays += 1
        return logits

    # ---------------------------------------------------------------------------------------- capture
    def _capture(self, b: int) -> torch.Tensor:
        """Run the prepared step eagerly on a side stream (compiles the kernels, warms cuBLAS), then capture it
        (capture records, it does not run); returns the eager logits."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            logits = self.body(b)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self.body(b)
        self._pool = graph.pool()
        self._graphs[b] = (graph, out)
        return logits

    def _check_key(self) -> None:
        """Drop the graphs when what they point at moved: the model's fused weights (rebuilt after a weight
        changed: their version counters and storages) or the cache's pools (a resize). Inference-mode weights keep
        no version counter: the first fused copy is kept (weights changed under inference mode are not seen)."""
        weights = self.model._weights()
        version = self.model.__dict__["_weights_cache"][0]
        cache = self.cache
        pools = tuple(t.data_ptr() for t in cache.k_cache + cache.v_cache + cache.k_min + cache.k_max + cache.k_code)
        key = (version, pools)
        if self._weights is not None and version is None:
            weights = self._weights
        if key != self._key or self._weights is None:
            self._graphs.clear()
            self._pool = None
            self._weights, self._key = weights, key
