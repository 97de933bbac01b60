"""Hugging Face ``transformers`` integration: query-aware sparse decoding by changing two lines.

Importing this module registers an attention implementation named ``"tinyattn"`` (through
``transformers.AttentionInterface``, with ``transformers``' SDPA mask builder registered for it in
``AttentionMaskInterface``) and provides :class:`TinyAttnCache`, a ``transformers`` cache backed by
:class:`tinyattn.cache.PagedKVCache`::

    import tinyattn.integrations.hf                       # registers "tinyattn"
    from tinyattn.integrations.hf import TinyAttnCache

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="tinyattn")
    out = model.generate(**inputs, cache=TinyAttnCache(model.config, page_size=16, page_budget=64))

(``past_key_values=`` is the older name of the ``cache=`` argument; transformers 5.x still accepts it.)

How a forward pass goes through it, per attention layer:

1. The model projects K/V, applies RoPE (keys are cached **after** RoPE, as Quest's page bounds need)
   and calls ``cache.update(k, v, layer_idx)``. :meth:`TinyAttnCache.update` only records the new
   states; it returns them unchanged.
2. The model calls the registered attention function with those states and the 4D mask. The first
   layer of each forward reads which new tokens are real from the mask (left padding), allocates
   pages for the real tokens only, and every layer writes its real keys/values into its page pool
   (:meth:`PagedKVCache.write` grows each touched page's ``k_min``/``k_max``). Padding never enters a
   page, so each batch row's block table holds exactly its own tokens and a left-padded batch gives
   the same result as running each sequence alone.
3. Attention:

   - **prefill into an empty cache**: ``transformers``' own SDPA function on the new states with the
     model's mask — bit-for-bit the computation stock ``attn_implementation="sdpa"`` does, which is
     why it is used rather than :func:`tinyattn.paged_attention` (which agrees to ~1e-7 but not
     bitwise);
   - otherwise the one attention layer of the package (:class:`tinyattn.layer.PagedAttention`, planned
     once per forward pass, run per layer): **more tokens into a non-empty cache** (chunked prefill,
     assisted decoding) attend densely with ``q`` ``[B, T, Hq, D]``, bottom-right causal; **decode** (one
     token per row) selects ``page_budget`` pages with the cache's page bounds (Quest) or the chosen
     ``policy`` in layers ``>= dense_layers``, and is dense in the first ``dense_layers`` layers and
     everywhere when ``page_budget is None``.

   The softmax scale is the ``scaling`` argument the model passes (OPT pre-scales its queries and
   passes ``1.0``; GPT-2's ``scale_attn_by_inverse_layer_idx`` is folded into it). A sliding-window
   layer is recognised by the ``sliding_window`` argument the model passes for it (Mistral, Qwen2/3,
   Gemma, SmolLM3 hybrids: ``W`` tokens, the query included): its query at position ``i`` sees keys
   ``i - W < j <= i`` (``window_left = W - 1`` of the attention layer), densely at every step; the cache
   keeps every token of every layer, so full-attention (e.g. NoPE) layers of the same model see them all.

Used without a :class:`TinyAttnCache` (``use_cache=False``, training, perplexity), ``"tinyattn"`` is
plain SDPA; used with another cache it is SDPA too, with a one-time warning (that decode is dense).

Supported: causal LMs whose attention goes through ``AttentionInterface`` and calls
``cache.update(k, v, layer_idx)`` — tested: Llama (GQA), Mistral, Qwen2, GPT-2, OPT, SmolLM3 (sliding-window
+ NoPE hybrids, what :mod:`tinyattn.integrations.convert` makes of a hybrid tinyattn model). See
``docs/huggingface.md`` for the feature table and what raises.
"""

from __future__ import annotations

import threading
import warnings
import weakref

import torch

try:
    import transformers
    from transformers import AttentionInterface
    from transformers.cache_utils import Cache
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("tinyattn.integrations.hf needs transformers: pip install 'tinyattn[hf]' "
                      "(transformers>=5.24,<6 and safetensors)") from e

