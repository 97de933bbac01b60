"""PagedKVCache: a page pool per layer, a free-page allocator, block tables and page bounding boxes.

Layout (DESIGN.md §2, vLLM's ``[num_blocks, block_size, num_kv_heads, head_size]``): for each layer
``k_cache[layer]`` and ``v_cache[layer]`` are ``[num_pages, page_size, Hkv, D]`` and ``k_min[layer]`` /
``k_max[layer]`` are ``[num_pages, Hkv, D]``. All layers share one allocation map: logical page ``j`` of a
sequence lives at the same physical page in every layer, so one block table serves the whole model.

Per step a caller does what vLLM's ``reshape_and_cache`` path does::

    slots = cache.extend(seq_ids, num_tokens)      # allocate pages, advance lengths -> physical slots
    for layer in range(num_layers):
        cache.write(layer, slots, k, v)            # store K/V, grow the touched pages' min/max
        out = tinyattn.sparse_paged_attention(q, cache.k_cache[layer], cache.v_cache[layer],
                                              cache.block_table(seq_ids), cache.seq_lens(seq_ids), ...)

Bounding boxes are kept incrementally: a page's min/max is reset when the page is allocated and then
only grows with ``amin``/``amax`` of the keys written into it, so padding slots never enter the box.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch

from .ops.spans import span


class CacheFullError(RuntimeError):
    """Raised by :meth:`PagedKVCache.extend` when the pool has too few free pages; nothing was changed."""


class PagedKVCache:
    """Paged K/V storage for ``num_layers`` layers with per-page key bounding boxes.

    Args:
        num_layers: layers that store K/V (each gets its own pool; the allocation is shared).
        num_kv_heads: ``Hkv``. head_dim: ``D``.
        page_size: tokens per page. num_pages: physical pages in the pool (per layer).
        dtype: K/V dtype (fp16, bf16, fp32, or fp64 for gradient checks); k_min/k_max use the same dtype.
        device: where the pools live.

    Memory: ``2 * num_layers * num_pages * page_size * Hkv * D`` elements for K/V, plus
    ``2 * num_layers * num_pages * Hkv * D`` for the boxes (see :attr:`kv_bytes`).

    Raises:
        ValueError for sizes below 1; :class:`CacheFullError` from :meth:`extend` when out of pages.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, *, page_size: int, num_pages: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                            ("page_size", page_size), ("num_pages", num_pages)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.page_size, self.num_pages = page_size, num_pages
        self.dtype, self.device = dtype, torch.device(device)
        pool = (num_pages, page_size, num_kv_heads, head_dim)
        box = (num_pages, num_kv_heads, head_dim)
        self.k_cache = [torch.zeros(pool, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v_cache = [torch.zeros(pool, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.k_min = [torch.full(box, float("inf"), dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.k_max = [torch.full(box, float("-inf"), dtype=dtype, device=self.device) for _ in range(num_layers)]
        self._free: list[int] = list(range(num_pages - 1, -1, -1))   # a stack: low ids are handed out first
        self._pages: dict[int, list[int]] = {}                        # seq id -> physical pages, in order
        self._lens: dict[int, int] = {}                               # seq id -> valid tokens
        self._next_id = 0

    # ---- sequences -------------------------------------------------------------------------------
    def add_sequence(self) -> int:
        """Register an empty sequence and return its id."""
        seq_id, self._next_id = self._next_id, self._next_id + 1
        self._pages[seq_id], self._lens[seq_id] = [], 0
        return seq_id

    def free(self, seq_id: int) -> None:
        """Forget a sequence and return its pages to the pool."""
        self._check_ids([seq_id])
        self._free.extend(reversed(self._pages.pop(seq_id)))
        del self._lens[seq_id]

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def sequences(self) -> list[int]:
        return list(self._pages)

    def length(self, seq_id: int) -> int:
        self._check_ids([seq_id])
        return self._lens[seq_id]

    def pages(self, seq_id: int) -> list[int]:
        """Physical pages of a sequence, in logical order (a copy)."""
        self._check_ids([seq_id])
        return list(self._pages[seq_id])

    @property
    def kv_bytes(self) -> int:
        """Bytes of the K/V pools and bounding boxes, all layers."""
        tensors = self.k_cache + self.v_cache + self.k_min + self.k_max
        return sum(t.numel() * t.element_size() for t in tensors)

    # ---- allocation ----------------------------------------------------------------------------
    def extend(self, seq_ids: Sequence[int], num_tokens: int | Sequence[int]) -> torch.Tensor:
        """Make room for ``num_tokens`` more tokens in each sequence and advance their lengths.

        All or nothing: if the pool cannot hold every request, :class:`CacheFullError` is raised and no
        sequence changes. Returns the physical slots ``page * page_size + offset`` of the new tokens,
        int64 ``[sum(num_tokens)]``, sequence after sequence, in token order.
        """
        seq_ids = list(seq_ids)
        self._check_ids(seq_ids)
        try:        # an int-like count (int, numpy integer, 0-d integer tensor) or one per sequence
            counts = [operator.index(num_tokens)] * len(seq_ids)
        except TypeError:
            counts = list(num_tokens) if isinstance(num_tokens, (list, tuple)) else None
        if counts is None or len(counts) != len(seq_ids) or any(
                isinstance(c, bool) or not hasattr(c, "__index__") or operator.index(c) < 0 for c in counts):
            raise ValueError(f"num_tokens: expected an int >= 0 or a list of one per sequence ({len(seq_ids)}), "
                             f"got {num_tokens!r}")
        counts = [operator.index(c) for c in counts]
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError("seq_ids: expected distinct sequence ids, got a repeated id")
        needed = [self._pages_needed(s, c) for s, c in zip(seq_ids, counts)]
        if sum(needed) > len(self._free):
            raise CacheFullError(f"PagedKVCache is out of pages: the request needs {sum(needed)} new pages, "
                                 f"{len(self._free)} of {self.num_pages} are free (page_size {self.page_size}); "
                                 f"free a sequence or build a larger cache. No sequence was changed.")
        slots = []
        for seq_id, count, n_new in zip(seq_ids, counts, needed):
            for _ in range(n_new):
                self._take_page(seq_id)
            start = self._lens[seq_id]
            pos = torch.arange(start, start + count)
            pages = torch.tensor(self._pages[seq_id], dtype=torch.int64)
            slots.append(pages[pos // self.page_size] * self.page_size + pos % self.page_size
                         if count else pos)
            self._lens[seq_id] = start + count
        return torch.cat(slots).to(self.device) if slots else torch.zeros(0, dtype=torch.int64, device=self.device)

    def _pages_needed(self, seq_id: int, count: int) -> int:
        total = -(-(self._lens[seq_id] + count) // self.page_size)
        return max(total - len(self._pages[seq_id]), 0)

    def _take_page(self, seq_id: int) -> None:
        page = self._free.pop()
        for k_min, k_max in zip(self.k_min, self.k_max):
            k_min[page].fill_(float("inf"))          # an empty box: the first write sets it
            k_max[page].fill_(float("-inf"))
        self._pages[seq_id].append(page)

    # ---- K/V -----------------------------------------------------------------------------------
    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``, ``v`` ``[N, Hkv, D]`` at ``slots`` ``[N]`` of ``layer`` and grow the pages' boxes.

        Boxes only grow: overwriting a slot that already held a key leaves its page's box looser than
        needed (still an upper bound, so selection stays safe); :func:`tinyattn.update_page_metadata`
        recomputes it exactly. Raises ``TypeError``/``ValueError`` for non-integer or out-of-pool ``slots``
        and mismatched ``k``/``v`` shapes, before anything is written.
        """
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer: expected an int in [0, {self.num_layers}), got {layer}")
        if not isinstance(slots, torch.Tensor) or slots.dtype not in (torch.int32, torch.int64) or slots.dim() != 1:
            got = f"{slots.dtype} tensor of shape {tuple(slots.shape)}" if isinstance(slots, torch.Tensor) \
                else type(slots).__name__
            raise TypeError(f"slots: expected a 1-D int32/int64 tensor (from extend()), got {got}")
        expected = (slots.shape[0], self.num_kv_heads, self.head_dim)
        for name, x in (("k", k), ("v", v)):
            if tuple(x.shape) != expected:
                raise ValueError(f"{name}: expected shape {expected} [N, Hkv, D], got {tuple(x.shape)}")
        slots = slots.to(device=self.device, dtype=torch.int64)
        capacity = self.num_pages * self.page_size
        if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= capacity):
            raise ValueError(f"slots: expected values in [0, {capacity}) (num_pages x page_size), got range "
                             f"[{int(slots.min())}, {int(slots.max())}]")
        pages, offsets = slots // self.page_size, slots % self.page_size
        self.k_cache[layer][pages, offsets] = k.to(self.dtype)
        self.v_cache[layer][pages, offsets] = v.to(self.dtype)
        index = pages[:, None, None].expand_as(k)
        with span("metadata", k_new=k, pages=k.shape[0]):      # incremental box upkeep, for the profiler
            self.k_min[layer].scatter_reduce_(0, index, k.to(self.dtype), "amin")
            self.k_max[layer].scatter_reduce_(0, index, k.to(self.dtype), "amax")

    # ---- tables for the ops ------------------------------------------------------------------------
    def block_table(self, seq_ids: Sequence[int], max_pages: int | None = None) -> torch.Tensor:
        """int32 ``[B, max_pages]`` physical pages per sequence, ``-1`` past each one's last page."""
        seq_ids = list(seq_ids)
        self._check_ids(seq_ids)
        width = max([len(self._pages[s]) for s in seq_ids] + [1]) if max_pages is None else max_pages
        table = torch.full((len(seq_ids), width), -1, dtype=torch.int32)
        for row, seq_id in enumerate(seq_ids):
            pages = self._pages[seq_id][:width]
            table[row, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        return table.to(self.device)

    def seq_lens(self, seq_ids: Sequence[int]) -> torch.Tensor:
        """int32 ``[B]`` valid tokens per sequence."""
        seq_ids = list(seq_ids)
        self._check_ids(seq_ids)
        return torch.tensor([self._lens[s] for s in seq_ids], dtype=torch.int32, device=self.device)

    def _check_ids(self, seq_ids) -> None:
        for seq_id in seq_ids:
            if seq_id not in self._pages:
                raise ValueError(f"seq_id: expected one of the live sequences {sorted(self._pages)}, got {seq_id!r}")
