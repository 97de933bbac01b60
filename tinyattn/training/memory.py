"""ChunkedKVMemory: per-layer paged K/V memory of a batch of long sequences processed chunk by chunk.

Fine-tuning on a sequence longer than what fits in memory at once (Transformer-XL style): the sequence
is cut into chunks of ``chunk_size`` tokens; chunk ``i`` attends to itself and to the K/V that earlier
chunks left in a paged pool. The pool has a fixed capacity of ``capacity`` pages per row and layer; when
the next chunk does not fit, a :class:`~tinyattn.training.retention.RetentionPolicy` picks memory pages to
free (never the sinks or the newest pages), and their physical pages go back to the free list and are
reused by later chunks. Freed pages keep their logical position in the row: the attention reads the held
pages through ``page_indices`` (:func:`tinyattn.sparse_paged_attention`), causal masking and RoPE use
absolute positions (keys are stored after RoPE), so eviction never shifts a position (CASES.md §8).

Gradients. :meth:`write` builds the layer's pool for this chunk **out of place**:
``k_pool = memory.index_put(chunk slots, k_chunk)``, so autograd sees the chunk's K/V (from the weights)
written into a pool-shaped tensor, and the attention backward (Triton kernels or the torch formula)
returns ``dk_pool`` / ``dv_pool`` for every slot it read: the chunk's own slots flow back to the weights,
the memory slots' gradients are what :meth:`observe_gradients` reduces per page
(:func:`~tinyattn.training.retention.page_taylor_scores` or :func:`tinyattn.ops.page_grad.page_grad_norms`)
for the policy. The memory itself is stored detached:
gradients stop at it (the stop-gradient of Transformer-XL), so the graph, and the activation memory, stay
one chunk long. :meth:`commit` then copies the chunk's K/V into the stored pool in place.

Memory is honest: the stored pool is allocated at its capacity (``batch * capacity`` pages per layer), and
the per-chunk pool tensors are the same size.

Pages are owned by a :class:`tinyattn.cache.PagedKVCache` per layer (each layer evicts its own pages, so
each has its own allocation; rows are the cache's sequences, no page boxes): :meth:`begin_chunk` extends
the rows, eviction is :meth:`~tinyattn.cache.PagedKVCache.drop_pages` (a dropped page reads ``-1``, every
other page keeps its logical position), :meth:`commit` writes the chunk with
:meth:`~tinyattn.cache.PagedKVCache.write`.
"""

from __future__ import annotations

import torch

from ..cache import PagedKVCache
from ..ops.page_grad import page_grad_norms
from .retention import RetentionPolicy, page_taylor_scores

