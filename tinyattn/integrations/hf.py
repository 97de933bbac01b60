"""Hugging Face ``transformers`` integration: query-aware sparse decoding in ``generate()``, ``pipeline`` and tools.

Importing this module registers an attention implementation named ``"tinyattn"`` (through
``transformers.AttentionInterface``, with ``transformers``' SDPA mask builder registered for it in
``AttentionMaskInterface``) and provides :class:`TinyAttnCache`, a ``transformers`` cache backed by
:class:`tinyattn.cache.PagedKVCache`, and :func:`enable`, the one-line opt-in::

    import tinyattn.integrations.hf as tinyattn_hf

    model = AutoModelForCausalLM.from_pretrained(path)
    tinyattn_hf.enable(model, page_size=16, page_budget=64)     # every generate() then makes a TinyAttnCache
    out = model.generate(**inputs)                               # also pipeline(...), assistants, lm-eval

    # or per call, on a model loaded with attn_implementation="tinyattn":
    out = model.generate(**inputs, cache=TinyAttnCache(model.config, page_size=16, page_budget=64))

How a forward pass goes through it, per attention layer:

1. The model projects K/V, applies RoPE (keys are cached **after** RoPE, as Quest's page bounds need)
   and calls ``cache.update(k, v, layer_idx)``. :meth:`TinyAttnCache.update` only records the new
   states; it returns them unchanged.
2. The model calls the registered attention function with those states and the 4D mask. The first
   layer of each forward reads from the mask which new tokens attend to themselves (padding does not:
   transformers masks it as a key), allocates pages for those only, and every layer writes their
   keys/values into its page pool (:meth:`PagedKVCache.write` grows each touched page's
   ``k_min``/``k_max``). Padding never enters a page, so each batch row's block table holds exactly its
   own tokens, wherever the padding was (left, right, holes), and page selection sees a row as if it ran alone.
3. Attention:

   - **prefill into an empty cache** (nothing cached, not even padding columns): ``transformers``' own SDPA
     function on the new states with the model's mask — bit-for-bit the computation stock
     ``attn_implementation="sdpa"`` does;
   - otherwise, when the paged op gives every query exactly the keys the mask allows (checked per mask:
     left padding always; right padding and holes at decode), the one attention layer of the package
     (:class:`tinyattn.layer.PagedAttention`, planned once per forward pass, run per layer): **more tokens into
     a non-empty cache** (chunked prefill, assisted decoding) attend densely with ``q`` ``[B, T, Hq, D]``,
     bottom-right causal; **decode** (one token per row) selects ``page_budget`` pages with the cache's page
     bounds (Quest) or the chosen ``policy`` in layers ``>= dense_layers``, and is dense in the first
     ``dense_layers`` layers and everywhere when ``page_budget is None``;
   - a mask the pages cannot follow (new tokens after padding in one pass, a custom 4D mask, padding inside a
     sliding window): the **dense route**, stock SDPA with the model's mask over every column (the cached
     tokens gathered from the pages, the new states as computed), i.e. ``DynamicCache``'s computation; one
     warning per cache.

   The softmax scale is the ``scaling`` argument the model passes (OPT pre-scales its queries and
   passes ``1.0``; GPT-2's ``scale_attn_by_inverse_layer_idx`` is folded into it). A sliding-window
   layer is recognised by the ``sliding_window`` argument the model passes for it (Mistral, Qwen2/3,
   Gemma, SmolLM3 hybrids: ``W`` tokens, the query included): its query at position ``i`` sees keys
   ``i - W < j <= i`` (``window_left = W - 1`` of the attention layer), densely at every step; the cache
   keeps every token of every layer, so full-attention (e.g. NoPE) layers of the same model see them all.

Used without a :class:`TinyAttnCache` (``use_cache=False``, training, perplexity), ``"tinyattn"`` is
plain SDPA; used with another cache it is SDPA too, with a one-time warning (that decode is dense). Inside
``torch.compile`` (a static cache) it is SDPA and never reads the module's thread-local state.

Supported: causal LMs whose attention goes through ``AttentionInterface`` and calls
``cache.update(k, v, layer_idx)`` — tested: Llama (GQA), Mistral, Qwen2, GPT-2, OPT, SmolLM3 (sliding-window
+ NoPE hybrids, what :mod:`tinyattn.integrations.convert` makes of a hybrid tinyattn model). See
``docs/huggingface.md`` for the feature table and what raises; :mod:`tinyattn.integrations.lm_eval` for
lm-evaluation-harness.
"""