import tinyattn
from tinyattn.cache import CacheFullError, PagedKVCache
from tinyattn.layer import PagedAttention, SparsityConfig, default_num_sink_pages
from tinyattn.ops.validation import check_selection_options
from tinyattn.ops import quant

__all__ = ["TinyAttnCache", "tinyattn_attention_forward", "ATTN_IMPLEMENTATION", "register"]

ATTN_IMPLEMENTATION = "tinyattn"

# The cache whose ``update`` ran last on this thread; the attention function checks that the key it
# receives is the very tensor that update returned before it trusts it (see TinyAttnCache._owns).
_CURRENT = threading.local()
_warned_dense = False


def tinyattn_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The ``"tinyattn"`` attention function (``AttentionInterface`` signature).

    Args:
        module: the attention module; ``module.layer_idx`` names the cache layer.
        query: ``[B, Hq, T, D]``. key, value: ``[B, Hkv, T, D]`` as returned by ``cache.update``.
        attention_mask: the 4D mask ``transformers`` built (boolean, from ``sdpa_mask``) or ``None``.
        scaling: softmax scale passed by the model. dropout: must be 0 when the cache is used.

    Returns:
        ``(attn_output [B, T, Hq, D], None)`` (attention weights are never materialised).
    """
    ref = getattr(_CURRENT, "cache", None)
    cache = ref() if ref is not None else None
    layer_idx = getattr(module, "layer_idx", None)
    if cache is None or not cache._owns(layer_idx, key):
        if key.shape[2] > query.shape[2]:
            _warn_dense_once()
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    return cache._attend(module, query, key, value, attention_mask, scaling, dropout, kwargs)


def _warn_dense_once() -> None:
    global _warned_dense
    if not _warned_dense:
        _warned_dense = True
        warnings.warn("attn_implementation='tinyattn' is decoding with a cache that is not a TinyAttnCache: "
                      "attention falls back to dense SDPA. Pass cache=TinyAttnCache(model.config, ...) to "
                      "generate() for query-aware sparse decoding.", stacklevel=3)


def register() -> None:
    """Register ``"tinyattn"`` in ``AttentionInterface`` and ``AttentionMaskInterface`` (done on import).

    The mask builder is ``transformers``' own ``sdpa_mask``: without a registered mask function,
    ``transformers`` passes no mask at all to custom attention functions, and padding would be lost.
    """
    AttentionInterface.register(ATTN_IMPLEMENTATION, tinyattn_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


register()


def _allowed(mask: torch.Tensor) -> torch.Tensor:
    """Boolean "may attend" from a boolean or additive float 4D mask."""
    if mask.dtype == torch.bool:
        return mask
    return mask > torch.finfo(mask.dtype).min / 2


class _LayerView:
    """Stand-in for ``cache.layers[i]`` so that ``transformers``' per-layer introspection works."""

    is_sliding = False
    is_compileable = False
    is_croppable = True
    supports_early_init = False

    def __init__(self, cache: "TinyAttnCache", layer_idx: int):
        self._cache = weakref.ref(cache)
        self.layer_idx = layer_idx

    @property
    def is_initialized(self) -> bool:
        return self._cache()._pool is not None

    @property
    def keys(self):
        return self._cache().to_dense(self.layer_idx)[0]

    @property
    def values(self):
        return self._cache().to_dense(self.layer_idx)[1]

    def get_seq_length(self) -> int:
        return self._cache().get_seq_length()

    def get_max_length(self) -> int:
        return -1

    def __repr__(self):
        return f"TinyAttnCacheLayer({self.layer_idx})"


