"""LLaMA-family model and a paged, query-aware sparse runtime built on tinyattn's ops.

Architecture (as llama2.c / Meta LLaMA): token embedding, ``n_layers`` pre-norm blocks of
RMSNorm (eps 1e-5) -> GQA attention with interleaved RoPE (pairs ``(2i, 2i+1)`` of each head,
theta 10000) -> RMSNorm -> SwiGLU FFN ``w2(silu(w1 x) * w3 x)``, final RMSNorm, linear classifier.

Keys are written to a :class:`tinyattn.cache.PagedKVCache` **after** RoPE, at the token's absolute
position, so the cache's page bounding boxes are the ones Quest scores.

- Prefill is dense: :func:`tinyattn.paged_attention` with ``Tq`` = number of new tokens
  (bottom-right causal).
- Decode uses :func:`tinyattn.sparse_paged_attention` (pages chosen by a :mod:`tinyattn.selection` policy,
  Quest by default: ``k_min``/``k_max`` + ``page_budget``) in every
  layer from ``dense_layers`` on; the first ``dense_layers`` layers (Quest keeps 2) and every layer
  when ``page_budget is None`` use dense :func:`tinyattn.paged_attention`.
- Hybrid models (:class:`LlamaConfig` ``layer_types`` / ``sliding_window`` / ``nope_layers``, as Mistral, Gemma
  2/3 and SmolLM3): a ``"sliding_attention"`` layer attends densely over its window (``window_left =
  sliding_window - 1``, Hugging Face's mask: keys ``i - sliding_window < j <= i``) at prefill and decode alike,
  whatever the page budget; a NoPE layer rotates neither q nor k (its cached keys are unrotated, so its page
  boxes bound the raw keys).

Public names: :class:`LlamaConfig`, :class:`SparsityConfig`, :class:`LlamaModel`,
:class:`LlamaRuntime`, :class:`GenerationOutput`, :class:`GenerationStats`.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from tinyattn import metrics, selection
from tinyattn.ops import quant
from tinyattn.ops.validation import kv_formats_supported
from tinyattn.ops.spans import layer as profile_layer
from tinyattn.layer import DEFAULT_GAMMA, PagedAttention, SparsityConfig  # noqa: F401  (SparsityConfig re-exported)

from .config import LlamaConfig
from .step import ForwardStep

__all__ = [
    "LlamaConfig",
    "SparsityConfig",
    "LlamaModel",
    "LlamaRuntime",
    "GenerationOutput",
    "GenerationStats",
    "rope_tables",
    "apply_rope",
]


# ---------------------------------------------------------------------------- configuration
# ---------------------------------------------------------------------------- building blocks
def rope_tables(head_dim: int, num_positions: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``[num_positions, head_dim // 2]`` fp32, exactly as llama2.c's ``model.py``
    computes them (these are the ``freq_cis_real/imag`` tables stored in its checkpoints)."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    t = torch.arange(num_positions, dtype=torch.float32)
    angles = torch.outer(t, freqs).float()
    return torch.cos(angles), torch.sin(angles)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs ``(2i, 2i+1)`` of the last dim of ``x`` ``[B, T, H, D]`` by ``cos/sin`` ``[B, T, D/2]``."""
    xf = x.float().unflatten(-1, (-1, 2))  # [B, T, H, D/2, 2]
    x0, x1 = xf[..., 0], xf[..., 1]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    out = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)
    return out.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        hd = cfg.head_dim
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * hd, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=False)
        self.wo = nn.Linear(cfg.n_heads * hd, cfg.dim, bias=False)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.w1 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def fused_weights(self) -> "FusedWeights":
        """The block's weights laid out for inference (:class:`FusedWeights`): ``wq|wk|wv`` and ``w1|w3`` stacked
        so each runs as one matmul, every matrix transposed for ``x @ W``, each RMSNorm weight folded into the
        matmul after it (``rms_norm(x) @ W.T = (x @ (diag(g) W.T)) * rsqrt(mean(x²) + eps)``).

        Built on first use and rebuilt whenever a weight changes (its version counter or storage), so
        training or loading new weights between calls never leaves a stale copy.
        """
        ws = (self.wq.weight, self.wk.weight, self.wv.weight, self.w1.weight, self.w3.weight, self.wo.weight,
              self.w2.weight, self.attention_norm.weight, self.ffn_norm.weight)
        return _derived(self, "_fused", ws, lambda: FusedWeights(
            qkv=_folded(torch.cat(ws[:3]), self.attention_norm.weight),
            w13=_folded(torch.cat(ws[3:5]), self.ffn_norm.weight),
            wo=self.wo.weight.t().contiguous(), w2=self.w2.weight.t().contiguous()))


@dataclass(frozen=True)
class FusedWeights:
    """One block's inference weights, each ``[in, out]`` for ``x @ W``: ``qkv`` and ``w13`` with the preceding
    RMSNorm's weight folded in (see :meth:`LlamaBlock.fused_weights`)."""
    qkv: torch.Tensor
    w13: torch.Tensor
    wo: torch.Tensor
    w2: torch.Tensor


def _derived(owner, name: str, weights, build):
    """``build()``, kept on ``owner`` as ``name`` and rebuilt whenever one of ``weights`` changes (its version
    counter or storage). Inference tensors keep no version counter: then it is rebuilt at every call (never
    stale)."""
    key = None if any(w.is_inference() for w in weights) else tuple((w._version, w.data_ptr()) for w in weights)
    cached = getattr(owner, name + "_cache", None)
    if key is None or cached is None or cached[0] != key:
        with torch.no_grad():
            cached = (key, build())
        setattr(owner, name + "_cache", cached)
    return cached[1]