from __future__ import annotations

import threading
import types
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
    raise ImportError("tinyattn.integrations.hf needs transformers: pip install -e '.[hf]' "
                      "(transformers>=5.24,<6 and safetensors)") from e

from tinyattn.cache import CacheFullError, PagedKVCache
from tinyattn.layer import DEFAULT_GAMMA, PagedAttention, SparsityConfig, default_num_sink_pages
from tinyattn.metrics import PagesAttended
from tinyattn.ops.validation import check_selection_options
from tinyattn.ops import quant

__all__ = ["TinyAttnCache", "enable", "disable", "is_enabled", "tinyattn_attention_forward", "ATTN_IMPLEMENTATION",
           "CONFIG_KEY", "SETTINGS", "register"]

ATTN_IMPLEMENTATION = "tinyattn"

# The cache whose ``update`` ran last on this thread (``cache``, a weakref); the attention function checks that the
# key it receives is the very tensor that update returned before it trusts it (see TinyAttnCache._owns). ``pending``
# (a bool) says that an update awaits its attention call: the one field compiled code reads.
_CURRENT = threading.local()
_warned_dense = False


def tinyattn_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The ``"tinyattn"`` attention function (``AttentionInterface`` signature).

    Args:
        module: the attention module; ``module.layer_idx`` names the cache layer.
        query: ``[B, Hq, T, D]``. key, value: ``[B, Hkv, T, D]`` as returned by ``cache.update``.
        attention_mask: the 4D mask ``transformers`` built (boolean, from ``sdpa_mask``), a custom 4D mask (boolean
            or additive float), or ``None``.
        scaling: softmax scale passed by the model. dropout: must be 0 when the cache is used.

    Returns:
        ``(attn_output [B, T, Hq, D], None)`` (attention weights are never materialised).
    """
    if torch.compiler.is_compiling():
        # inside a compiled graph (a static cache + torch.compile): only the flag is read here, never the cache's
        # weakref, so dynamo guards on a bool that stays False, not on a cache object that may be collected (a
        # guard on a collected TinyAttnCache recompiled or crashed, issue 33)
        if getattr(_CURRENT, "pending", False):
            return _eager_from_compiled(module, query, key, value, attention_mask, scaling, dropout, kwargs)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    return _eager_attention(module, query, key, value, attention_mask, scaling, dropout, kwargs)


def _eager_attention(module, query, key, value, attention_mask, scaling, dropout, kwargs):
    ref = getattr(_CURRENT, "cache", None)
    cache = ref() if ref is not None else None
    layer_idx = getattr(module, "layer_idx", None)
    _CURRENT.pending = False
    if cache is None or not cache._owns(layer_idx, key):
        if key.shape[2] > query.shape[2]:
            _warn_dense_once()
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    return cache._attend(module, query, key, value, attention_mask, scaling, dropout, kwargs)


@torch.compiler.disable
def _eager_from_compiled(module, query, key, value, attention_mask, scaling, dropout, kwargs):
    """A TinyAttnCache inside a compiled model (its ``update`` runs outside the graph and raises the flag): the
    layer's attention runs eagerly too (a graph break per layer; ``generate`` never compiles a TinyAttnCache, whose
    ``is_compileable`` is False)."""
    return _eager_attention(module, query, key, value, attention_mask, scaling, dropout, kwargs)


def _warn_dense_once() -> None:
    global _warned_dense
    if not _warned_dense:
        _warned_dense = True
        warnings.warn("attn_implementation='tinyattn' is decoding with a cache that is not a TinyAttnCache: "
                      "attention falls back to dense SDPA. Call tinyattn.integrations.hf.enable(model, "
                      "page_budget=...) once (every generate() then makes a TinyAttnCache), or pass "
                      "cache=TinyAttnCache(model.config, ...) to generate() for query-aware sparse decoding.",
                      stacklevel=4)


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


def _allowed_keys(mask: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``([B, T, kv] may-attend, one pattern for every head)`` of a 4D mask ``[B, 1 or H, T, kv]``."""
    allowed = _allowed(mask)
    if allowed.shape[1] == 1:
        return allowed[:, 0], True
    return allowed.any(1), bool((allowed == allowed[:, :1]).all())