class TinyAttnCache(Cache):
    """A ``transformers`` cache backed by a :class:`tinyattn.cache.PagedKVCache`.

    Each batch row is one sequence of the page pool (real tokens only: left padding is stripped),
    the pool is shared by all rows and grows by doubling when it runs out of pages, and every
    page keeps the per-channel ``k_min``/``k_max`` of its keys (after RoPE) that Quest scores.

    Args:
        config: the model's config (``model.config``): number of layers, and the attention
            implementation, which must be ``"tinyattn"``.
        page_size: tokens per page.
        page_budget: pages attended per (row, KV head) at each decode step in sparse layers;
            ``None`` = dense decode (the baseline). Token budget = ``page_budget * page_size``.
        num_sink_pages: leading pages always kept (attention sinks); ``None`` (default): one when
            ``page_budget >= 16`` (:func:`tinyattn.layer.default_num_sink_pages`).
        num_recent_pages: trailing pages always kept (the page being written always is).
        dense_layers: the first ``dense_layers`` layers stay dense at decode too (Quest keeps 2).
        num_pages: initial pool size in pages (per layer); ``None`` sizes it from the first forward.
            The pool doubles whenever it is full.
        backend: ``None`` (by device: Triton on CUDA or under ``TRITON_INTERPRET=1``, else PyTorch),
            ``"torch"`` or ``"triton"``, passed to every tinyattn op.
        policy: page-selection policy of the sparse layers, as :class:`tinyattn.models.LlamaRuntime`'s:
            ``"quest"`` (default), ``"questmass"``, ``"meanstd"``, ``"oracle"``, ``"streaming"``, ``"h2o"``,
            ``"random"`` or a :class:`tinyattn.selection.SelectionPolicy`.
        kv_cache_dtype: storage format of the pool (vLLM's option): ``"auto"`` (the model's dtype), ``"fp16"``,
            ``"bf16"``, ``"int8"`` or ``"fp8_e4m3"`` (per-(page, KV head) scales, see
            :class:`tinyattn.PagedKVCache`). The first prefill into an empty cache attends over the new states as
            the model computed them (stock SDPA); every later step reads the stored format.
        box_dtype: dtype of the page boxes: ``"auto"`` (the pool's dtype, fp32 for int8 / fp8; exact), ``"fp32"``,
            ``"bf16"`` or ``"fp16"`` (rounded outward, :mod:`tinyattn.ops.kv_cache.torch_impl`).

    The pool's pages are managed by the :class:`PagedKVCache` itself: it grows in place
    (:meth:`~PagedKVCache.resize`); beam search (``reorder_cache``), ``num_return_sequences`` and
    ``batch_select_indices`` / ``batch_repeat_interleave`` keep a row's pages for its first copy and give
    every further copy pages of its own (:meth:`~PagedKVCache.fork`, as ``DynamicCache`` copies its
    tensors); ``crop`` truncates each row (:meth:`~PagedKVCache.truncate`, exact bounds).

    Raises:
        ValueError for bad options; at run time, ValueError for right padding or masks with holes,
        a batch size that changes without ``reorder_cache``, dropout in training mode, a model that
        does not use ``attn_implementation="tinyattn"``; NotImplementedError for rows longer than the
        chunk of a chunked-attention layer (Llama 4).
    """

    is_compileable = False

    def __init__(self, config, *, page_size: int = 16, page_budget: int | None = None,
                 num_sink_pages: int | None = None, num_recent_pages: int = 1, dense_layers: int = 0,
                 num_pages: int | None = None, backend: str | None = None, policy="quest",
                 kv_cache_dtype: str = "auto", box_dtype: str = "auto"):
        if num_sink_pages is None:             # the library's default recipe (tinyattn.layer)
            num_sink_pages = default_num_sink_pages(page_budget if isinstance(page_budget, int) else None,
                                                    num_recent_pages if isinstance(num_recent_pages, int) else 1)
        for name, value, low in (("page_size", page_size, 1), ("num_sink_pages", num_sink_pages, 0),
                                 ("num_recent_pages", num_recent_pages, 0), ("dense_layers", dense_layers, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}: expected an int >= {low}, got {value!r}")
        for name, value in (("page_budget", page_budget), ("num_pages", num_pages)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}: expected None or an int >= 1, got {value!r}")
        if page_budget is not None:   # the ops' rule and message: sinks + max(recent, 1) <= budget
            check_selection_options(page_budget, num_sink_pages, num_recent_pages)
        if backend not in (None, "torch", "triton"):
            raise ValueError(f"backend: expected None, 'torch' or 'triton', got {backend!r}")
        quant.storage_dtype(kv_cache_dtype, torch.float32)       # ValueError naming the supported formats
        quant.box_dtype_for(box_dtype, torch.float32, False)      # ValueError naming the box dtypes
        self.kv_cache_dtype, self.box_dtype = kv_cache_dtype, box_dtype
        if config is None or not hasattr(config, "get_text_config"):
            raise ValueError(f"config: expected the model's transformers config (model.config), got {config!r}")
        text_config = config.get_text_config(decoder=True)
        self.config = config
        self.num_layers = int(text_config.num_hidden_layers)
        if dense_layers > self.num_layers:
            raise ValueError(f"dense_layers: expected at most the model's {self.num_layers} layers, got {dense_layers}")
        self.page_size, self.page_budget = page_size, page_budget
        self.num_sink_pages, self.num_recent_pages, self.dense_layers = num_sink_pages, num_recent_pages, dense_layers
        self.num_pages, self.backend = num_pages, backend
        self.attention_chunk = self._attention_chunk(text_config)
        # the one attention layer (tinyattn.layer): dense / fused Quest / policy decision per layer, one plan
        self._attention = PagedAttention(SparsityConfig(page_budget=page_budget, num_sink_pages=num_sink_pages,
                                                        num_recent_pages=num_recent_pages,
                                                        dense_layers=dense_layers, policy=policy), backend=backend)
        super().__init__(layers=[_LayerView(self, i) for i in range(self.num_layers)])
        self._clear()

    @staticmethod
    def _attention_chunk(cfg) -> int | None:
        """Tokens per chunk of a model with ``"chunked_attention"`` layers (Llama 4), which the paged ops do not
        model: rows are refused past one chunk, where chunked and causal attention still agree."""
        types = getattr(cfg, "layer_types", None) or ()
        chunk = getattr(cfg, "attention_chunk_size", None)
        return chunk if "chunked_attention" in types and isinstance(chunk, int) and chunk > 0 else None

    def _clear(self) -> None:
        self._pool: PagedKVCache | None = None
        self._seq_ids: list[int] = []
        self._real = torch.zeros(0, 0, dtype=torch.bool)   # [B, hf_len] which columns held real tokens
        self._hf_len = 0
        self._chunk = 0
        self._layer_chunk = [0] * self.num_layers
        self._chunk_len = 0
        self._chunk_shape = None
        self._prepared = False
        self._pending = None

    def __repr__(self):
        return (f"TinyAttnCache(page_size={self.page_size}, page_budget={self.page_budget}, "
                f"num_sink_pages={self.num_sink_pages}, num_recent_pages={self.num_recent_pages}, "
                f"dense_layers={self.dense_layers}, backend={self.backend!r}, batch_size={self.batch_size}, "
                f"seq_length={self._hf_len})")

    # ------------------------------------------------------------------ the Cache interface
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Record the new ``[B, Hkv, T, D]`` states of ``layer_idx``; return them unchanged.

        They are written into the page pool by the ``"tinyattn"`` attention function, which sees the
        attention mask (needed to leave left padding out of the pages).
        """
        if (type(layer_idx) is int and 0 < layer_idx < self.num_layers and self._layer_chunk[layer_idx] != self._chunk
                and self._layer_chunk[layer_idx - 1] == self._chunk and key_states.shape == self._chunk_shape
                and value_states.shape == self._chunk_shape):
            # the next layer of the pass in progress, with the states' shape its first layer was checked with
            self._layer_chunk[layer_idx] = self._chunk
            self._pending = (layer_idx, key_states, value_states)
            _CURRENT.cache = weakref.ref(self)
            return key_states, value_states
        first = self._layer_chunk[layer_idx] == self._chunk if type(layer_idx) is int and \
            0 <= layer_idx < self.num_layers else True
        impl = getattr(self.config, "_attn_implementation", None) if first else ATTN_IMPLEMENTATION
        if impl != ATTN_IMPLEMENTATION:            # checked on the first layer of each forward pass
            raise ValueError(f"TinyAttnCache: expected a model loaded with attn_implementation="
                             f"'{ATTN_IMPLEMENTATION}' (after `import tinyattn.integrations.hf`), got "
                             f"attn_implementation={impl!r}; with another implementation the model would attend "
                             f"only to the new tokens")
        if type(layer_idx) is not int or not 0 <= layer_idx < self.num_layers:      # a bool is no layer index
            raise ValueError(f"layer_idx: expected an int in [0, {self.num_layers}), got {layer_idx!r}")
        if key_states.dim() != 4 or value_states.shape != key_states.shape:
            raise ValueError(f"key_states/value_states: expected two [B, Hkv, T, D] tensors of one shape, got "
                             f"{tuple(key_states.shape)} and {tuple(value_states.shape)}")
        B, Hkv, T, D = key_states.shape
        if self._pool is None:
            self._init_pool(B, Hkv, D, T, key_states.dtype, key_states.device)
        elif B != len(self._seq_ids):
            raise ValueError(f"TinyAttnCache: batch size changed from {len(self._seq_ids)} to {B}; a cache holds "
                             f"one batch (use a fresh cache, or reorder_cache / batch_select_indices / "
                             f"batch_repeat_interleave)")
        elif (Hkv, D) != (self._pool.num_kv_heads, self._pool.head_dim):
            raise ValueError(f"key_states: expected [B, {self._pool.num_kv_heads}, T, {self._pool.head_dim}], got "
                             f"{tuple(key_states.shape)}")
        if self._layer_chunk[layer_idx] == self._chunk:          # first layer of a new forward pass
            self._chunk += 1
            self._chunk_len = T
            self._chunk_shape = key_states.shape       # the fast path above serves the pass's later layers
            self._hf_len += T
            self._prepared = False
        elif T != self._chunk_len:
            raise ValueError(f"key_states: layer {layer_idx} got {T} new tokens, earlier layers of this forward "
                             f"pass got {self._chunk_len}")
        self._layer_chunk[layer_idx] = self._chunk
        self._pending = (layer_idx, key_states, value_states)
        _CURRENT.cache = weakref.ref(self)
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Columns of the (padded) batch seen so far: what ``transformers`` sizes masks and positions by."""
        return self._hf_len

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        if query_length == 0 and self._pool is not None:
            # generate() keeps only the input columns past get_seq_length(): an input no longer than the cache
            # (a new, e.g. smaller, batch) leaves no token, and the model would fail inside transformers
            raise ValueError(f"TinyAttnCache: no new token in this forward pass: the cache already holds "
                             f"{self._hf_len} columns of a batch of {len(self._seq_ids)} rows and the input is not "
                             f"longer. A cache holds one batch (use a fresh cache for another batch, or "
                             f"reorder_cache / batch_select_indices / batch_repeat_interleave; to continue, pass "
                             f"the earlier tokens plus the new ones)")
        return self._hf_len + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def batch_size(self) -> int:
        return len(self._seq_ids) if self._pool is not None else -1

    @property
    def is_initialized(self) -> bool:
        return self._pool is not None

    @property
    def is_croppable(self) -> bool:
        return True

    @property
    def is_sliding(self) -> list[bool]:
        # every layer keeps every token (a sliding layer reads only its window): transformers then sizes every
        # mask, the sliding ones too, to the whole row, which is what the left-padding check reads
        return [False] * self.num_layers

    @property
    def is_linear(self) -> list[bool]:
        return [False] * self.num_layers

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * self.num_layers

    def reset(self) -> None:
        """Forget every sequence (the pool is dropped too)."""
        self._clear()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row ``r`` becomes a copy of old row ``beam_idx[r]``."""
        self._select_rows(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows ``indices`` (in that order)."""
        self._select_rows(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat each row ``repeats`` times, consecutively (as ``torch.repeat_interleave``)."""
        if self._pool is None:
            return
        self._select_rows(torch.arange(len(self._seq_ids)).repeat_interleave(repeats))

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` columns (``transformers`` 5 convention: a count <= 0).

        Rows lose the real tokens among those columns (:meth:`PagedKVCache.truncate`: whole pages go back to
        the pool, and the bounds of a row's new partial last page are recomputed from its remaining keys; with an
        int8 / fp8 ``kv_cache_dtype`` that page's scales are refit to the kept tokens first).
        """
        if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, int) or tokens_to_remove > 0:
            raise ValueError(f"tokens_to_remove: expected an int <= 0 (the number of tokens to remove, negated), "
                             f"got {tokens_to_remove!r}")
        if self._pool is None or tokens_to_remove == 0:
            return
        keep = max(self._hf_len + tokens_to_remove, 0)
        self._real = self._real[:, :keep]
        self._hf_len = keep
        self._rebuild_rows(list(range(len(self._seq_ids))), self._real.sum(1).tolist())

    # ------------------------------------------------------------------ inspection
    def seq_lens(self) -> torch.Tensor:
        """int32 ``[B]``: real (non-padding) tokens cached per row."""
        self._check_ready()
        return self._pool.seq_lens(self._seq_ids)

    def block_table(self) -> torch.Tensor:
        """int32 ``[B, max_pages]``: the rows' physical pages, ``-1`` past each row's end."""
        self._check_ready()
        return self._pool.block_table(self._seq_ids)

    @property
    def pool(self) -> PagedKVCache | None:
        """The underlying :class:`PagedKVCache` (``None`` before the first forward)."""
        return self._pool

    def to_dense(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys, values)`` of a layer as ``[B, Hkv, L, D]``, each row's real tokens right-aligned
        (``L`` = longest row; zeros in front of shorter rows). For inspection and tests."""
        self._check_ready()
        pool = self._pool
        lens = [pool.length(s) for s in self._seq_ids]
        L = max(lens + [0])
        shape = (len(lens), pool.num_kv_heads, L, pool.head_dim)
        dtype = pool.model_dtype if pool.quantized else pool.dtype          # int8 / fp8: dequantized
        keys = torch.zeros(shape, dtype=dtype, device=pool.device)
        values = torch.zeros(shape, dtype=dtype, device=pool.device)
        k_pool, v_pool = pool.k_cache[layer_idx], pool.v_cache[layer_idx]
        if pool.quantized:
            k_pool = quant.dequantize(k_pool, pool.k_scale[layer_idx], dtype)
            v_pool = quant.dequantize(v_pool, pool.v_scale[layer_idx], dtype)
        S = self.page_size
        for row, (sid, n) in enumerate(zip(self._seq_ids, lens)):
            if n == 0:
                continue
            pages = torch.tensor(pool.pages(sid), device=pool.device)
            pos = torch.arange(n, device=pool.device)
            keys[row, :, L - n:] = k_pool[pages[pos // S], pos % S].transpose(0, 1)
            values[row, :, L - n:] = v_pool[pages[pos // S], pos % S].transpose(0, 1)
        return keys, values

    def _check_ready(self) -> None:
        if self._pool is None:
            raise ValueError("TinyAttnCache: empty cache (no forward pass has run yet)")

    # ------------------------------------------------------------------ the pool
    def _init_pool(self, B, Hkv, D, T, dtype, device) -> None:
        per_row = -(-T // self.page_size) + 4
        num_pages = self.num_pages or max(B * per_row, 1)
        self._pool = PagedKVCache(self.num_layers, Hkv, D, page_size=self.page_size, num_pages=num_pages,
                                  dtype=dtype, device=device, kv_cache_dtype=self.kv_cache_dtype,
                                  box_dtype=self.box_dtype)
        self._seq_ids = [self._pool.add_sequence() for _ in range(B)]
        self._real = torch.zeros(B, 0, dtype=torch.bool)

    def _pages_for(self, n: int) -> int:
        return -(-n // self.page_size)

    def _grow(self, min_free: int) -> None:
        """Grow the pool in place to at least ``min_free`` free pages (at least doubling it)."""
        pool = self._pool
        if pool.num_free_pages >= min_free:
            return
        pool.resize(max(2 * pool.num_pages, pool.num_pages - pool.num_free_pages + min_free))

    def _extend(self, counts: list[int]) -> torch.Tensor:
        try:
            return self._pool.extend(self._seq_ids, counts)
        except CacheFullError:
            pool = self._pool
            need = sum(max(self._pages_for(pool.length(s) + c) - len(pool.pages(s)), 0)
                       for s, c in zip(self._seq_ids, counts))
            self._grow(need)
            return self._pool.extend(self._seq_ids, counts)

    def _select_rows(self, index) -> None:
        if self._pool is None:
            return
        index = torch.as_tensor(index).reshape(-1).to("cpu", torch.long)
        B = len(self._seq_ids)
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= B):
            raise ValueError(f"indices: expected values in [0, {B}), got range "
                             f"[{int(index.min())}, {int(index.max())}]")
        rows = index.tolist()
        if rows == list(range(B)):
            return
        self._real = self._real[index]
        lens = [self._pool.length(self._seq_ids[r]) for r in rows]
        self._rebuild_rows(rows, lens)

    def _rebuild_rows(self, rows: list[int], lens: list[int]) -> None:
        """New row ``i`` = the first ``lens[i]`` tokens of old row ``rows[i]``. The first new row taking an old
        row keeps its sequence (truncated in place when shorter); every other one is a fork of it
        (:meth:`PagedKVCache.fork`: fresh pages, copied). Old rows nobody takes are freed."""
        pool = self._pool
        old_ids = list(self._seq_ids)
        owner: dict[int, int] = {}
        for i, r in enumerate(rows):
            owner.setdefault(r, i)
        for r, sid in enumerate(old_ids):
            if r not in owner:
                pool.free(sid)
        forks = [i for i, r in enumerate(rows) if owner[r] != i]
        need = sum(self._pages_for(lens[i]) for i in forks)
        if pool.num_free_pages < need:
            self._grow(need)
        new_ids = [old_ids[r] for r in rows]
        for i in forks:                                  # before any truncation: a fork may keep more tokens
            new_ids[i] = pool.fork(old_ids[rows[i]], lens[i])
        for r, i in owner.items():
            pool.truncate(old_ids[r], lens[i])           # a no-op at full length; exact boxes after a cut
        self._seq_ids = new_ids
        self._pending = None

    # ------------------------------------------------------------------ attention
    def _owns(self, layer_idx, key) -> bool:
        return self._pending is not None and self._pending[0] == layer_idx and self._pending[1] is key

    def _prepare_chunk(self, mask: torch.Tensor | None, B: int, T: int, device, window: int | None) -> None:
        """First attention call of a forward pass: which new tokens are real, page allocation, tables.
        ``window``: the calling layer's sliding window (its mask shows a query at most that many keys)."""
        hf_len = self._hf_len
        if mask is None:
            real = torch.ones(B, T, dtype=torch.bool)
            allowed = None
        else:
            if mask.dim() != 4 or mask.shape[0] != B or mask.shape[-2] != T or mask.shape[-1] != hf_len:
                raise ValueError(f"attention_mask: expected a 4D mask [B={B}, 1, T={T}, kv={hf_len}] (the cache "
                                 f"length plus the new tokens), got {tuple(mask.shape)}")
            allowed = _allowed(mask[:, 0])                                      # [B, T, kv]
            t = torch.arange(T, device=mask.device)
            real = allowed[:, t, hf_len - T + t].cpu()                          # [B, T] a token sees itself
        if T > 1 and bool((real[:, :-1] & ~real[:, 1:]).any()):
            raise ValueError("attention_mask: a real token is followed by a padding token in the same forward pass "
                             "(right padding). TinyAttnCache supports left padding only: set "
                             "tokenizer.padding_side = 'left'")
        before = [self._pool.length(s) for s in self._seq_ids]
        counts = [T] * B if mask is None else real.sum(1).tolist()
        if self.attention_chunk is not None and max(b + c for b, c in zip(before, counts)) > self.attention_chunk:
            raise NotImplementedError(f"TinyAttnCache: a row exceeds the model's attention chunk "
                                      f"({self.attention_chunk} tokens); chunked attention is not supported by "
                                      f"tinyattn's paged ops")
        self._slots = self._extend(counts)
        # row-major, like the slots; None when every new token is real (decode without padding)
        self._gather = None if mask is None or bool(real.all()) else real.reshape(-1).nonzero().squeeze(1).to(device)
        self._fresh = not any(before)
        self._planned = False
        self._block_table = self._pool.block_table(self._seq_ids)
        self._seq_lens = self._pool.seq_lens(self._seq_ids)
        self._real = torch.cat([self._real, real], dim=1)
        if allowed is not None:
            # the last query of each row that is real must see exactly the row's cached tokens (its last
            # `window` ones in a sliding layer)
            seen = allowed[:, -1].sum(-1).cpu()
            held = self._seq_lens.cpu().to(seen.dtype)
            bad = real[:, -1] & (seen != (held if window is None else held.clamp(max=window)))
            if bool(bad.any()):
                row = int(bad.nonzero()[0, 0])
                raise ValueError(f"attention_mask: row {row} masks out tokens that are not left padding "
                                 f"(its last token sees {int(seen[row])} keys, the row holds "
                                 f"{int(self._seq_lens[row])}); TinyAttnCache supports left padding only")
        self._prepared = True

    def _attend(self, module, query, key, value, attention_mask, scaling, dropout, kwargs):
        layer_idx = self._pending[0]
        self._pending = None
        if dropout and module.training:
            raise ValueError("TinyAttnCache: attention dropout is not supported; call model.eval() "
                             "(or use_cache=False for training)")
        B, Hq, T, D = query.shape
        Hkv = key.shape[1]
        window = _window(kwargs.get("sliding_window"))
        if not self._prepared:
            self._prepare_chunk(attention_mask, B, T, query.device, window)
        pool = self._pool
        if T == 1:                                      # decode: one view each (squeeze: the cheapest view op)
            k, v = key.squeeze(2), value.squeeze(2)
        else:
            k = key.transpose(1, 2).reshape(B * T, Hkv, D)
            v = value.transpose(1, 2).reshape(B * T, Hkv, D)
        if self._gather is not None:                                            # drop left padding
            k, v = k[self._gather], v[self._gather]
        pool.write(layer_idx, self._slots, k, v)
        if self._fresh:
            # prefill into an empty cache: exactly the stock SDPA computation over the new states
            out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=0.0,
                                            scaling=scaling, **kwargs)
            return out, None
        q = query.squeeze(2) if T == 1 else query.transpose(1, 2)               # [B, Hq, D] / [B, T, Hq, D]
        if q.dtype != pool.dtype and not pool.quantized:
            q = q.to(pool.dtype)
        if not self._planned:       # first layer of this forward: one plan for every layer
            self._attention.begin(self._block_table, self._seq_lens, num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D,
                                  page_size=self.page_size, num_query_tokens=T, decode=T == 1, scale=scaling,
                                  seq_ids=list(self._seq_ids), trusted=True)   # the pool's own tables
            self._planned = True
        scales = dict(k_scale=pool.k_scale[layer_idx], v_scale=pool.v_scale[layer_idx]) if pool.quantized else {}
        out = self._attention(layer_idx, q, pool.k_cache[layer_idx], pool.v_cache[layer_idx],
                              pool.k_min[layer_idx], pool.k_max[layer_idx], scale=scaling,
                              window_left=-1 if window is None else window - 1, **scales)
        out = out.reshape(B, T, Hq, D)
        return (out if out.dtype == query.dtype else out.to(query.dtype)), None


def _window(sliding_window) -> int | None:
    """The ``sliding_window`` argument a model passes its attention function: ``W`` tokens the query included
    (``None``, or a non-positive value for a layer without one)."""
    if sliding_window is None:
        return None
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int):
        raise ValueError(f"sliding_window: expected None or an int (tokens, the query included), "
                         f"got {sliding_window!r}")
    return sliding_window if sliding_window > 0 else None


_TESTED_TRANSFORMERS = "5.24"
if not transformers.__version__.startswith("5."):  # pragma: no cover
    warnings.warn(f"tinyattn.integrations.hf was tested with transformers {_TESTED_TRANSFORMERS}.x, found "
                  f"{transformers.__version__}", stacklevel=2)