__all__ = ["ChunkedKVMemory"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class ChunkedKVMemory:
    """Paged K/V pools (one per layer) for ``batch`` rows of ``seq_len`` tokens, chunk after chunk.

    Args:
        num_layers, num_kv_heads, head_dim: model shape.
        batch: rows processed together (all of the same length). seq_len: tokens per row.
        chunk_size: tokens per chunk, a multiple of ``page_size``.
        page_size: tokens per page.
        capacity: pages per row and layer the pool holds, the current chunk included; ``None`` = the whole
            sequence (no eviction). Must hold the sinks, the recent pages and one chunk.
        num_sink_pages: leading pages never freed. num_recent_pages: newest pages never freed (default: one
            chunk's worth).
        policy: a :class:`RetentionPolicy`.
        dtype, device: of the pools.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, *, batch: int, seq_len: int,
                 chunk_size: int, page_size: int, capacity: int | None, policy: RetentionPolicy,
                 num_sink_pages: int = 1, num_recent_pages: int | None = None, dtype=torch.float32, device="cpu"):
        if chunk_size % page_size:
            raise ValueError(f"chunk_size: expected a multiple of page_size={page_size}, got {chunk_size}")
        self.num_layers, self.batch, self.seq_len = num_layers, batch, seq_len
        self.page_size, self.chunk_size = page_size, chunk_size
        self.max_pages = _cdiv(seq_len, page_size)
        self.chunk_pages = chunk_size // page_size
        self.num_sink_pages = num_sink_pages
        self.num_recent_pages = self.chunk_pages if num_recent_pages is None else num_recent_pages
        full = capacity is None or not policy.evicts or capacity >= self.max_pages
        self.capacity = self.max_pages if full else capacity
        floor = self.num_sink_pages + self.num_recent_pages + self.chunk_pages
        if not full and self.capacity < floor:
            raise ValueError(f"capacity: expected at least num_sink_pages + num_recent_pages + pages per chunk = "
                             f"{self.num_sink_pages} + {self.num_recent_pages} + {self.chunk_pages} = {floor} pages, "
                             f"got {capacity}")
        self.policy = policy
        self.device = torch.device(device)
        # one page pool per layer (layers evict different pages), one sequence per row
        self.caches = [PagedKVCache(1, num_kv_heads, head_dim, page_size=page_size, num_pages=batch * self.capacity,
                                    dtype=dtype, device=self.device, page_boxes=False) for _ in range(num_layers)]
        self.rows = [[cache.add_sequence() for _ in range(batch)] for cache in self.caches]
        # logical page j of row b of layer l lives at phys[l][b, j]; -1 = not held (not yet written, or freed);
        # a copy of the caches' block tables, refreshed when they change (begin_chunk)
        self.phys = [torch.full((batch, self.max_pages), -1, dtype=torch.int64, device=self.device)
                     for _ in range(num_layers)]
        self._slots: list[torch.Tensor | None] = [None] * num_layers
        self.length = 0
        self.chunk_len = 0
        self.peak_pages = 0             # most pages held by one row of one layer at any time
        self.evicted = 0                # pages freed so far, all rows and layers
        self._chunk: list[tuple | None] = [None] * num_layers
        self._pools: list[tuple | None] = [None] * num_layers
        policy.reset(num_layers, batch, self.max_pages, device=self.device)

    # ---- sizes -------------------------------------------------------------------------------------
    @property
    def k(self) -> list[torch.Tensor]:
        """The stored K pools, one ``[batch * capacity, page_size, Hkv, D]`` per layer (the caches' tensors)."""
        return [cache.k_cache[0] for cache in self.caches]

    @property
    def v(self) -> list[torch.Tensor]:
        return [cache.v_cache[0] for cache in self.caches]

    @property
    def page_bytes(self) -> int:
        """Bytes of K + V of one page of one layer."""
        return 2 * self.k[0][0].numel() * self.k[0].element_size()

    @property
    def pool_bytes(self) -> int:
        """Bytes of the stored K/V pools, all layers (their allocated capacity)."""
        return self.num_layers * self.k[0].shape[0] * self.page_bytes

    @property
    def peak_kv_bytes(self) -> int:
        """Bytes of K/V the memory held at its fullest point, all rows and layers."""
        return self.num_layers * self.batch * self.peak_pages * self.page_bytes

    def held(self, layer: int) -> torch.Tensor:
        return self.phys[layer] >= 0

    # ---- one chunk -------------------------------------------------------------------------------
    def begin_chunk(self, num_tokens: int) -> None:
        """Free pages if the next ``num_tokens`` tokens do not fit, then allocate their pages in every layer."""
        if num_tokens < 1 or num_tokens > self.chunk_size or self.length + num_tokens > self.seq_len:
            raise ValueError(f"num_tokens: expected 1..{min(self.chunk_size, self.seq_len - self.length)}, "
                             f"got {num_tokens}")
        page_size = self.page_size
        first, last = _cdiv(self.length, page_size), _cdiv(self.length + num_tokens, page_size)   # new pages
        for layer in range(self.num_layers):
            held = self.held(layer)
            over = int(held.sum(1).max()) + (last - first) - self.capacity
            if over > 0:
                self._evict(layer, held, over, newest=first)
            self._slots[layer] = self.caches[layer].extend(self.rows[layer], num_tokens)   # [B * n] row-major
            self._refresh(layer)
            self.peak_pages = max(self.peak_pages, int(self.held(layer).sum(1).max()))
        self.chunk_len = num_tokens

    def _evict(self, layer: int, held: torch.Tensor, count: int, newest: int) -> None:
        j = torch.arange(self.max_pages, device=self.device)
        protected = (j < self.num_sink_pages) | (j >= newest - self.num_recent_pages)
        candidate = held & ~protected[None, :]                                          # [B, max_pages]
        if int(candidate.sum(1).min()) < count:
            raise RuntimeError(f"retention: need to free {count} pages but a row has only "
                               f"{int(candidate.sum(1).min())} unprotected pages")
        score = self.policy.scores(layer, held).to(self.device).float()
        key = torch.where(candidate, score, float("inf"))
        order = torch.sort(key, dim=1, stable=True).indices[:, :count]                 # lowest first, older on ties
        for b, seq in enumerate(self.rows[layer]):
            self.caches[layer].drop_pages(seq, order[b].tolist())
        self._refresh(layer)
        self.evicted += self.batch * count

    def _refresh(self, layer: int) -> None:
        table = self.caches[layer].block_table(self.rows[layer], max_pages=self.max_pages)
        self.phys[layer] = table.to(device=self.device, dtype=torch.int64)

    def block_table(self, layer: int) -> torch.Tensor:
        """int32 ``[B, max_pages]``; freed pages point at page 0 (never read: they are not in page_indices)."""
        return self.phys[layer].clamp(min=0).to(torch.int32)

    def seq_lens(self) -> torch.Tensor:
        """int32 ``[B]``: tokens so far including the current chunk."""
        return torch.full((self.batch,), self.length + self.chunk_len, dtype=torch.int32, device=self.device)

    def page_indices(self, layer: int, num_kv_heads: int) -> torch.Tensor:
        """int32 ``[B, Hkv, capacity]``: the held logical pages of each row, ascending, -1 padded."""
        held = self.held(layer)
        j = torch.arange(self.max_pages, device=self.device)
        key = torch.where(held, j, self.max_pages)
        idx = torch.sort(key, dim=1).values[:, : self.capacity]
        idx = torch.where(idx < self.max_pages, idx, -1).to(torch.int32)
        return idx[:, None, :].expand(-1, num_kv_heads, -1).contiguous()

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, *, track_gradients: bool = False):
        """The layer's pools with the chunk's ``k``, ``v`` ``[B, n, Hkv, D]`` written in, out of place.

        Returns ``(k_pool, v_pool)`` ``[num_pages, page_size, Hkv, D]``, differentiable in ``k`` and ``v``.
        With ``track_gradients`` their ``.grad`` is kept after backward for :meth:`observe_gradients`.
        """
        B, n, Hkv, D = k.shape
        slots = self._slots[layer]                                                      # [B*n] row-major
        k_stored, v_stored = self.caches[layer].k_cache[0], self.caches[layer].v_cache[0]
        pool_shape = k_stored.shape
        k_pool = k_stored.view(-1, Hkv, D).index_put((slots,), k.reshape(B * n, Hkv, D).to(k_stored.dtype))
        v_pool = v_stored.view(-1, Hkv, D).index_put((slots,), v.reshape(B * n, Hkv, D).to(v_stored.dtype))
        k_pool, v_pool = k_pool.view(pool_shape), v_pool.view(pool_shape)
        if track_gradients:
            for t in (k_pool, v_pool):
                if t.requires_grad:
                    t.retain_grad()
                else:
                    t.requires_grad_()       # evaluation: no weight gradients, but the pages' gradients
        self._chunk[layer] = (slots, k.detach().reshape(B * n, Hkv, D), v.detach().reshape(B * n, Hkv, D))
        self._pools[layer] = (k_pool, v_pool) if track_gradients else None
        return k_pool, v_pool

    def observe_gradients(self) -> None:
        """After the chunk's backward: a per-page gradient signal to the policy: ``-sum(dk*k + dv*v)`` for a policy
        whose ``signal`` is ``"taylor"`` (:func:`~tinyattn.training.retention.page_taylor_scores`), otherwise
        ``||dK||^2 + ||dV||^2`` summed over KV heads."""
        for layer in range(self.num_layers):
            pools = self._pools[layer]
            if pools is None or pools[0].grad is None:
                continue
            if getattr(self.policy, "signal", "magnitude") == "taylor":
                norms = page_taylor_scores(pools[0], pools[1])                          # [num_pages]
            else:
                norms = page_grad_norms(pools[0].grad, pools[1].grad).sum(1)            # [num_pages]
            held = self.held(layer)
            per_page = torch.where(held, norms[self.phys[layer].clamp(min=0)], 0.0)      # [B, max_pages]
            self.policy.observe(layer, per_page, held)

    def commit(self) -> None:
        """Store the chunk's K/V (detached) in the pools and advance the length; drop the chunk's pool tensors."""
        for layer in range(self.num_layers):
            slots, k, v = self._chunk[layer]
            self.caches[layer].write(0, slots, k, v)
            self._chunk[layer] = self._pools[layer] = None
        self.length += self.chunk_len
        self.chunk_len = 0