def _folded(weight: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
    """``diag(norm_weight) @ weight.T`` ``[in, out]``, computed in fp32 and stored in the weight's dtype."""
    return (weight.float() * norm_weight.float()).t().contiguous().to(weight.dtype)


def _inv_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``rsqrt(mean(x²) + eps)`` over the last dim, keepdim, in fp32: RMSNorm's scale (its weight is folded into
    the next matmul)."""
    return x.float().square().mean(-1, keepdim=True).add_(eps).rsqrt_()


# ---------------------------------------------------------------------------- the model
class LlamaModel(nn.Module):
    """LLaMA weights + a forward pass over a paged KV cache.

    ``forward`` appends ``T`` new tokens to each of ``B`` sequences of ``cache`` (all rows the same
    ``T``) and returns their logits; see :class:`LlamaRuntime` for prompts of different lengths,
    batching and sampling.
    """

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(LlamaBlock(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.shared_classifier:
            self.output.weight = self.tok_embeddings.weight
        self._rope_cos = torch.empty(0)
        self._rope_sin = torch.empty(0)

    # -------------------------------------------------------------- loading
    @classmethod
    def from_llama2c(cls, path: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
                     device: str | torch.device = "cpu") -> "LlamaModel":
        """Load a llama2.c legacy checkpoint (see :mod:`tinyattn.models.llama2c`)."""
        from .llama2c import load_llama2c

        cfg, sd = load_llama2c(path)
        model = cls(cfg)
        model.load_state_dict(sd, strict=True)
        return model.to(device=device, dtype=dtype).eval().requires_grad_(False)

    @property
    def dtype(self) -> torch.dtype:
        return self.tok_embeddings.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.tok_embeddings.weight.device

    def new_cache(self, *, page_size: int, num_pages: int, kv_cache_dtype: str = "auto", box_dtype: str = "auto",
                  key_codes: bool = False):
        """An empty :class:`tinyattn.cache.PagedKVCache` shaped for this model.

        ``kv_cache_dtype``: ``"auto"`` (the model dtype), ``"fp16"``, ``"bf16"``, ``"int8"`` or ``"fp8_e4m3"``
        (per-(page, KV head) scales); ``box_dtype``: ``"auto"`` (exact boxes), ``"fp32"``, ``"bf16"`` or ``"fp16"``
        (rounded outward); ``ValueError`` naming the supported set otherwise. ``key_codes``: keep 4-bit key codes
        for the re-ranked selection (``rerank="int4"``)."""
        from tinyattn.cache import PagedKVCache

        cfg = self.config
        return PagedKVCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, page_size=page_size, num_pages=num_pages,
                            dtype=self.dtype, device=self.device, kv_cache_dtype=kv_cache_dtype, box_dtype=box_dtype,
                            key_codes=key_codes)

    # -------------------------------------------------------------- forward
    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, cache, seq_ids: list[int], *, sparse: bool = False,
                sparsity: SparsityConfig | None = None, backend: str | None = None,
                last_only: bool = False, selection_metrics=None, attention: PagedAttention | None = None
                ) -> torch.Tensor:
        """Append ``tokens`` ``[B, T]`` to sequences ``seq_ids`` of ``cache``; return logits.

        Args:
            tokens: ``[B, T]`` token ids, the next ``T`` tokens of each row.
            cache: a :class:`PagedKVCache` made by :meth:`new_cache`.
            seq_ids: ``B`` sequence ids of ``cache``.
            sparse: a decode step: the layers ``sparsity`` makes sparse select pages; ``False`` (prefill)
                is dense everywhere.
            sparsity: page budget and friends; ``None`` or ``page_budget=None`` = dense.
            backend: ``None`` (by device), ``"torch"`` or ``"triton"``.
            last_only: return only the last position's logits ``[B, V]`` instead of ``[B, T, V]``.
            selection_metrics: a :class:`tinyattn.selection.SelectionMetrics` that sparse layers add their
                hit rate / captured mass against the oracle to (a dense pass per sparse layer); ``None`` = off.
            attention: the :class:`tinyattn.layer.PagedAttention` to attend with (a runtime keeps one so that
                its plan's buffers are reused across steps); default: one built from ``sparsity``/``backend``.

        Every layer attends through the one attention layer (:mod:`tinyattn.layer`), planned once for the
        step: dense prefill, and at decode Quest's fused selection, another policy's selection, or dense
        layers, as ``sparsity`` says. Each new token is rotated at its absolute position (the sequence
        length before this call plus its offset; not in ``config.nope_layers``), and attends to every earlier
        token of its row and to itself (in a ``"sliding_attention"`` layer, to the last ``sliding_window`` of them,
        itself included, densely at every step).
        """
        cfg = self.config
        if tokens.dim() != 2 or tokens.shape[0] != len(seq_ids):
            raise ValueError(f"tokens must be [B, T] with B = len(seq_ids) = {len(seq_ids)}, "
                             f"got shape {tuple(tokens.shape)}")
        B, T = tokens.shape
        if T == 0:
            raise ValueError("tokens must hold at least one token per row (T >= 1), got T = 0")
        lo, hi = tokens.aminmax()            # CPU tokens (the runtime's, the engine's): no device sync
        if int(lo) < 0 or int(hi) >= cfg.vocab_size:
            raise ValueError(f"token ids must be in [0, {cfg.vocab_size}), got min {int(lo)} max {int(hi)}")
        if attention is None:
            attention = PagedAttention(sparsity, backend=backend)
        attention.metrics = selection_metrics
        step = self.start_step(tokens, cache, seq_ids, attention=attention, decode=sparse)
        x = self.embed(step)
        for li in range(cfg.n_layers):
            with profile_layer(li):  # attributes the ops' spans to this layer when a profiler is on
                x = self.layer_forward(li, x, step)
        return self.head(x, step, last_only=last_only)

    # -------------------------------------------------------------- the step's building blocks
    # forward() is start_step -> embed -> layer_forward per layer -> head; a pipeline that needs a hook between
    # layers (the engine's early exit) calls the same blocks, so the math lives here once.
    def start_step(self, tokens: torch.Tensor, cache, seq_ids, *, attention, decode: bool) -> "ForwardStep":
        """Extend the rows by ``tokens`` ``[B, T]`` (validated ids), plan ``attention`` for the step, and take
        the RoPE factors of the new positions. ``decode``: sparse layers select (else dense, a prefill).

        No host sync on a GPU: the host-built values (tokens, lengths, tables, slots) go to the device by
        asynchronous copies, and the plan trusts the cache's tables."""
        cfg = self.config
        B, T = tokens.shape
        hd, Hq, Hkv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
        start = [cache.length(s) for s in seq_ids]                                   # before extend
        slots = cache.extend(list(seq_ids), T)  # [B*T], row-major (row b's T tokens together)
        positions = torch.tensor(start, dtype=torch.long).to(self.device, non_blocking=True)[:, None] + torch.arange(
            T, device=self.device)                                                   # [B, T] absolute positions
        attention.begin(cache.block_table(seq_ids), cache.seq_lens(seq_ids), num_q_heads=Hq, num_kv_heads=Hkv,
                        head_dim=hd, page_size=cache.page_size, num_query_tokens=T, decode=decode,
                        seq_ids=list(seq_ids), trusted=True)                # tables made by the cache
        no_boxes = [None] * cfg.n_layers                    # a cache made with page_boxes=False
        return ForwardStep(
            tokens=tokens.to(self.device, non_blocking=True), batch=B, num_tokens=T, cache=cache, slots=slots,
            attention=attention,
            cis=self._rope_cis(positions, max(start) + T).view(B * T, 1, hd // 2),  # [N, 1, D/2] complex
            pools=list(zip(cache.k_cache, cache.v_cache, cache.k_min or no_boxes, cache.k_max or no_boxes)),
            scales=[dict(k_scale=ks, v_scale=vs) for ks, vs in zip(getattr(cache, "k_scale", []),
                                                                   getattr(cache, "v_scale", []))]
            or [{}] * cfg.n_layers,                           # int8 / fp8 caches: per-(page, KV head) scales
            codes=getattr(cache, "k_code", None) or [None] * cfg.n_layers,   # 4-bit key codes (rerank="int4")
            weights=self._weights(), norm_eps=self._norm_eps)

    def embed(self, step: "ForwardStep") -> torch.Tensor:
        """The step's token embeddings as rows ``[N, dim]``, ``N = B * T`` (row-major)."""
        return self.tok_embeddings(step.tokens).view(step.batch * step.num_tokens, self.config.dim)

    def write_kv(self, li: int, x: torch.Tensor, step: "ForwardStep") -> torch.Tensor:
        """Layer ``li``'s q, k, v of the rows ``x`` ``[N, dim]``: k and v (rotated k) written into the cache;
        returns q, rotated, ``[B, Hq, D]`` (decode) or ``[B, T, Hq, D]``. A NoPE layer (``config.nope_layers``)
        rotates neither."""
        cfg, B, T = self.config, step.batch, step.num_tokens
        hd, Hq, Hkv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
        n_qk = (Hq + Hkv) * hd
        # wq|wk|wv as one matmul with the RMSNorm weight folded in; q and k rotated together
        qkv = torch.mm(x, step.weights[li].qkv).mul_(_inv_rms(x, step.norm_eps[li][0]).to(x.dtype))
        qk = qkv[:, :n_qk].view(B * T, Hq + Hkv, hd)                                         # [N, Hq+Hkv, hd]
        if cfg.uses_rope(li):
            qk = _rotate(qk, step.cis)
        if step.trusted_slots:
            step.cache.write(li, step.slots, qk[:, Hq:], qkv[:, n_qk:].view(B * T, Hkv, hd), trusted=True)
        else:
            step.cache.write(li, step.slots, qk[:, Hq:], qkv[:, n_qk:].view(B * T, Hkv, hd))
        return qk[:, :Hq].view(B, Hq, hd) if T == 1 else qk[:, :Hq].reshape(B, T, Hq, hd)

    def layer_forward(self, li: int, x: torch.Tensor, step: "ForwardStep") -> torch.Tensor:
        """One block, the math of :class:`LlamaBlock` (``x`` ``[N, dim]`` -> the next rows): K/V written,
        attention through the step's attention layer (a sliding layer with its ``window_left``), FFN; residual adds
        fused into the output matmuls."""
        B, T = step.batch, step.num_tokens
        w, norm_eps = step.weights[li], step.norm_eps[li][1]
        q = self.write_kv(li, x, step)
        if step.attn_out is None:
            attn = step.attention(li, q, *step.pools[li], **step.scales[li], window_left=self.config.window_left(li),
                                  k_code=step.codes[li] if step.codes else None)
        else:           # a graphed step: no allocation outside the graph's pool
            attn = step.attention(li, q, *step.pools[li], **step.scales[li], window_left=self.config.window_left(li),
                                  out=step.attn_out, k_code=step.codes[li] if step.codes else None)
        x = torch.addmm(x, attn.reshape(B * T, -1), w.wo)                                     # x + attn @ wo
        h = torch.mm(x, w.w13).mul_(_inv_rms(x, norm_eps).to(x.dtype))
        a, b = h.chunk(2, dim=-1)
        return torch.addmm(x, F.silu(a).mul_(b), w.w2)                                        # x + ffn

    def head(self, x: torch.Tensor, step: "ForwardStep", *, last_only: bool = False) -> torch.Tensor:
        """Final RMSNorm + classifier (fp32 logits): ``[B, V]`` of the last position, or ``[B, T, V]``."""
        B, T = step.batch, step.num_tokens
        if last_only:
            x = x.view(B, T, -1)[:, -1]
        logits = torch.mm(x, step.weights[-1]).mul_(_inv_rms(x, step.norm_eps[-1]).to(x.dtype))
        return (logits if last_only else logits.view(B, T, -1)).float()

    def _weights(self) -> list:
        """Every block's :class:`FusedWeights`, then the folded classifier: checked for changes once per step
        (one pass over the parameters' version counters and storages) instead of at every use in every layer
        (nine weights through ``nn.Module.__getattr__`` each time: ~10% of a stories260K decode step). Inside
        :meth:`frozen_weights` (one :meth:`LlamaRuntime.generate` call) the check made on entry serves every step."""
        frozen = self.__dict__.get("_weights_frozen")
        if frozen is not None:
            return frozen[0]
        params = list(self.parameters())
        key = None if any(p.is_inference() for p in params) else tuple((p._version, p.data_ptr()) for p in params)
        cached = self.__dict__.get("_weights_cache")
        if key is None or cached is None or cached[0] != key:
            cached = (key, [layer.fused_weights() for layer in self.layers] + [self._folded_output()])
            self.__dict__["_weights_cache"] = cached
        return cached[1]

    @property
    def _norm_eps(self) -> list:
        frozen = self.__dict__.get("_weights_frozen")
        if frozen is not None:
            return frozen[1]
        return [(b.attention_norm.eps, b.ffn_norm.eps) for b in self.layers] + [self.norm.eps]

    @contextlib.contextmanager
    def frozen_weights(self):
        """Within the block, :meth:`start_step` takes the inference weights checked once on entry (the parameters'
        walk and version counters: ~9% of a stories260K decode step when done per step); weights changed inside
        the block are not seen until it exits. :meth:`LlamaRuntime.generate` runs its steps in one such block, so
        weights changed between two calls are always used. Nests (an inner block keeps the outer one's weights)."""
        if "_weights_frozen" in self.__dict__:
            yield
            return
        self.__dict__["_weights_frozen"] = (self._weights(), self._norm_eps)
        try:
            yield
        finally:
            self.__dict__.pop("_weights_frozen", None)

    def _folded_output(self) -> torch.Tensor:
        """The classifier ``[dim, V]`` with the final RMSNorm weight folded in (as :meth:`LlamaBlock.fused_weights`)."""
        ws = (self.output.weight, self.norm.weight)
        return _derived(self, "_output_folded", ws, lambda: _folded(self.output.weight, self.norm.weight))

    def _rope_cis(self, positions: torch.Tensor, need: int) -> torch.Tensor:
        """``cos + i sin`` at absolute ``positions`` ``[B, T]``: complex ``[B, T, 1, D/2]`` (llama2.c's
        ``freqs_cis``), from a table kept on the model and grown to a power of two when needed."""
        if self._rope_cos.shape[0] < need or self._rope_cos.device != positions.device:
            n = max(need, self.config.max_seq_len)
            n = 1 << (n - 1).bit_length()
            cos, sin = rope_tables(self.config.head_dim, n, self.config.rope_theta)
            self._rope_cos, self._rope_sin = cos.to(positions.device), sin.to(positions.device)
            self._rope_table = torch.complex(self._rope_cos, self._rope_sin)
        return self._rope_table[positions][:, :, None, :]


def _rotate(x: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE as one complex product (llama2.c's ``apply_rotary_emb``): pairs ``(2i, 2i+1)`` of
    ``x`` ``[..., H, D]`` rotated by ``cis`` ``[..., 1, D/2]``; same math as :func:`apply_rope`."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * cis).flatten(-2).to(x.dtype)


# ---------------------------------------------------------------------------- runtime
@dataclass
class GenerationStats:
    """Counters of one :meth:`LlamaRuntime.generate` call.

    Page and byte counts are per decode step summed over rows, layers and KV heads; "dense" is
    what full attention would read at the same step. Sparse bytes include the page bounding boxes
    (``k_min`` + ``k_max``) of every valid page, as in DESIGN.md §1; the formulas are :mod:`tinyattn.metrics`'.
    """

    num_sequences: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    decode_steps: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    pages_read: int = 0
    pages_dense: int = 0
    kv_bytes_read: int = 0
    kv_bytes_dense: int = 0
    kv_cache_bytes: int = 0
    pages_used: int = 0
    page_size: int = 0
    selection: object = None  # a tinyattn.selection.SelectionMetrics when the runtime tracks selection quality
    graphed_steps: int = 0    # decode steps replayed from a CUDA graph (LlamaRuntime(cuda_graphs=True))
    # a tinyattn.metrics.PagesAttended: pages each (sparse layer, KV head, row, eager decode step) attended, as
    # selected (top_p's varying count); pages_read above is the capacity's model
    pages_attended: object = None
    top_p: float | None = None  # the selection's settings, to say what the read model above counts
    rerank: str | None = None

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of decode time (all rows together; prefill excluded)."""
        return self.generated_tokens / self.decode_s if self.decode_s > 0 else float("nan")

    @property
    def prefill_tokens_per_s(self) -> float:
        """Prompt tokens per second of prefill time."""
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else float("nan")

    @property
    def end_to_end_tokens_per_s(self) -> float:
        """Generated tokens per second of prefill + decode time: never above :attr:`tokens_per_s`."""
        t = self.prefill_s + self.decode_s
        return self.generated_tokens / t if t > 0 else float("nan")

    def _per_step(self, v: float) -> float:
        return v / self.decode_steps if self.decode_steps else 0.0

    @property
    def pages_read_per_step(self) -> float:
        return self._per_step(self.pages_read)

    @property
    def pages_dense_per_step(self) -> float:
        return self._per_step(self.pages_dense)

    @property
    def kv_bytes_read_per_step(self) -> float:
        return self._per_step(self.kv_bytes_read)

    @property
    def kv_bytes_dense_per_step(self) -> float:
        return self._per_step(self.kv_bytes_dense)

    def format(self) -> str:
        def ratio(a, b):
            return f"{a / b:.1%}" if b else "n/a"

        return "\n".join([
            f"sequences:          {self.num_sequences} ({_count(self.prompt_tokens, 'prompt token')}, "
            f"{self.generated_tokens} generated, {_count(self.decode_steps, 'decode step')})",
            f"prefill:            {self.prefill_s * 1e3:.1f} ms, {_count(self.prompt_tokens, 'prompt token')} "
            f"({self.prefill_tokens_per_s:.0f} tokens/s)",
            f"decode:             {self.decode_s * 1e3:.1f} ms, {_count(self.decode_steps, 'step')}, "
            f"{self.tokens_per_s:.1f} generated tokens/s "
            + (f"(all {self.num_sequences} rows together)" if self.num_sequences > 1 else "(one row)"),
            f"end to end:         {(self.prefill_s + self.decode_s) * 1e3:.1f} ms, "
            f"{self.end_to_end_tokens_per_s:.1f} generated tokens/s (prefill + decode time)",
            f"pages read / step:  {self.pages_read_per_step:.1f} vs {self.pages_dense_per_step:.1f} dense "
            f"({ratio(self.pages_read, self.pages_dense)}; mean over decode steps, summed over rows, layers, KV "
            f"heads; a row that fits the budget reads all its pages"
            + ("; the budget is the capacity: the pages top-p kept are under 'pages attended'" if self.top_p else "")
            + ")",
            f"KV bytes / step:    {_fmt_bytes(self.kv_bytes_read_per_step)} vs "
            f"{_fmt_bytes(self.kv_bytes_dense_per_step)} dense ({ratio(self.kv_bytes_read, self.kv_bytes_dense)}; "
            f"sparse includes page min/max" + (", not the re-rank's 4-bit key codes" if self.rerank else "")
            + (", at the capacity" if self.top_p else "") + ")",
            f"KV cache:           {_fmt_bytes(self.kv_cache_bytes)} allocated, {_count(self.pages_used, 'page')} of "
            f"{self.page_size} tokens in use at the end",
        ] + ([f"pages attended:     {self.pages_attended.format(self.page_size)}"]
             if self.pages_attended is not None and self.pages_attended.hist is not None else [])
          + ([f"selection:          {self.selection.format()} (sparse layers, steps that selected)"]
             if self.selection is not None and self.selection.samples else [])
          + ([f"cuda graphs:        {self.graphed_steps} of {self.decode_steps} decode steps replayed"]
             if self.graphed_steps else []))


def _count(n: int, noun: str) -> str:
    """``1 prompt token``, ``2 prompt tokens``: the stats block's first line reads ``1 prompt token`` from BOS."""
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


@dataclass
class GenerationOutput:
    """``tokens[i]``: the new tokens of prompt ``i`` (EOS included when it stopped on EOS);
    ``stopped_on_eos[i]``: whether row ``i`` ended on EOS rather than ``max_new_tokens``."""

    tokens: list[list[int]]
    stopped_on_eos: list[bool]
    stats: GenerationStats = field(default_factory=GenerationStats)


class LlamaRuntime:
    """Batched generation over a paged KV cache with query-aware sparse decode.

    Args:
        model: a :class:`LlamaModel`.
        page_size: tokens per KV page.
        page_budget: pages kept per (sequence, KV head) per decode step; ``None`` = dense.
        num_sink_pages, num_recent_pages: pages always kept at the start / end of each sequence;
            ``num_sink_pages=None`` (default): one sink page when ``page_budget >= 16``
            (:func:`tinyattn.layer.default_num_sink_pages`).
        dense_layers: leading layers that stay dense during decode (Quest keeps 2).
        backend: ``None`` (by device), ``"torch"`` or ``"triton"``.
        policy: page-selection policy, a name (``"quest"``, the default, ``"questmass"``, ``"meanstd"``,
            ``"oracle"``, ``"streaming"``, ``"h2o"``, ``"random"``) or a :class:`tinyattn.selection.SelectionPolicy`.
        selection_metrics: measure each sparse step against the oracle selection (hit rate, captured
            attention mass; in ``GenerationStats.selection``); costs a dense attention pass per sparse layer.
        kv_cache_dtype: KV storage format of the caches it makes: ``"auto"`` (the model dtype), ``"fp16"``,
            ``"bf16"``, ``"int8"`` or ``"fp8_e4m3"`` (see :class:`tinyattn.PagedKVCache`); fp8 on the Triton
            backend needs sm_89+ (else ``ValueError``).
        box_dtype: dtype of the page boxes: ``"auto"`` (the pool's dtype, fp32 for int8 / fp8), ``"fp32"``,
            ``"bf16"`` or ``"fp16"`` (narrower boxes are rounded outward, so Quest's bound stays a bound; see
            :mod:`tinyattn.ops.kv_cache.torch_impl`).
        cuda_graphs: in :meth:`generate`, replay decode steps as CUDA graphs captured per batch-size bucket
            (``1, 2, 4, ...`` up to the batch; :mod:`tinyattn.models.graphs`): host bookkeeping outside the
            graph, embedding, every layer's K/V write, selection and attention, and the head inside. Where steps
            cannot be captured (a model off CUDA, the torch backend, an int8 / fp8 cache, a policy other than
            Quest, selection metrics) they run eagerly after one warning here; prefill, and steps under a
            profiler, always run eagerly. Costs one extra KV page per :meth:`generate` (the padding rows').
        gamma: the page estimate of the ``quest`` selection, in ``[0, 1]``: ``q·c + gamma·|q|·r`` over each page's
            key box; default :data:`tinyattn.layer.DEFAULT_GAMMA`, ``1`` is Quest's bound (:class:`SparsityConfig`).
        top_p: ``None`` (default) or a number in ``(0, 1]``: the ``quest`` selection keeps the fewest best pages
            whose estimated attention mass reaches ``top_p``, ``page_budget`` being the capacity
            (:class:`SparsityConfig`). The read statistics of :meth:`generate` (``pages_read``, ``kv_bytes_read``)
            count the capacity; its ``pages_attended`` counts the pages each (sparse layer, KV head, row, eager
            decode step) attended, as top-p kept them (mean, min / median / max, histogram).
        rerank, candidates: the ``quest`` selection's second stage (:class:`SparsityConfig`): ``"int4"`` re-ranks
            ``ceil(candidates · page_budget)`` candidates by their attention mass estimated from 4-bit key codes;
            the caches this runtime makes then keep the codes (``D/2`` bytes per key and head).

    Example::

        model = LlamaModel.from_llama2c("stories260K.bin")
        rt = LlamaRuntime(model, page_size=16, page_budget=4)
        out = rt.generate([tok.encode("Once upon a time")], max_new_tokens=100)
        print(tok.decode(out.tokens[0])); print(out.stats.format())
    """

    def __init__(self, model: LlamaModel, *, page_size: int = 16, page_budget: int | None = None,
                 num_sink_pages: int | None = None, num_recent_pages: int = 1, dense_layers: int = 0,
                 backend: str | None = None, policy="quest", selection_metrics: bool = False,
                 kv_cache_dtype: str = "auto", box_dtype: str = "auto", cuda_graphs: bool = False,
                 gamma: float = DEFAULT_GAMMA, top_p: float | None = None, rerank: str | None = None,
                 candidates: float = 1.0):
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
        if backend not in (None, "torch", "triton"):
            raise ValueError(f"backend must be None, 'torch' or 'triton', got {backend!r}")
        quant.storage_dtype(kv_cache_dtype, model.dtype)                   # ValueError naming the formats
        runs_on = backend or ("triton" if model.device.type == "cuda" else "torch")
        supported = kv_formats_supported(runs_on, model.device)
        if kv_cache_dtype not in supported:
            raise ValueError(f"kv_cache_dtype: the {runs_on} backend on {model.device} supports {supported}, got "
                             f"{kv_cache_dtype!r}")
        self.kv_cache_dtype = kv_cache_dtype
        self.box_dtype = box_dtype
        self._box_bytes = quant.box_dtype_for(box_dtype, quant.storage_dtype(kv_cache_dtype, model.dtype),
                                              quant.is_quantized(quant.storage_dtype(kv_cache_dtype, model.dtype))
                                              ).itemsize                   # ValueError naming the box dtypes
        self.model = model
        self.page_size = page_size
        self.sparsity = SparsityConfig(page_budget=page_budget, num_sink_pages=num_sink_pages,
                                       num_recent_pages=num_recent_pages, dense_layers=dense_layers,
                                       policy=policy, gamma=gamma, top_p=top_p, rerank=rerank,
                                       candidates=candidates)
        self.selection_metrics = bool(selection_metrics)
        if dense_layers > model.config.n_layers:
            raise ValueError(f"dense_layers ({dense_layers}) exceeds the model's n_layers ({model.config.n_layers})")
        self.backend = backend
        self.attention = PagedAttention(self.sparsity, backend=backend)   # one plan, reused every step
        self.cuda_graphs = bool(cuda_graphs)
        self.graphs_off = None        # why requested graphs cannot be used (a sentence), else None
        if self.cuda_graphs:
            from .graphs import why_not_graphed

            self.graphs_off = why_not_graphed(model, self.sparsity, backend=backend, kv_cache_dtype=kv_cache_dtype,
                                              selection_metrics=self.selection_metrics)
            if self.graphs_off is not None:
                warnings.warn(f"cuda_graphs=True: {self.graphs_off}; decode steps run eagerly", stacklevel=2)

    def __repr__(self) -> str:
        s = self.sparsity
        return (f"LlamaRuntime(page_size={self.page_size}, page_budget={s.page_budget}, "
                f"num_sink_pages={s.num_sink_pages}, num_recent_pages={s.num_recent_pages}, "
                f"dense_layers={s.dense_layers}, policy={s.policy.name!r}, gamma={s.gamma}, top_p={s.top_p}, "
                f"rerank={s.rerank!r}, backend={self.backend!r}, "
                f"kv_cache_dtype={self.kv_cache_dtype!r}, box_dtype={self.box_dtype!r}, "
                f"cuda_graphs={self.cuda_graphs})")

    # -------------------------------------------------------------- building blocks
    def new_cache(self, max_tokens: list[int], *, extra_pages: int = 0):
        """A cache with exactly enough pages for sequences of the given maximum lengths (plus ``extra_pages``)."""
        num_pages = sum(max(1, -(-n // self.page_size)) for n in max_tokens) + extra_pages
        return self.model.new_cache(page_size=self.page_size, num_pages=num_pages, kv_cache_dtype=self.kv_cache_dtype,
                                    box_dtype=self.box_dtype, key_codes=self.sparsity.rerank is not None)

    def prefill(self, cache, seq_id: int, tokens: list[int] | torch.Tensor, *, last_only: bool = True) -> torch.Tensor:
        """Dense prefill of one sequence; logits of the last token ``[V]`` (or of all ``[T, V]``)."""
        t = torch.as_tensor(tokens, dtype=torch.long).reshape(1, -1)     # on the host: validated with no device sync
        logits = self.model(t, cache, [seq_id], sparse=False, attention=self.attention,
                            last_only=last_only)  # dense; a stateful policy (h2o) observes it
        return logits[0]

    def decode(self, cache, seq_ids: list[int], tokens: list[int] | torch.Tensor,
               stats: GenerationStats | None = None, selection_metrics=None) -> torch.Tensor:
        """One decode step: append ``tokens[b]`` to ``seq_ids[b]``; logits ``[B, V]`` (sparse per config).

        ``selection_metrics`` (a :class:`tinyattn.selection.SelectionMetrics`, default ``stats.selection``)
        accumulates the step's hit rate and captured mass against the oracle."""
        t = torch.as_tensor(tokens, dtype=torch.long).reshape(-1, 1)     # on the host: validated with no device sync
        if selection_metrics is None and stats is not None:
            selection_metrics = stats.selection
        logits = self.model(t, cache, seq_ids, sparse=True, attention=self.attention,
                            last_only=True, selection_metrics=selection_metrics)
        if stats is not None:
            self._count_reads(stats, [cache.length(s) for s in seq_ids])
        return logits

    def _graphed_decode(self, graphs, cache, seq_ids: list[int], tokens: list[int], stats: GenerationStats
                        ) -> torch.Tensor:
        """A decode step of :meth:`generate`: replayed by ``graphs`` (a :class:`tinyattn.models.graphs.DecodeGraphs`)
        when it can, else :meth:`decode`."""
        if graphs is None or not graphs.can_replay(len(seq_ids)):
            return self.decode(cache, seq_ids, tokens, stats)
        vocab = self.model.config.vocab_size
        if min(tokens) < 0 or max(tokens) >= vocab:
            raise ValueError(f"token ids must be in [0, {vocab}), got min {min(tokens)} max {max(tokens)}")
        replays = graphs.replays
        logits = graphs.step(seq_ids, tokens)
        stats.graphed_steps += graphs.replays - replays
        self._count_reads(stats, [cache.length(s) for s in seq_ids])
        return logits

    def _count_reads(self, stats: GenerationStats, seq_lens) -> None:
        """Add one decode step's reads to ``stats``: the :mod:`tinyattn.metrics` model (DESIGN.md §1) per
        (row, KV head), dense layers at ``page_budget=None``, sparse layers at the runtime's budget, sliding
        layers their window's pages and keys (in both columns: full attention of a sliding layer is its window)."""
        cfg = self.model.config
        page_size, D, Hkv = self.page_size, cfg.head_dim, cfg.n_kv_heads
        elem = quant.storage_dtype(self.kv_cache_dtype, self.model.dtype).itemsize    # bytes per stored value
        # the per-row formulas on Python ints: no tensor op per step (a list from the runtime: no device sync)
        lens = seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else list(seq_lens)
        sliding = [i for i in range(cfg.n_layers) if cfg.is_sliding(i)]
        n_sparse = sum(self.sparsity.layer_is_sparse(i) and not cfg.is_sliding(i) for i in range(cfg.n_layers))
        n_dense = cfg.n_layers - n_sparse - len(sliding)
        n_full = cfg.n_layers - len(sliding)
        dense_pages = sum(metrics.pages_read(n, page_size) for n in lens) * Hkv
        dense_bytes = sum(metrics.dense_bytes(n, D, elem) for n in lens) * Hkv
        if sliding:
            w = cfg.window_left(sliding[0])
            window_pages = sum(metrics.window_pages(n, page_size, w) for n in lens) * Hkv * len(sliding)
            window_bytes = sum(metrics.dense_bytes(metrics.window_tokens(n, w), D, elem) for n in lens) * Hkv \
                * len(sliding)
            stats.pages_dense += window_pages
            stats.pages_read += window_pages
            stats.kv_bytes_dense += window_bytes
            stats.kv_bytes_read += window_bytes
        stats.pages_dense += dense_pages * n_full
        stats.kv_bytes_dense += dense_bytes * n_full
        stats.pages_read += dense_pages * n_dense
        stats.kv_bytes_read += dense_bytes * n_dense
        if n_sparse:
            budget = self.sparsity.page_budget
            stats.pages_read += sum(metrics.pages_read(n, page_size, budget) for n in lens) * Hkv * n_sparse
            stats.kv_bytes_read += sum(metrics.sparse_bytes(n, D, page_size, budget, elem, self._box_bytes)
                                       for n in lens) * Hkv * n_sparse
        stats.decode_steps += 1

    # -------------------------------------------------------------- generation
    @torch.no_grad()
    def generate(self, prompts: list[list[int]], *, max_new_tokens: int, temperature: float = 0.0,
                 seed: int | None = None, eos_id: int | None = 2, stop_token_ids=()) -> GenerationOutput:
        """Generate continuations of a batch of prompts.

        Each prompt is prefilled alone (dense); then all rows decode together, one token per step,
        through the sparse path. A row stops after ``max_new_tokens`` tokens, on ``eos_id`` (``None``: never
        on EOS), or on any of ``stop_token_ids`` (e.g. BOS for llama2.c models, whose stories end where
        the next one's BOS would be, as ``run.c`` stops); the stopping token is kept in ``tokens``. ``temperature == 0`` is greedy; otherwise tokens are sampled
        from ``softmax(logits / temperature)`` with a ``torch.Generator`` seeded by ``seed``.
        """
        if isinstance(prompts, str) or any(isinstance(p, str) for p in prompts):
            raise TypeError("prompts: expected a list of token-id lists, got text; encode it first, e.g. "
                            "tok = tinyattn.models.Tokenizer(tinyattn.assets.default_tokenizer_path()); "
                            "prompts = [tok.encode('Once upon a time')]")
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prompts must be a non-empty list of non-empty token lists (start with BOS)")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        if not temperature >= 0 or math.isinf(temperature):
            raise ValueError(f"temperature must be a finite float >= 0, got {temperature!r}")
        cfg = self.model.config
        longest = max(len(p) for p in prompts) + max_new_tokens
        if longest > cfg.max_seq_len:
            warnings.warn(f"sequences reach {longest} tokens, past the model's training context "
                          f"max_seq_len={cfg.max_seq_len}; quality will degrade", stacklevel=2)
        gen = None
        if temperature > 0:
            gen = torch.Generator(device=self.model.device)
            gen.manual_seed(seed if seed is not None else torch.seed())

        sparse = not self.sparsity.is_dense
        stats = GenerationStats(num_sequences=len(prompts), prompt_tokens=sum(len(p) for p in prompts),
                                page_size=self.page_size, top_p=self.sparsity.top_p if sparse else None,
                                rerank=self.sparsity.rerank if sparse else None)
        if self.selection_metrics and not self.sparsity.is_dense:
            stats.selection = selection.SelectionMetrics()
        self.sparsity.policy.reset()  # per-sequence state is keyed by the ids of the new cache
        graphed = self.cuda_graphs and self.graphs_off is None and max_new_tokens > 1
        cache = self.new_cache([len(p) + max_new_tokens for p in prompts], extra_pages=int(graphed))
        stats.kv_cache_bytes = _cache_bytes(cache)
        if not self.sparsity.is_dense:
            stats.pages_attended = metrics.PagesAttended()
        seq_ids = [cache.add_sequence() for _ in prompts]
        graphs = None
        if graphed:       # per call: the graphs hold this cache's pools (the padding rows take the extra page)
            from .graphs import DecodeGraphs

            graphs = DecodeGraphs(self.model, cache, self.sparsity, backend=self.backend, max_batch=len(prompts),
                                  max_pages_per_seq=-(-longest // self.page_size))
        out: list[list[int]] = [[] for _ in prompts]
        stopped = [False] * len(prompts)

        with self.model.frozen_weights():     # weights checked once per call, not per step
            t0 = time.perf_counter()
            logits = torch.stack([self.prefill(cache, sid, p) for sid, p in zip(seq_ids, prompts)])  # [B, V]
            stats.prefill_s = time.perf_counter() - t0

            t0 = time.perf_counter()
            active = list(range(len(prompts))) if max_new_tokens > 0 else []
            self.attention.attended = stats.pages_attended
            try:
                self._decode_loop(active, logits, gen, temperature, out, stopped, eos_id, stop_token_ids,
                                  max_new_tokens, graphs, cache, seq_ids, stats)
            finally:
                self.attention.attended = None
        stats.decode_s = time.perf_counter() - t0
        stats.generated_tokens = sum(len(o) for o in out)
        stats.pages_used = sum(int(n) for n in (cache.seq_lens(seq_ids).long() + self.page_size - 1) // self.page_size)
        for sid in seq_ids:
            cache.free(sid)
        return GenerationOutput(tokens=out, stopped_on_eos=stopped, stats=stats)

    def _decode_loop(self, active, logits, gen, temperature, out, stopped, eos_id, stop_token_ids, max_new_tokens,
                     graphs, cache, seq_ids, stats) -> None:
        """:meth:`generate`'s decode steps: sample, stop rows, decode the rest (``out`` / ``stopped`` in place)."""
        while active:
            next_tokens = self._sample(logits, temperature, gen)  # one per active row
            still = []
            for row, tok in zip(active, next_tokens):
                out[row].append(tok)
                if (eos_id is not None and tok == eos_id) or tok in stop_token_ids:
                    stopped[row] = True
                elif len(out[row]) < max_new_tokens:
                    still.append(row)
            if not still:
                break
            keep = [i for i, row in enumerate(active) if row in set(still)]
            toks = [next_tokens[i] for i in keep]
            active = still
            logits = self._graphed_decode(graphs, cache, [seq_ids[r] for r in active], toks, stats)

    @staticmethod
    def _sample(logits: torch.Tensor, temperature: float, gen: torch.Generator | None) -> list[int]:
        if temperature == 0:
            return logits.argmax(-1).tolist()
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        return torch.multinomial(probs, 1, generator=gen).squeeze(-1).tolist()


def _cache_bytes(cache) -> int:
    """Bytes the cache allocated: K/V pools and page boxes, all layers."""
    return cache.kv_bytes
