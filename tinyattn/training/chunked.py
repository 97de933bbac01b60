"""Differentiable chunked forward of a :class:`tinyattn.models.LlamaModel` over a :class:`ChunkedKVMemory`.

:func:`chunk_forward` is the model's forward (same weights, same math as ``LlamaModel.forward``) for the
next chunk of each row, reading earlier chunks' K/V from the memory through
:class:`tinyattn.layer.PagedAttention` (held pages only) with autograd on. :func:`run_sequences` drives
a whole batch of sequences chunk by chunk: evict, forward, loss, backward, observe page gradients,
commit; it is used both for training (weight gradients accumulate over the chunks) and for evaluation.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..layer import PagedAttention
from ..models import apply_rope, rope_tables
from .memory import ChunkedKVMemory
from .retention import RetentionPolicy

__all__ = ["chunk_forward", "run_sequences", "SequenceStats", "SavedTensorMeter"]


class SavedTensorMeter:
    """Counts the bytes autograd saves for backward (unique storages), via ``saved_tensors_hooks``.

    This is the activation memory of a chunk: what a GPU would hold between forward and backward.
    """

    def __init__(self):
        self.bytes = 0
        self._seen: set[int] = set()

    def _pack(self, t: torch.Tensor):
        try:
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key not in self._seen:
                self._seen.add(key)
                self.bytes += storage.nbytes()
        except (RuntimeError, NotImplementedError):  # tensors without storage (fake, sparse): not counted
            pass
        # a detached alias, never ``t`` itself: a saved *output* packed with its grad_fn would make a reference
        # cycle node -> saved tensor -> node that Python's gc cannot see (it lives in C++), so a graph built
        # without a backward (a chunk without counted targets) and everything it saves (the K/V pools, the
        # weights through AccumulateGrad) would never be freed
        return t.detach()

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)


def chunk_forward(model, tokens: torch.Tensor, memory: ChunkedKVMemory, *, backend: str | None = None,
                  track_gradients: bool = False, rope=None) -> torch.Tensor:
    """Logits ``[B, n, V]`` (fp32) of the next ``n`` tokens of each row; ``memory.begin_chunk(n)`` first.

    Each layer writes the chunk's K/V (after RoPE at absolute positions; NoPE layers unrotated) into an
    out-of-place copy of its pool and attends over the held pages (the chunk's own pages included, causal
    bottom-right; a sliding layer only within its window, ``config.window_left``).
    """
    cfg = model.config
    B, n = tokens.shape
    hd, Hq, Hkv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    cos_t, sin_t = rope if rope is not None else rope_tables(hd, memory.seq_len, cfg.rope_theta)
    pos = torch.arange(memory.length, memory.length + n, device=tokens.device)
    cos, sin = cos_t[pos].expand(B, n, -1), sin_t[pos].expand(B, n, -1)
    seq_lens = memory.seq_lens()
    x = model.tok_embeddings(tokens)
    attention = PagedAttention(backend=backend)           # the one attention layer, with retained pages
    for li, layer in enumerate(model.layers):
        h = layer.attention_norm(x)
        q, k = layer.wq(h).view(B, n, Hq, hd), layer.wk(h).view(B, n, Hkv, hd)
        if cfg.uses_rope(li):
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = layer.wv(h).view(B, n, Hkv, hd)
        k_pool, v_pool = memory.write(li, k, v, track_gradients=track_gradients)
        # each layer retains its own pages, so each has its own block table: one plan per layer
        attention.begin(memory.block_table(li), seq_lens, num_q_heads=Hq, num_kv_heads=Hkv, head_dim=hd,
                        page_size=memory.page_size, num_query_tokens=n, decode=False, trusted=True)
        attn = attention(li, q, k_pool, v_pool, page_indices=memory.page_indices(li, Hkv),
                         window_left=cfg.window_left(li))
        x = x + layer.wo(attn.reshape(B, n, Hq * hd))
        x = x + layer.ffn(layer.ffn_norm(x))
    return model.output(model.norm(x)).float()


@dataclass
class SequenceStats:
    """What one batch of sequences cost and scored."""

    nll_sum: float = 0.0            # nats, summed over target tokens
    num_tokens: int = 0
    num_correct: int = 0            # counted targets the logits' argmax predicts (teacher forcing)
    peak_kv_bytes: int = 0          # K/V held by the memory at its fullest
    pool_bytes: int = 0             # K/V pools as allocated
    peak_chunk_bytes: int = 0       # max over chunks: saved activations + pool-shaped gradients
    evicted_pages: int = 0

    @property
    def nll(self) -> float:
        return self.nll_sum / max(self.num_tokens, 1)

    @property
    def accuracy(self) -> float:
        """Fraction of counted targets predicted by the argmax (teacher forcing)."""
        return self.num_correct / max(self.num_tokens, 1)


def run_sequences(model, tokens: torch.Tensor, policy: RetentionPolicy, *, chunk_size: int, page_size: int,
                  capacity: int | None, num_sink_pages: int = 1, num_recent_pages: int | None = None,
                  train: bool, backend: str | None = None, loss_mask: torch.Tensor | None = None) -> SequenceStats:
    """Run ``tokens`` ``[B, L + 1]`` (inputs ``[:, :-1]``, targets ``[:, 1:]``) chunk by chunk.

    ``train``: each chunk's loss, divided by the number of chunks, is back-propagated (weight gradients
    accumulate; the caller steps the optimizer). Otherwise only the gradient policy runs a backward (its
    page scores need the pages' gradients; no weight gradient is computed), and the others run under
    ``torch.no_grad()``.

    ``loss_mask``: bool ``[B, L]``, the targets that count (e.g. the answers of a retrieval task); default
    all. A chunk's loss is the sum of its counted targets' NLL over the number counted in the whole batch,
    so every counted token weighs the same whatever chunk it falls in; a chunk with none runs forward only
    (no backward, so the gradient policy observes nothing for it). ``SequenceStats`` sums the counted
    targets only.
    """
    cfg = model.config
    B, L1 = tokens.shape
    L = L1 - 1
    memory = ChunkedKVMemory(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, batch=B, seq_len=L, chunk_size=chunk_size,
                             page_size=page_size, capacity=capacity, policy=policy, num_sink_pages=num_sink_pages,
                             num_recent_pages=num_recent_pages, dtype=model.tok_embeddings.weight.dtype,
                             device=tokens.device)
    rope = rope_tables(cfg.head_dim, L, cfg.rope_theta)
    rope = (rope[0].to(tokens.device), rope[1].to(tokens.device))
    track = policy.needs_gradients
    backward = train or track
    stats = SequenceStats()
    if loss_mask is None:
        loss_mask = torch.ones(B, L, dtype=torch.bool, device=tokens.device)
    elif tuple(loss_mask.shape) != (B, L) or loss_mask.dtype != torch.bool:
        raise ValueError(f"loss_mask: expected a bool tensor of shape [B, L] = {(B, L)}, got "
                         f"{loss_mask.dtype} {tuple(loss_mask.shape)}")
    counted = max(int(loss_mask.sum()), 1)
    for start in range(0, L, chunk_size):
        n = min(chunk_size, L - start)
        memory.begin_chunk(n)
        meter = SavedTensorMeter()
        mask = loss_mask[:, start:start + n].reshape(-1)
        with meter.hooks(), (nullcontext() if backward else torch.no_grad()):
            logits = chunk_forward(model, tokens[:, start:start + n], memory, backend=backend,
                                   track_gradients=track, rope=rope)
            nll = F.cross_entropy(logits.reshape(B * n, -1), tokens[:, start + 1:start + n + 1].reshape(-1),
                                  reduction="none")
            nll_sum = (nll * mask).sum()
        grad_bytes = 0
        if backward and bool(mask.any()):
            (nll_sum / counted).backward()
            if track:
                grad_bytes = sum(p.grad.numel() * p.grad.element_size()
                                 for pools in memory._pools if pools is not None for p in pools if p.grad is not None)
                memory.observe_gradients()
        memory.commit()
        stats.nll_sum += float(nll_sum.detach())
        stats.num_tokens += int(mask.sum())
        hits = logits.detach().argmax(-1).reshape(-1) == tokens[:, start + 1:start + n + 1].reshape(-1)
        stats.num_correct += int((hits & mask).sum())
        stats.peak_chunk_bytes = max(stats.peak_chunk_bytes, meter.bytes + grad_bytes)
    stats.peak_kv_bytes = memory.peak_kv_bytes
    stats.pool_bytes = memory.pool_bytes
    stats.evicted_pages = memory.evicted
    return stats