class _LayerView:
    """Stand-in for ``cache.layers[i]`` so that ``transformers``' per-layer introspection works: ``keys`` /
    ``values`` are laid out as ``DynamicCache``'s layers hold them (see :meth:`TinyAttnCache.to_dense`)."""

    is_sliding = False
    is_compileable = False
    is_croppable = True
    supports_early_init = False

    def __init__(self, cache: "TinyAttnCache", layer_idx: int, sliding_window: int | None = None):
        self._cache = weakref.ref(cache)
        self.layer_idx = layer_idx
        self.sliding_window = sliding_window

    @property
    def is_initialized(self) -> bool:
        return self._cache()._pool is not None

    def _dense(self, which: int) -> torch.Tensor:
        t = self._cache().to_dense(self.layer_idx)[which]
        W = self.sliding_window          # DynamicSlidingWindowLayer keeps the last W - 1 columns
        return t[:, :, -W + 1:, :] if W is not None else t

    @property
    def keys(self):
        return self._dense(0)

    @property
    def values(self):
        return self._dense(1)

    def get_seq_length(self) -> int:
        return self._cache().get_seq_length()

    def get_max_length(self) -> int:
        return -1

    def __repr__(self):
        return f"TinyAttnCacheLayer({self.layer_idx})"


def _layer_windows(text_config, num_layers: int) -> list[int | None]:
    """Per layer, the sliding window ``DynamicCache(config=...)`` gives that layer's cache (``None``: keeps every
    column), read with transformers' own helper."""
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs

        types, kwargs = get_layer_types_and_kwargs(text_config)
    except Exception:  # pragma: no cover - an older / newer transformers without the helper
        return [None] * num_layers
    windows = [kw.get("sliding_window") if t in ("sliding_attention", "chunked_attention") else None
               for t, kw in zip(types, kwargs)]
    return (windows + [None] * num_layers)[:num_layers]


