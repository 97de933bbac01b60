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

KV formats (``kv_cache_dtype``, vLLM's names): ``"auto"`` (the model dtype), ``"fp16"``, ``"bf16"``, ``"int8"``,
``"fp8_e4m3"``. The quantized ones store ``k_cache[layer]`` / ``v_cache[layer]`` as int8 / float8_e4m3fn with
one symmetric fp32 scale per (physical page, KV head) beside the pool: ``k_scale[layer]`` and ``v_scale[layer]``
``[num_pages, Hkv]`` (a value reads ``q * scale``; see :mod:`tinyattn.ops.quant`). Pass them to the ops as
``k_scale=`` / ``v_scale=``.

A page's scales are set by its first write (``absmax / qmax`` of the tokens written, per KV head). When a later
token is larger than the page's scale can hold, the page is **re-quantized**: the scale grows and the codes
already stored are rescaled onto it. Nothing is ever clipped, so a page whose first token is tiny and a later one
huge ends up as if it had been quantized in one go, up to the re-rounding of the earlier tokens. int8: the scale
grows to exactly the new ``absmax / 127`` (each growth re-rounds the earlier codes, by at most half a step of the
new scale). fp8 e4m3: the scale grows by the smallest power of two that holds the new token, so the earlier codes
are rescaled exactly (a power-of-two factor only shifts e4m3 exponents; e4m3's relative precision does not
depend on where the absmax falls in its range, so the up-to-2x larger scale costs nothing above the subnormals).
When tokens are removed from a page that keeps some (:meth:`PagedKVCache.truncate`, a :meth:`~PagedKVCache.fork`
that ends inside a page, and so ``TinyAttnCache.crop``), its scales are refit to the kept tokens: int8 to their
``absmax / 127`` (codes re-rounded once), fp8 shrunk by the largest power of two that still holds them (codes
exact); pages that go back to the pool (``free``, ``drop_pages``, whole pages cut) restart at the next write.

The page boxes of a quantized cache are fp32 boxes of the **dequantized** keys (``code.float() * scale``, the
product attention computes): they grow by the new keys, and a page whose K scale grew (its stored keys changed)
has its box recomputed over its valid slots, so the Quest bound is exact for the keys attention reads. A quantized
write costs more PyTorch calls than a float one (about 6x the time of an fp32 write for stories260K on a CPU,
where such small ops dominate); a fused write kernel would remove that.
"""

from __future__ import annotations

import array
import operator
import warnings
from collections.abc import Sequence

import torch

# torch marks index_reduce_ beta and warns once per process; its semantics here are plain amin / amax
warnings.filterwarnings("ignore", message=r"index_reduce\(\) is in beta")

from .ops import api, quant
from .ops.kv_cache import torch_impl as kv_cache


class CacheFullError(RuntimeError):
    """Raised by :meth:`PagedKVCache.extend` when the pool has too few free pages; nothing was changed."""


class PagedKVCache:
    """Paged K/V storage for ``num_layers`` layers with per-page key bounding boxes.

    Args:
        num_layers: layers that store K/V (each gets its own pool; the allocation is shared).
        num_kv_heads: ``Hkv``. head_dim: ``D``.
        page_size: tokens per page. num_pages: physical pages in the pool (per layer).
        dtype: the model dtype (fp16, bf16, fp32, or fp64 for gradient checks): the K/V dtype with
            ``kv_cache_dtype="auto"``, and what :meth:`write` is given.
        device: where the pools live.
        kv_cache_dtype: the storage format (vLLM's option): ``"auto"`` (= ``dtype``), ``"fp16"``, ``"bf16"``,
            ``"int8"`` or ``"fp8_e4m3"``. The pools then hold that dtype (:attr:`dtype`); quantized formats add
            ``k_scale`` / ``v_scale`` (lists per layer of ``[num_pages, Hkv]`` fp32, else empty lists) and keep
            fp32 boxes. See the module docstring for how a page's scale grows.
        page_boxes: keep the per-page ``k_min``/``k_max`` (default); ``False`` for a plain paged K/V store
            that never scores pages (chunked training's memory): ``k_min``/``k_max`` are then empty lists.
        box_dtype: dtype of the boxes: ``"auto"`` (the pool's dtype, fp32 for int8 / fp8: exact), ``"fp32"``,
            ``"bf16"`` or ``"fp16"``. A box narrower than the keys is rounded outward (``k_min`` down, ``k_max``
            up; :mod:`tinyattn.ops.kv_cache.torch_impl`), so Quest's bound stays an upper bound while scoring reads half the
            bytes (bf16 keeps fp32's range; fp16 boxes of keys beyond 65504 become infinite).
        key_codes: also keep 4-bit codes of the keys (``k_code``: a list per layer of ``[num_pages, page_size, Hkv,
            D/2]`` uint8), written by :meth:`write` when a page fills (:func:`tinyattn.encode_key_codes`, inside the
            page's box): what the re-ranked selection (``rerank="int4"``) reads. ``D`` must be even; needs boxes.
            Default ``False`` (``k_code`` is then an empty list).

    Memory: ``2 * num_layers * num_pages * page_size * Hkv * D`` elements for K/V, plus
    ``2 * num_layers * num_pages * Hkv * D`` for the boxes (of ``box_dtype``), plus ``2 * num_layers * num_pages * Hkv`` fp32
    scales for int8 / fp8, plus ``num_layers * num_pages * page_size * Hkv * D / 2`` bytes of key codes with
    ``key_codes=True`` (1/8 of fp32 keys; see :attr:`kv_bytes`).

    Pages are owned here: besides :meth:`extend` / :meth:`free`, :meth:`fork` (copy a sequence, beam search),
    :meth:`truncate` (crop, boxes kept exact), :meth:`resize` (grow or shrink the pool, contents kept),
    :meth:`drop_pages` (evict pages, positions kept) and :meth:`copy_pages`.

    Raises:
        ValueError for sizes below 1, ``device="cuda"`` where torch has no CUDA device, a ``kv_cache_dtype`` not in :data:`tinyattn.ops.quant.KV_CACHE_DTYPES` or a
        ``box_dtype`` not in :data:`tinyattn.ops.quant.BOX_DTYPES` (the message names the supported set); :class:`CacheFullError` from :meth:`extend` when out of pages.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, *, page_size: int, num_pages: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", page_boxes: bool = True,
                 kv_cache_dtype: str = "auto", box_dtype: str = "auto", key_codes: bool = False):
        for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                            ("page_size", page_size), ("num_pages", num_pages)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.page_size, self.num_pages = page_size, num_pages
        storage = quant.storage_dtype(kv_cache_dtype, dtype)
        self.kv_cache_dtype, self.model_dtype = kv_cache_dtype, dtype
        self.dtype, self.device = storage, torch.device(device)         # dtype: what the pools hold
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device: expected a device this torch can allocate on, got {str(device)!r}, but torch "
                             f"{torch.__version__} sees no CUDA device (torch.cuda.is_available() is False): use "
                             f"device='cpu', or install a CUDA build of torch on a machine with a GPU")
        if self.device.type != "cpu" and self.device.index is None:     # "cuda" -> "cuda:0": compares to tensors'
            self.device = torch.empty(0, device=self.device).device
        self.quantized = quant.is_quantized(storage)
        pool = (num_pages, page_size, num_kv_heads, head_dim)
        box = (num_pages, num_kv_heads, head_dim)
        self.box_dtype = box_dtype = quant.box_dtype_for(box_dtype, storage, self.quantized)
        self.k_cache = [torch.zeros(pool, dtype=storage, device=self.device) for _ in range(num_layers)]
        self.v_cache = [torch.zeros(pool, dtype=storage, device=self.device) for _ in range(num_layers)]
        scale_layers = num_layers if self.quantized else 0
        self.k_scale = [torch.zeros(num_pages, num_kv_heads, device=self.device) for _ in range(scale_layers)]
        self.v_scale = [torch.zeros(num_pages, num_kv_heads, device=self.device) for _ in range(scale_layers)]
        # quantized: valid slots written so far per physical page (a re-quantized page's box is refit over them)
        self._fill = torch.zeros(num_pages if self.quantized else 0, dtype=torch.int64, device=self.device)
        box_layers = num_layers if page_boxes else 0
        self.k_min = [torch.full(box, float("inf"), dtype=box_dtype, device=self.device) for _ in range(box_layers)]
        self.k_max = [torch.full(box, float("-inf"), dtype=box_dtype, device=self.device) for _ in range(box_layers)]
        if key_codes and (not page_boxes or head_dim % 2):
            raise ValueError(f"key_codes: expected page_boxes=True and an even head_dim (4-bit codes inside each "
                             f"page's box, two per byte), got page_boxes={page_boxes}, head_dim={head_dim}")
        code = (num_pages, page_size, num_kv_heads, head_dim // 2)
        self.k_code = [torch.zeros(code, dtype=torch.uint8, device=self.device)
                       for _ in range(num_layers if key_codes else 0)]
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
        self._free.extend(p for p in reversed(self._pages.pop(seq_id)) if p >= 0)   # -1: a dropped page
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
        """Physical pages of a sequence, in logical order (a copy); ``-1`` for a page :meth:`drop_pages` evicted."""
        self._check_ids([seq_id])
        return list(self._pages[seq_id])

    @property
    def kv_bytes(self) -> int:
        """Bytes of the K/V pools, bounding boxes and scales (int8 / fp8), all layers."""
        tensors = self.k_cache + self.v_cache + self.k_min + self.k_max + self.k_scale + self.v_scale + self.k_code
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
        for seq_id, count in zip(seq_ids, counts):
            pages, length = self._pages[seq_id], self._lens[seq_id]
            if count and length % self.page_size and pages[-1] < 0:
                raise ValueError(f"seq_ids: sequence {seq_id} ends inside logical page {len(pages) - 1}, which was "
                                 f"dropped (a fork or truncate of a sequence with dropped pages); it cannot receive "
                                 f"tokens. No sequence was changed.")
        needed = [self._pages_needed(s, c) for s, c in zip(seq_ids, counts)]
        if sum(needed) > len(self._free):
            raise CacheFullError(f"PagedKVCache is out of pages: the request needs {sum(needed)} new pages, "
                                 f"{len(self._free)} of {self.num_pages} are free (page_size {self.page_size}); "
                                 f"free a sequence or build a larger cache. No sequence was changed.")
        slots: list[int] = []
        page_size = self.page_size
        for seq_id, n_new in zip(seq_ids, needed):
            self._take_pages(seq_id, n_new)
        for seq_id, count in zip(seq_ids, counts):
            start, pages = self._lens[seq_id], self._pages[seq_id]
            slots.extend(pages[t // page_size] * page_size + t % page_size for t in range(start, start + count))
            self._lens[seq_id] = start + count
        out = _int_tensor(slots, "q", torch.int64).to(self.device, non_blocking=True)   # no host sync (GPU)
        # write() trusts exactly these slots (no range check, no host sync) unless one lands in a dropped page
        self._issued = (out, None) if min(slots, default=0) >= 0 else None     # pages: computed when needed
        return out

    def _pages_needed(self, seq_id: int, count: int) -> int:
        total = -(-(self._lens[seq_id] + count) // self.page_size)
        return max(total - len(self._pages[seq_id]), 0)

    def _take_pages(self, seq_id: int, count: int) -> None:
        """Append ``count`` free pages to the sequence, each empty: its box reset (the first write sets it), and for
        int8 / fp8 a zero scale and no valid slot. One op per layer and tensor, whatever ``count``."""
        if count == 0:
            return
        new = [self._free.pop() for _ in range(count)]
        pages = _int_tensor(new, "q", torch.int64).to(self.device, non_blocking=True)   # no host sync (GPU)
        for k_min, k_max in zip(self.k_min, self.k_max):
            kv_cache.reset_boxes(k_min, k_max, pages)
        for scale in self.k_scale + self.v_scale:
            scale.index_fill_(0, pages, 0.0)
        if self.quantized:
            self._fill.index_fill_(0, pages, 0)
        self._pages[seq_id].extend(new)

    # ---- page operations: copy, fork, resize, truncate, drop ----------------------------------------
    def copy_pages(self, src, dst) -> None:
        """Copy physical pages ``src`` onto pages ``dst`` (one for one): K, V, boxes and scales, in every layer.

        All of ``src`` is read before anything is written, so the lists may overlap; ``dst`` must not repeat a
        page. No sequence's page list changes: this is the primitive under :meth:`fork` (beam search).

        Raises:
            ValueError: ids outside ``[0, num_pages)``, lists of different lengths, a repeated ``dst`` page.
        """
        src_ids, dst_ids = self._page_ids("src", src), self._page_ids("dst", dst)
        if len(src_ids) != len(dst_ids):
            raise ValueError(f"dst: expected as many pages as src ({len(src_ids)}), got {len(dst_ids)}")
        if len(set(dst_ids)) != len(dst_ids):
            raise ValueError("dst: expected distinct pages, got a repeated page id")
        if not src_ids:
            return
        s = torch.tensor(src_ids, dtype=torch.int64, device=self.device)
        d = torch.tensor(dst_ids, dtype=torch.int64, device=self.device)
        for pools in (self.k_cache, self.v_cache, self.k_min, self.k_max, self.k_scale, self.v_scale, self.k_code):
            for t in pools:
                t[d] = t[s]
        if self.quantized:
            self._fill[d] = self._fill[s]

    def fork(self, seq_id: int, num_tokens: int | None = None) -> int:
        """A new sequence holding a copy of the first ``num_tokens`` tokens of ``seq_id`` (default: all of them).

        Copy on fork: the new sequence gets pages of its own (``ceil(num_tokens / page_size)``, fewer if some
        were dropped by :meth:`drop_pages`: those stay dropped in the copy), so both sequences can grow apart
        (beam search, ``num_return_sequences``). Boxes are copied, and when the copy ends inside a page that
        ``seq_id`` holds more tokens of, that page's box is recomputed from the copied keys: every box is exact.

        Raises:
            CacheFullError: too few free pages; nothing changed.
            ValueError: unknown ``seq_id``, ``num_tokens`` outside ``[0, length(seq_id)]``.
        """
        self._check_ids([seq_id])
        length = self._lens[seq_id]
        n = length if num_tokens is None else self._token_count("num_tokens", num_tokens, length)
        src = self._pages[seq_id][: -(-n // self.page_size)]
        held = [p for p in src if p >= 0]
        if len(held) > len(self._free):
            raise CacheFullError(f"PagedKVCache is out of pages: fork needs {len(held)} new pages, {len(self._free)} "
                                 f"of {self.num_pages} are free; free a sequence or resize() the cache. "
                                 f"No sequence was changed.")
        new = self.add_sequence()
        for p in src:
            if p >= 0:
                self._take_pages(new, 1)
            else:
                self._pages[new].append(-1)
        self.copy_pages(held, [p for p in self._pages[new] if p >= 0])
        self._lens[new] = n
        if n < length:
            self._refit_last_box(new)
        return new

    def truncate(self, seq_id: int, length: int) -> None:
        """Keep the first ``length`` tokens of ``seq_id`` (crop, speculative-decoding rollback).

        Whole pages past ``length`` go back to the pool. A new partial last page keeps its K/V (the slots past
        ``length`` are never read, and the next :meth:`write` overwrites them), and its box is **recomputed**
        from the keys of its remaining valid slots: boxes stay exact, not merely a sound upper bound. int8 / fp8:
        that page's K and V scales are first refit to its kept tokens (module docstring), so tokens written after
        a rollback are not quantized on the coarse scale of larger tokens that were cut (kvcached#362).

        Raises:
            ValueError: unknown ``seq_id``, ``length`` outside ``[0, length(seq_id)]``.
        """
        self._check_ids([seq_id])
        old = self._lens[seq_id]
        n = self._token_count("length", length, old)
        if n == old:
            return
        pages = self._pages[seq_id]
        keep = -(-n // self.page_size)
        self._free.extend(p for p in reversed(pages[keep:]) if p >= 0)
        del pages[keep:]
        self._lens[seq_id] = n
        self._issued = None                      # slots handed out by extend() may point into freed pages
        self._refit_last_box(seq_id)

    def resize(self, num_pages: int) -> None:
        """Give the pool ``num_pages`` pages per layer, keeping every sequence, its page ids and their contents.

        Growing adds free pages (handed out after the pages already free); shrinking is allowed down to one
        page past the highest page in use. The per-layer tensors are replaced by new ones: read
        ``cache.k_cache[layer]`` (and the other lists) again after a resize.

        Raises:
            ValueError: ``num_pages`` < 1, or not above the highest page id in use (nothing changed).
        """
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1:
            raise ValueError(f"num_pages: expected an int >= 1, got {num_pages!r}")
        highest = max((p for pages in self._pages.values() for p in pages), default=-1)
        if num_pages <= highest:
            raise ValueError(f"num_pages: expected more than {highest} (the highest page id in use), got {num_pages}")
        old = self.num_pages
        if num_pages == old:
            return
        keep = min(old, num_pages)

        def resized(t: torch.Tensor, fill: float) -> torch.Tensor:
            out = torch.full((num_pages, *t.shape[1:]), fill, dtype=t.dtype, device=t.device)
            out[:keep] = t[:keep]
            return out

        self.k_cache = [resized(t, 0.0) for t in self.k_cache]
        self.v_cache = [resized(t, 0.0) for t in self.v_cache]
        self.k_min = [resized(t, float("inf")) for t in self.k_min]
        self.k_max = [resized(t, float("-inf")) for t in self.k_max]
        self.k_code = [resized(t, 0) for t in self.k_code]
        self.k_scale = [resized(t, 0.0) for t in self.k_scale]
        self.v_scale = [resized(t, 0.0) for t in self.v_scale]
        if self.quantized:
            fill = torch.zeros(num_pages, dtype=torch.int64, device=self.device)
            fill[:keep] = self._fill[:keep]
            self._fill = fill
        if num_pages > old:
            self._free = list(range(num_pages - 1, old - 1, -1)) + self._free
        else:
            self._free = [p for p in self._free if p < num_pages]
        self.num_pages = num_pages
        self._issued = None

    def drop_pages(self, seq_id: int, logical_pages) -> None:
        """Evict logical pages of ``seq_id``: their physical pages go back to the pool.

        The sequence keeps its length and every other page its logical position (positions, RoPE and causal
        masks are unchanged); a dropped page reads as ``-1`` in :meth:`pages` and :meth:`block_table`, and is
        never written again. Attend to the pages still held through ``page_indices``, with the table's ``-1``
        entries replaced by any valid page id, e.g. ``block_table.clamp(min=0)`` (the ops check the id of every
        page below ``seq_lens``, listed or not; KV retention in :class:`tinyattn.training.ChunkedKVMemory` does
        this). The partial last page, which still receives tokens, cannot be dropped.

        Raises:
            ValueError: unknown ``seq_id``; a page outside the sequence, already dropped, repeated, or the
            partial last page. Nothing changed.
        """
        self._check_ids([seq_id])
        pages = self._pages[seq_id]
        wanted = self._page_ids("logical_pages", logical_pages, limit=len(pages), what="logical pages of the sequence")
        if len(set(wanted)) != len(wanted):
            raise ValueError("logical_pages: expected distinct pages, got a repeated page")
        partial = len(pages) - 1 if self._lens[seq_id] % self.page_size else None
        for j in wanted:
            if pages[j] < 0:
                raise ValueError(f"logical_pages: page {j} of sequence {seq_id} was already dropped")
            if j == partial:
                raise ValueError(f"logical_pages: page {j} is the partial last page of sequence {seq_id} (it still "
                                 f"receives tokens) and cannot be dropped")
        for j in wanted:
            self._free.append(pages[j])
            pages[j] = -1
        self._issued = None

    def _page_ids(self, name: str, ids, *, limit: int | None = None, what: str = "physical page ids") -> list[int]:
        limit = self.num_pages if limit is None else limit
        try:
            out = [operator.index(i) for i in (ids.reshape(-1).tolist() if isinstance(ids, torch.Tensor) else ids)]
        except TypeError:
            raise TypeError(f"{name}: expected a sequence or tensor of ints, got {type(ids).__name__}") from None
        bad = [i for i in out if not 0 <= i < limit]
        if bad:
            raise ValueError(f"{name}: expected {what} in [0, {limit}), got {bad[0]}")
        return out

    @staticmethod
    def _token_count(name: str, value, maximum: int) -> int:
        if isinstance(value, bool) or not hasattr(value, "__index__") or not 0 <= operator.index(value) <= maximum:
            raise ValueError(f"{name}: expected an int in [0, {maximum}] (the sequence's length), got {value!r}")
        return operator.index(value)

    def _refit_last_box(self, seq_id: int) -> None:
        """After a cut inside the sequence's last page: refit that page in every layer to its valid slots (int8 /
        fp8 scales shrunk to the kept tokens, then the box recomputed: :func:`tinyattn.ops.kv_cache.torch_impl.refit_page`)."""
        valid = self._lens[seq_id] % self.page_size
        pages = self._pages[seq_id]
        if not valid or not pages or pages[-1] < 0:
            return
        page = pages[-1]
        if self.quantized:
            self._fill[page] = valid
        for layer in range(self.num_layers):
            scales = (self.k_scale[layer], self.v_scale[layer]) if self.quantized else (None, None)
            box = (self.k_min[layer], self.k_max[layer]) if self.k_min else (None, None)
            kv_cache.refit_page(self.k_cache[layer], self.v_cache[layer], *box, *scales, page, valid)

    # ---- K/V -----------------------------------------------------------------------------------
    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
              backend: str | None = None, trusted: bool = False) -> None:
        """Store ``k``, ``v`` ``[N, Hkv, D]`` at ``slots`` ``[N]`` of ``layer`` and grow the pages' boxes.

        The write op :func:`tinyattn.ops.api.write_kv`: on CUDA pools the fused Triton kernel (one launch per
        layer, every KV format), on a CPU its PyTorch twin; ``backend`` (``"torch"`` / ``"triton"``) forces one
        (``"triton"`` on a CPU needs ``TRITON_INTERPRET=1``). Boxes only grow: overwriting a slot that already held
        a key leaves its page's box looser than needed (still an upper bound, so selection stays safe);
        :func:`tinyattn.update_page_metadata` recomputes it exactly. With ``key_codes``, a write codes the pages whose
last slot it covers, and a write with the caller's slots also every full page it touches (an overwritten key grows
the box every code of the page is relative to). Raises ``TypeError``/``ValueError`` for
        non-integer or out-of-pool ``slots`` and mismatched ``k``/``v`` shapes, before anything is written.
        ``trusted``: ``slots`` (int64, on the cache's device) are in range by construction, e.g. copied from
        :meth:`extend`'s into a CUDA graph's static buffer: the range check and its host sync are skipped, as for
        :meth:`extend`'s own tensor.
        """
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer: expected an int in [0, {self.num_layers}), got {layer}")
        if not isinstance(slots, torch.Tensor) or slots.dtype not in (torch.int32, torch.int64) or slots.dim() != 1:
            got = f"{slots.dtype} tensor of shape {tuple(slots.shape)}" if isinstance(slots, torch.Tensor) \
                else type(slots).__name__
            raise TypeError(f"slots: expected a 1-D int32/int64 tensor (from extend()), got {got}")
        expected = (slots.shape[0], self.num_kv_heads, self.head_dim)
        for name, x in (("k", k), ("v", v)):
            if not isinstance(x, torch.Tensor) or tuple(x.shape) != expected:
                got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise ValueError(f"{name}: expected shape {expected} [N, Hkv, D], got {got}")
            if not x.is_floating_point() or x.device != self.device:
                raise TypeError(f"{name}: expected a float tensor on {self.device}, got {x.dtype} on {x.device}")
        issued = getattr(self, "_issued", None)
        code_slots = slots
        if issued is not None and slots is issued[0]:          # made by extend(): in range by construction
            if issued[1] is None:                              # its pages, once for every layer
                self._issued = issued = (slots, torch.div(slots, self.page_size, rounding_mode="floor"))
            pages = issued[1]
        elif trusted:
            pages = None
        else:
            slots = slots.to(device=self.device, dtype=torch.int64)
            capacity = self.num_pages * self.page_size
            if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= capacity):
                raise ValueError(f"slots: expected values in [0, {capacity}) (num_pages x page_size), got range "
                                 f"[{int(slots.min())}, {int(slots.max())}]")
            pages = slots // self.page_size
            if self.k_code:     # the caller's slots may overwrite a full page: code it again
                code_slots = self._slots_to_code(slots, pages)
        boxes_on = bool(self.k_min)
        # the cache made every other tensor: the op's own argument checks are skipped (trusted)
        api.write_kv(k, v, slots, self.k_cache[layer], self.v_cache[layer],
                     k_min=self.k_min[layer] if boxes_on else None, k_max=self.k_max[layer] if boxes_on else None,
                     k_scale=self.k_scale[layer] if self.quantized else None,
                     v_scale=self.v_scale[layer] if self.quantized else None,
                     fill=self._fill if self.quantized else None, pages=pages, backend=backend, trusted=True)
        if self.k_code:          # the pages this write filled (or changed when full): their codes, in the grown boxes
            api.encode_key_codes(self.k_cache[layer], code_slots, self.k_min[layer], self.k_max[layer],
                                 self.k_code[layer], k_scale=self.k_scale[layer] if self.quantized else None,
                                 backend=backend, trusted=True)

    def _slots_to_code(self, slots: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
        """``slots`` plus the last slot of every full page they touch: the key-code writer codes the pages whose last
        slot a write covers, and a slot overwritten in a full page grows the box that every code of the page is
        relative to (the page is coded again, whole). A page is partial when it is the last page of a sequence
        whose length ends inside it; pages of no sequence count as full. For a write with slots of the caller's
        (not :meth:`extend`'s): its range check has already read them on the host."""
        page_size = self.page_size
        partial = {p[-1] for sid, p in self._pages.items() if p and self._lens[sid] % page_size}
        given = set(slots.tolist())
        ends = ((pg + 1) * page_size - 1 for pg in sorted(set(pages.tolist())) if pg not in partial)
        last = [slot for slot in ends if slot not in given]
        if not last:
            return slots
        return torch.cat([slots, torch.tensor(last, dtype=slots.dtype, device=slots.device)])

    # ---- tables for the ops ------------------------------------------------------------------------
    def block_table(self, seq_ids: Sequence[int], max_pages: int | None = None) -> torch.Tensor:
        """int32 ``[B, max_pages]`` physical pages per sequence, ``-1`` past each one's last page."""
        seq_ids = list(seq_ids)
        self._check_ids(seq_ids)
        width = max([len(self._pages[s]) for s in seq_ids] + [1]) if max_pages is None else max_pages
        flat = []
        for s in seq_ids:
            pages = self._pages[s][:width]
            flat += pages + [-1] * (width - len(pages))
        return _int_tensor(flat, "i", torch.int32).view(len(seq_ids), width).to(self.device, non_blocking=True)

    def seq_lens(self, seq_ids: Sequence[int]) -> torch.Tensor:
        """int32 ``[B]`` valid tokens per sequence."""
        seq_ids = list(seq_ids)
        self._check_ids(seq_ids)
        return _int_tensor([self._lens[s] for s in seq_ids], "i", torch.int32).to(self.device, non_blocking=True)

    def _check_ids(self, seq_ids) -> None:
        for seq_id in seq_ids:
            if seq_id not in self._pages:
                raise ValueError(f"seq_id: expected one of the live sequences {sorted(self._pages)}, got {seq_id!r}")


def _int_tensor(values: list, typecode: str, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of Python ints through a packed ``array.array`` (one memcpy): ``torch.tensor(list)`` reads
    the list element by element, 3-4x slower, and the cache builds its tables once per decode step."""
    if not values:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(array.array(typecode, values), dtype=dtype)
