"""A differentiable full-sequence forward of :class:`tinyattn.models.LlamaModel`, for training.

:meth:`LlamaModel.forward` runs over a paged KV cache with no autograd. Training needs the same math with
gradients, over whole sequences: :func:`full_forward` computes it from the model's own parameters, with the
conventions of :mod:`tinyattn.models.llama` (so that the trained weights give the same logits through the
paged forward):

* RMSNorm (``x * rsqrt(mean(x²) + eps) * g``) before attention and before the FFN, and at the end;
* interleaved RoPE (pairs ``(2i, 2i+1)``, :func:`tinyattn.models.rope_tables` at absolute positions 0..T-1),
  applied to q and k on every layer except ``config.nope_layers``;
* causal attention with scale ``head_dim ** -0.5``, GQA by repeating KV heads; a ``"sliding_attention"``
  layer's query ``i`` sees keys ``j`` with ``i - sliding_window < j <= i`` (:class:`tinyattn.models.LlamaConfig`);
* SwiGLU FFN ``w2(silu(w1 x) * w3 x)``, residual adds, the classifier ``output``.

Queries are processed in chunks (each against only the keys it can see) so that memory stays
``O(chunk x T)`` instead of ``O(T²)`` at 8K-16K tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tinyattn.models.llama import LlamaModel, apply_rope, rope_tables

__all__ = ["full_forward", "attention"]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, window: int | None = None,
              chunk: int = 1024) -> torch.Tensor:
    """Causal attention ``[B, T, H, D]`` of ``q`` ``[B, T, Hq, D]`` over ``k``, ``v`` ``[B, T, Hkv, D]``.

    ``window``: ``None`` for full causal attention, else the sliding window in tokens (the query itself
    included). Query chunks of ``chunk`` rows attend to the keys they can see, through
    :func:`torch.nn.functional.scaled_dot_product_attention` with an explicit boolean mask.
    """
    B, T, Hq, D = q.shape
    group = Hq // k.shape[2]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))                     # [B, H, T, D]
    outs = []
    for s in range(0, T, chunk):
        e = min(T, s + chunk)
        lo = 0 if window is None else max(0, s - window + 1)             # first key any query of the chunk sees
        i = torch.arange(s, e, device=q.device)[:, None]                 # query positions [C, 1]
        j = torch.arange(lo, e, device=q.device)[None, :]                # key positions [1, K]
        mask = j <= i
        if window is not None:
            mask = mask & (j > i - window)
        outs.append(F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, lo:e], v[:, :, lo:e], attn_mask=mask))
    return torch.cat(outs, dim=2).transpose(1, 2)                          # [B, T, H, D]


def _rms_norm(x: torch.Tensor, norm) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight


def full_forward(model: LlamaModel, tokens: torch.Tensor, *, chunk: int = 1024) -> torch.Tensor:
    """Logits ``[B, T, vocab_size]`` (fp32) of every position of ``tokens`` ``[B, T]`` (int64), positions
    ``0..T-1``, differentiable in the model's parameters; the math of :meth:`LlamaModel.forward` (module
    docstring). Raises ``ValueError`` for a ``tokens`` that is not 2-D or holds ids outside the vocabulary."""
    cfg = model.config
    if tokens.dim() != 2:
        raise ValueError(f"tokens: expected [B, T], got shape {tuple(tokens.shape)}")
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= cfg.vocab_size):
        raise ValueError(f"tokens: expected ids in [0, {cfg.vocab_size}), got min {int(tokens.min())} "
                         f"max {int(tokens.max())}")
    B, T = tokens.shape
    hd = cfg.head_dim
    cos, sin = rope_tables(hd, T, cfg.rope_theta)
    cos, sin = cos.to(tokens.device)[None], sin.to(tokens.device)[None]  # [1, T, D/2]
    x = model.tok_embeddings(tokens).float()
    for li, layer in enumerate(model.layers):
        h = _rms_norm(x, layer.attention_norm)
        q = layer.wq(h).view(B, T, cfg.n_heads, hd)
        k = layer.wk(h).view(B, T, cfg.n_kv_heads, hd)
        v = layer.wv(h).view(B, T, cfg.n_kv_heads, hd)
        if cfg.uses_rope(li):
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        window = cfg.sliding_window if cfg.is_sliding(li) else None
        x = x + layer.wo(attention(q, k, v, window=window, chunk=chunk).reshape(B, T, -1))
        h = _rms_norm(x, layer.ffn_norm)
        x = x + layer.ffn(h)
    return model.output(_rms_norm(x, model.norm)).float()