class TinyAttnCache(Cache):
    """A ``transformers`` cache backed by a :class:`tinyattn.cache.PagedKVCache`.

    Each batch row is one sequence of the page pool (its real tokens only: padding, left, right or inside the
    row, is never written), the pool is shared by all rows and grows by doubling when it runs out of pages, and
    every page keeps the per-channel ``k_min``/``k_max`` of its keys (after RoPE) that Quest scores. To
    ``transformers`` it looks like ``DynamicCache``: :meth:`get_seq_length` counts columns (padding included) and
    ``cache.layers[i].keys`` / ``.values`` are ``[B, Hkv, columns, D]`` (:meth:`to_dense`; a sliding-window layer
    shows its last ``W - 1`` columns, as ``DynamicSlidingWindowLayer``).

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
        gamma: the page estimate of the ``quest`` selection, in ``[0, 1]``: ``q·c + gamma·|q|·r`` over each page's
            key box; default :data:`tinyattn.layer.DEFAULT_GAMMA`; ``1`` is Quest's bound, ``0.25`` the estimate
            issue 35 measured best on RULER (:class:`tinyattn.layer.SparsityConfig`).
        top_p: ``None`` (default: ``page_budget`` pages) or a number in ``(0, 1]``: the ``quest`` selection keeps,
            after the forced pages, the fewest best pages whose estimated attention mass reaches ``top_p``,
            ``page_budget`` being the capacity (Twilight, arXiv 2502.02770). ``gamma`` / ``top_p`` with another
            policy are a ``ValueError`` naming ``policy``.
        rerank, candidates: the ``quest`` selection's second stage (:class:`tinyattn.layer.SparsityConfig`):
            ``"int4"`` re-ranks ``ceil(candidates · page_budget)`` candidates by their attention mass estimated from
            4-bit key codes, which the pool then keeps (issue 35; docs/design_rerank.md).

    Attributes:
        pages_attended: with a ``page_budget``, a :class:`tinyattn.metrics.PagesAttended`: the pages each (sparse
            layer, KV head, row, decode step) attended since the cache was made or :meth:`reset` (``top_p`` keeps
            a varying count; counted on the device, read by ``cache.pages_attended.summary()``); else ``None``.

    The pool's pages are managed by the :class:`PagedKVCache` itself: it grows in place
    (:meth:`~PagedKVCache.resize`); beam search (``reorder_cache``), ``num_return_sequences`` and
    ``batch_select_indices`` / ``batch_repeat_interleave`` keep a row's pages for its first copy and give
    every further copy pages of its own (:meth:`~PagedKVCache.fork`, as ``DynamicCache`` copies its
    tensors); ``crop`` truncates each row (:meth:`~PagedKVCache.truncate`, exact bounds).

    Raises:
        ValueError for bad options; at run time, ValueError for a mask that lets a query read a column whose
        token was never cached (it did not attend to itself when fed; raised before the cache changes), a batch
        size that changes without ``reorder_cache``, dropout in training mode, a model that does not use
        ``attn_implementation="tinyattn"``; NotImplementedError for rows longer than the chunk of a
        chunked-attention layer (Llama 4). Right padding, holes and custom 4D masks give stock's results (the dense
        route where the pages cannot follow the mask, one warning per cache).
    """

    is_compileable = False

    def __init__(self, config, *, page_size: int = 16, page_budget: int | None = None,
                 num_sink_pages: int | None = None, num_recent_pages: int = 1, dense_layers: int = 0,
                 num_pages: int | None = None, backend: str | None = None, policy="quest",
                 kv_cache_dtype: str = "auto", box_dtype: str = "auto", gamma: float = DEFAULT_GAMMA,
                 top_p: float | None = None, rerank: str | None = None, candidates: float = 1.0):
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
                                                        dense_layers=dense_layers, policy=policy, gamma=gamma,
                                                        top_p=top_p, rerank=rerank, candidates=candidates),
                                         backend=backend)
        self.gamma, self.top_p = self._attention.sparsity.gamma, self._attention.sparsity.top_p
        self.rerank, self.candidates = self._attention.sparsity.rerank, self._attention.sparsity.candidates
        self.pages_attended = None if page_budget is None else PagesAttended()
        self._attention.attended = self.pages_attended
        windows = _layer_windows(text_config, self.num_layers)
        super().__init__(layers=[_LayerView(self, i, windows[i]) for i in range(self.num_layers)])
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
        self._undo = (0, None)
        self._routes: list = []             # per mask of the pass in progress: (mask, window, paged?)
        self._old_slots = None              # flat pool slots of the cached columns (the dense route), per pass
        self._warned_dense_route = False
        if self.pages_attended is not None:
            self.pages_attended.hist = None     # a fresh count per use of the cache

    def __repr__(self):
        return (f"TinyAttnCache(page_size={self.page_size}, page_budget={self.page_budget}, "
                f"num_sink_pages={self.num_sink_pages}, num_recent_pages={self.num_recent_pages}, "
                f"dense_layers={self.dense_layers}, gamma={self.gamma}, top_p={self.top_p}, rerank={self.rerank!r}, "
                f"backend={self.backend!r}, batch_size={self.batch_size}, "
                f"seq_length={self._hf_len})")

    # ------------------------------------------------------------------ the Cache interface
    @torch.compiler.disable
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
            _CURRENT.pending = True
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
            self._undo = (self._chunk_len, self._chunk_shape)   # _prepare_chunk's error restores them
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
        _CURRENT.pending = True
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
        """``(keys, values)`` of a layer as ``DynamicCache`` lays them out: ``[B, Hkv, L, D]`` with ``L =``
        :meth:`get_seq_length` columns, each cached token in its column, and zeros in the columns that hold none
        (padding: a token that did not attend to itself is never written to a page). An int8 / fp8 pool comes back
        dequantized. For inspection and tests (it copies the layer)."""
        self._check_ready()
        return self._gather_columns(layer_idx, self._column_slots(self._real.shape[1]))

    def _gather_columns(self, layer_idx: int, column_slots) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's columns laid out as in :meth:`to_dense` (one gather per pool), from :meth:`_column_slots`."""
        pool = self._pool
        slots, cached = column_slots                                              # [B, columns] each
        dtype = pool.model_dtype if pool.quantized else pool.dtype
        out = []
        for which, (t, scales) in enumerate(((pool.k_cache, pool.k_scale), (pool.v_cache, pool.v_scale))):
            flat = t[layer_idx].reshape(-1, pool.num_kv_heads, pool.head_dim)     # [num_pages * S, Hkv, D]
            x = flat.index_select(0, slots.reshape(-1)).reshape(*slots.shape, pool.num_kv_heads, pool.head_dim)
            if pool.quantized:
                page_scale = scales[layer_idx].index_select(0, (slots // self.page_size).reshape(-1))
                x = x.to(torch.float32) * page_scale.reshape(*slots.shape, -1, 1)
            x = x.to(dtype).masked_fill(~cached[:, :, None, None], 0)
            out.append(x.transpose(1, 2))
        return out[0], out[1]

    def _column_slots(self, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(slots, cached)``, both ``[B, columns]`` on the pool's device: the flat pool slot (``page * page_size +
        offset``) of the token in each column, and whether the column holds a cached token (slot 0 where not)."""
        pool = self._pool
        cached = self._real[:, :columns].to(pool.device)
        index = (cached.long().cumsum(1) - 1).clamp(min=0)                       # the token's index in its row
        table = self._pool.block_table(self._seq_ids).to(device=pool.device, dtype=torch.long).clamp(min=0)
        if table.shape[1] == 0:
            table = torch.zeros(len(self._seq_ids), 1, dtype=torch.long, device=pool.device)
        page = table.gather(1, (index // self.page_size).clamp(max=table.shape[1] - 1))
        slots = (page * self.page_size + index % self.page_size).masked_fill(~cached, 0)
        return slots, cached

    def _check_ready(self) -> None:
        if self._pool is None:
            raise ValueError("TinyAttnCache: empty cache (no forward pass has run yet)")

    # ------------------------------------------------------------------ the pool
    def _init_pool(self, B, Hkv, D, T, dtype, device) -> None:
        per_row = -(-T // self.page_size) + 4
        num_pages = self.num_pages or max(B * per_row, 1)
        self._pool = PagedKVCache(self.num_layers, Hkv, D, page_size=self.page_size, num_pages=num_pages,
                                  dtype=dtype, device=device, kv_cache_dtype=self.kv_cache_dtype,
                                  box_dtype=self.box_dtype, key_codes=self.rerank is not None)
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

    def _prepare_chunk(self, mask: torch.Tensor | None, B: int, T: int, device, layer_idx: int,
                       window: int | None) -> None:
        """First attention call of a forward pass: which new tokens are cached, page allocation, tables, and the
        route of this layer's mask (``window``: the layer's sliding window).

        A new token is cached (written to its row's pages) when it attends to itself, so padding (masked as a key in
        every 2D-mask-built mask) never enters a page. Raises ``ValueError``, with the cache left as it was before
        the pass, when the mask lets a query read a column whose token was never cached."""
        hf_before = self._hf_len - T
        old = self._real                                                          # [B, hf_before]
        self._routes = []
        if mask is None:
            real = torch.ones(B, T, dtype=torch.bool)
        else:
            if mask.dim() != 4 or mask.shape[0] != B or mask.shape[-2] != T or mask.shape[-1] != self._hf_len:
                self._undo_pass(layer_idx, T)
                raise ValueError(f"attention_mask: expected a 4D mask [B={B}, 1, T={T}, kv={self._hf_len}] (the cache "
                                 f"length plus the new tokens), got {tuple(mask.shape)}")
            allowed, same_heads = _allowed_keys(mask)                             # [B, T, kv]
            t = torch.arange(T, device=mask.device)
            real = allowed[:, t, hf_before + t].cpu()                             # [B, T] a token sees itself
            if hf_before:                      # an empty cache takes stock SDPA over the new states: no route
                paged = self._paged_keys_equal(mask, allowed, same_heads, torch.cat([old, real], 1), window, T)
                if not paged:                  # the paged keys are cached ones: equal means nothing missing
                    self._check_reads(allowed, old, layer_idx, T, undo=True)
                self._routes.append((mask, window, paged))
        counts = real.sum(1).tolist()
        if self.attention_chunk is not None:
            before = [self._pool.length(s) for s in self._seq_ids]
            if max(b + c for b, c in zip(before, counts)) > self.attention_chunk:
                self._undo_pass(layer_idx, T)
                raise NotImplementedError(f"TinyAttnCache: a row exceeds the model's attention chunk "
                                          f"({self.attention_chunk} tokens); chunked attention is not supported by "
                                          f"tinyattn's paged ops")
        self._slots = self._extend(counts)
        # row-major, like the slots; None when every new token is cached (decode without padding)
        self._gather = None if bool(real.all()) else real.reshape(-1).nonzero().squeeze(1).to(device)
        self._fresh = hf_before == 0          # nothing cached before (not even padding columns): stock SDPA
        self._planned = False
        self._block_table = self._pool.block_table(self._seq_ids)
        self._seq_lens = self._pool.seq_lens(self._seq_ids)
        self._real = torch.cat([old, real], dim=1)
        self._old_slots = None
        self._prepared = True

    def _check_reads(self, allowed: torch.Tensor, old: torch.Tensor, layer_idx: int, T: int, undo: bool) -> None:
        """ValueError if a query may read a cached column whose token is not in the pages; ``undo``: the pass's
        first layer, nothing written yet: the cache is restored to its state before the pass. (A later layer's
        mask of a transformers model hides the same padding columns as the first layer's, so only a mask built for
        one layer type could fail there.)"""
        if old.shape[1] == 0:
            return
        missing = allowed[:, :, :old.shape[1]] & ~old.to(allowed.device)[:, None, :]
        if bool(missing.any()):
            row, query, column = (int(i) for i in missing.nonzero()[0])
            if undo:
                self._undo_pass(layer_idx, T)
            raise ValueError(f"attention_mask: row {row}, query {query} attends to column {column}, whose token did "
                             f"not attend to itself when it was fed (padding), so TinyAttnCache never stored it; "
                             f"mask that column (as stock masks padding), or use a DynamicCache for such masks")

    def _undo_pass(self, layer_idx: int, T: int) -> None:
        """Forget the forward pass that update() began (its first layer raised before anything was written)."""
        self._chunk -= 1
        self._layer_chunk[layer_idx] = self._chunk
        self._chunk_len, self._chunk_shape = self._undo
        self._hf_len -= T
        self._pending = None
        self._prepared = False

    @staticmethod
    def _paged_keys_equal(mask, allowed, same_heads, real, window, T) -> bool:
        """Whether the paged op (bottom-right causal over each row's cached tokens, ``window`` of them at most) gives
        every query exactly the keys the mask allows it (``allowed`` ``[B, T, kv]``; ``real`` ``[B, kv]``: the
        columns whose token is cached, this pass's included): true for left padding, and for right padding or holes
        at decode; false for new tokens after padding in the same pass, custom 4D masks, windows with padding
        inside."""
        if not same_heads:
            return False
        real = real.to(allowed.device)
        index = real.long().cumsum(1) - 1                                         # a cached token's index in its row
        last = real.sum(1, keepdim=True) - T + torch.arange(T, device=allowed.device)   # [B, T] last key it sees
        paged = real[:, None, :] & (index[:, None, :] <= last[..., None])
        if window is not None:
            paged &= index[:, None, :] > (last - window)[..., None]
        if not torch.equal(paged, allowed):
            return False
        # a query that sees nothing: an additive mask averages every column, the paged op gives 0
        return mask.dtype == torch.bool or not bool((~allowed).all(-1).any())

    def _paged_serves(self, mask: torch.Tensor | None, window: int | None, T: int, layer_idx: int) -> bool:
        """The route of a layer's mask (decided once per mask object and window in a forward pass): paged (True) or
        the dense route. A mask first met after the pass's first layer is checked for reads of never-cached
        columns here (after pages were written: ValueError without undo)."""
        if mask is None:
            return True
        for m, w, paged in self._routes:
            if m is mask and w == window:
                return paged
        allowed, same_heads = _allowed_keys(mask)                                 # [B, T, kv]
        paged = self._paged_keys_equal(mask, allowed, same_heads, self._real, window, T)
        if not paged:
            self._check_reads(allowed, self._real[:, :self._hf_len - T], layer_idx, T, undo=False)
        self._routes.append((mask, window, paged))
        return paged

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
            self._prepare_chunk(attention_mask, B, T, query.device, layer_idx, window)
        pool = self._pool
        if T == 1:                                      # decode: one view each (squeeze: the cheapest view op)
            k, v = key.squeeze(2), value.squeeze(2)
        else:
            k = key.transpose(1, 2).reshape(B * T, Hkv, D)
            v = value.transpose(1, 2).reshape(B * T, Hkv, D)
        if self._gather is not None:                                            # drop padding
            k, v = k[self._gather], v[self._gather]
        pool.write(layer_idx, self._slots, k, v)
        if self._fresh:
            # prefill into an empty cache: exactly the stock SDPA computation over the new states
            out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=0.0,
                                            scaling=scaling, **kwargs)
            return out, None
        if not self._paged_serves(attention_mask, window, T, layer_idx):
            return self._attend_columns(module, query, key, value, attention_mask, scaling, layer_idx, kwargs), None
        q = query.squeeze(2) if T == 1 else query.transpose(1, 2)               # [B, Hq, D] / [B, T, Hq, D]
        if q.dtype != pool.dtype and not pool.quantized:
            q = q.to(pool.dtype)
        if not self._planned:       # first paged layer of this forward: one plan for every layer
            self._attention.begin(self._block_table, self._seq_lens, num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D,
                                  page_size=self.page_size, num_query_tokens=T, decode=T == 1, scale=scaling,
                                  seq_ids=list(self._seq_ids), trusted=True)   # the pool's own tables
            self._planned = True
        scales = dict(k_scale=pool.k_scale[layer_idx], v_scale=pool.v_scale[layer_idx]) if pool.quantized else {}
        if pool.k_code:
            scales["k_code"] = pool.k_code[layer_idx]
        out = self._attention(layer_idx, q, pool.k_cache[layer_idx], pool.v_cache[layer_idx],
                              pool.k_min[layer_idx], pool.k_max[layer_idx], scale=scaling,
                              window_left=-1 if window is None else window - 1, **scales)
        out = out.reshape(B, T, Hq, D)
        return (out if out.dtype == query.dtype else out.to(query.dtype)), None

    def _attend_columns(self, module, query, key, value, attention_mask, scaling, layer_idx, kwargs):
        """The dense route, for a mask the paged op cannot follow: stock SDPA with the model's mask over every
        column, the cached ones gathered from the pages (zeros in padding columns, which every such mask hides) and
        the new states as the model computed them: the computation ``DynamicCache`` + SDPA does."""
        if not self._warned_dense_route:
            self._warned_dense_route = True
            warnings.warn("TinyAttnCache: this forward pass's attention mask is not one the pages can follow (new "
                          "tokens after padding in one pass, a custom 4D mask, padding inside a sliding window): "
                          "such passes attend densely over the cached tokens with SDPA, as stock transformers does "
                          "(warned once per cache)", stacklevel=5)
        if self._old_slots is None:
            self._old_slots = self._column_slots(self._hf_len - key.shape[2])
        k_old, v_old = self._gather_columns(layer_idx, self._old_slots)
        k = torch.cat([k_old.to(key.dtype), key], dim=2)
        v = torch.cat([v_old.to(value.dtype), value], dim=2)
        out, _ = sdpa_attention_forward(module, query, k, v, attention_mask, dropout=0.0, scaling=scaling, **kwargs)
        return out


# ---------------------------------------------------------------------------------------------- the opt-in
#: the key of ``model.config`` that holds a model's TinyAttnCache settings (written to config.json by save_pretrained)
CONFIG_KEY = "tinyattn"
#: the TinyAttnCache options ``enable`` accepts (all JSON values, so that save_pretrained keeps them)
SETTINGS = ("page_size", "page_budget", "num_sink_pages", "num_recent_pages", "dense_layers", "num_pages", "backend",
            "policy", "kv_cache_dtype", "box_dtype", "gamma", "top_p", "rerank", "candidates")


def enable(model, **settings):
    """Opt a ``transformers`` model in: every ``generate()`` that would make a ``DynamicCache`` makes a
    :class:`TinyAttnCache` with these settings instead, so ``model.generate(**inputs)``,
    ``pipeline("text-generation", model=model)``, this model as another model's ``assistant_model``, and tools that
    call ``generate()`` themselves (lm-evaluation-harness) decode through tinyattn with no extra argument.

    Args:
        model: a decoder-only ``transformers`` model (``PreTrainedModel`` with ``generate``).
        **settings: :class:`TinyAttnCache` options (:data:`SETTINGS`: ``page_size``, ``page_budget``,
            ``num_sink_pages``, ``num_recent_pages``, ``dense_layers``, ``num_pages``, ``backend``, ``policy`` (a
            name), ``kv_cache_dtype``, ``box_dtype``, ``gamma``, ``top_p``, ``rerank``, ``candidates``). None given: the settings saved in
            ``model.config.tinyattn`` (a model enabled, then saved with ``save_pretrained``), else TinyAttnCache's
            defaults (dense decode).

    Returns:
        ``model`` itself, after: ``model.set_attn_implementation("tinyattn")``, ``model.config.tinyattn =
        settings`` (a dict: ``save_pretrained`` writes it to config.json) and, on this model object only, a
        ``_prepare_cache_for_generation`` that makes the TinyAttnCache. Models not enabled are untouched. A
        ``cache=`` passed to ``generate`` still wins, and so do ``use_cache=False`` and a ``cache_implementation``
        other than ``"dynamic"`` (``"static"``: stock SDPA over transformers' static cache).

    Raises:
        ValueError, before the model is changed: an unknown setting, a ``policy`` that is not a name, an invalid
        value (the message of :class:`TinyAttnCache`), an encoder-decoder model.
    """
    if not settings:
        settings = dict(getattr(model.config, CONFIG_KEY, None) or {})
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise ValueError(f"enable: unknown TinyAttnCache settings {unknown}; expected some of {list(SETTINGS)}")
    if not isinstance(settings.get("policy", "quest"), str):
        raise ValueError(f"policy: expected a policy name (saved in the model's config), got {settings['policy']!r}")
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError("enable: expected a decoder-only model; encoder-decoder models are not supported")
    if not hasattr(model, "generate"):
        raise ValueError(f"model: expected a transformers model with generate(), got {type(model).__name__}")
    TinyAttnCache(model.config, **settings)                    # every value checked before anything changes
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    setattr(model.config, CONFIG_KEY, dict(settings))
    model._prepare_cache_for_generation = types.MethodType(_prepare_cache_for_generation, model)
    return model


def disable(model, attn_implementation: str = "sdpa"):
    """Undo :func:`enable`: ``generate()`` makes transformers' own caches again, the attention is
    ``attn_implementation``, and ``model.config`` loses its ``tinyattn`` settings. Returns ``model``."""
    model.__dict__.pop("_prepare_cache_for_generation", None)
    if hasattr(model.config, CONFIG_KEY):
        delattr(model.config, CONFIG_KEY)
    model.set_attn_implementation(attn_implementation)
    return model


def is_enabled(model) -> bool:
    """Whether ``generate()`` of ``model`` makes a TinyAttnCache (:func:`enable` ran on this object)."""
    return "_prepare_cache_for_generation" in getattr(model, "__dict__", {})


def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
    """``GenerationMixin._prepare_cache_for_generation`` of an enabled model: where generate() would make a
    ``DynamicCache`` (no cache passed, ``use_cache`` on, ``cache_implementation`` unset or ``"dynamic"``), a
    TinyAttnCache with the model's settings; everything else is transformers' own code."""
    settings = getattr(self.config, CONFIG_KEY, None)
    if (settings is not None and model_kwargs.get("cache") is None and generation_config.use_cache is not False
            and generation_config.cache_implementation in (None, "dynamic")
            and getattr(self.config, "_attn_implementation", None) == ATTN_IMPLEMENTATION
            and self._supports_default_dynamic_cache()):
        model_kwargs["cache"] = TinyAttnCache(self.config, **settings)
        if getattr(generation_config, "is_assistant", False):
            model_kwargs["cache"].activate_past_recording()     # what transformers does for an assistant's cache
        return None
    return type(self)._prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs)


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
