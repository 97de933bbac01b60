"""A constructed starting point for training: an induction circuit written into the weights (Olsson et al.
2022, "In-context Learning and Induction Heads", the two-head mechanism).

Trained from a random initialisation, the long-range copying circuit the retrieval tasks need (a
previous-token head, then a head that matches "the token before you" against "my token") did not appear
within the few hundred CPU steps the recipe can afford: both heads must form together, and each gets no
gradient until the other exists. This module writes the circuit in, so training only refines it:

* token embeddings use channels ``[0, dim/2)`` (content) and a constant channel ``dim - 1`` (1.0 for every
  token: after RMSNorm it gives every position the same component, which RoPE turns into a purely
  positional attention score; the tied classifier adds the same logit to every token, a no-op);
* layer 0, heads 0 and 1 (RoPE, sliding): q and k read only the constant channel, with RoPE phases chosen so
  that the score peaks at the previous position; their values copy the content channels and their output
  writes them to channels ``[dim/2, dim - 1)``: each position then holds its own token and the one before;
* layer ``nope_layer``, heads 0 and 1 (full attention, no RoPE): q reads the content channels, k the
  previous-token channels, so a query attends to the positions that follow an earlier occurrence of its
  own token; the values copy those positions' content into the residual, which the tied classifier reads
  as "predict that token".

Every other weight keeps its random initialisation. Requires ``n_heads >= 2``, ``head_dim * 2 <= dim / 2``.
"""

from __future__ import annotations

import math

import torch

__all__ = ["write_induction_circuit"]


def _prev_token_qk(head_dim: int, theta: float, pairs: int, r: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k (``[head_dim]`` each) for a constant input such that, after interleaved RoPE, ``q_t . k_s =
    r² Σ_i cos(θ_i (t - s - 1))`` over the ``pairs`` fastest frequencies: largest at ``t - s = 1``."""
    q, k = torch.zeros(head_dim), torch.zeros(head_dim)
    for i in range(pairs):
        f = theta ** (-2 * i / head_dim)
        k[2 * i] = r
        q[2 * i], q[2 * i + 1] = r * math.cos(f), -r * math.sin(f)
    return q, k


@torch.no_grad()
def write_induction_circuit(model, *, nope_layer: int, prev_scale: float = 9.0, match_scale: float = 2.0,
                            copy_scale: float = 3.0) -> None:
    """Write the circuit of the module docstring into ``model`` (a :class:`tinyattn.models.LlamaModel`)."""
    cfg = model.config
    D, hd = cfg.dim, cfg.head_dim
    half = D // 2
    if cfg.n_heads < 2 or 2 * hd > half or cfg.n_kv_heads != cfg.n_heads:
        raise ValueError(f"model: the induction circuit needs n_heads >= 2 == n_kv_heads and 2 * head_dim <= dim / 2, "
                         f"got n_heads={cfg.n_heads}, n_kv_heads={cfg.n_kv_heads}, head_dim={hd}, dim={D}")
    E = model.tok_embeddings.weight
    E.zero_()
    E[:, :half] = torch.randn(E.shape[0], half) / math.sqrt(half)      # content, unit norm per token
    E[:, D - 1] = 1.0                                                    # the constant channel
    # after RMSNorm the constant channel is about sqrt(D / 2) (content and constant carry equal energy)
    const = math.sqrt(D / 2)
    l0 = model.layers[0]
    q, k = _prev_token_qk(hd, cfg.rope_theta, pairs=4, r=prev_scale)
    for h in range(2):
        rows = slice(h * hd, (h + 1) * hd)
        l0.wq.weight[rows] = 0.0
        l0.wk.weight[rows] = 0.0
        l0.wq.weight[rows, D - 1] = q / const
        l0.wk.weight[rows, D - 1] = k / const
        l0.wv.weight[rows] = 0.0
        l0.wv.weight[rows, h * hd:(h + 1) * hd] = torch.eye(hd)          # content channels of this half
        l0.wo.weight[:, rows] = 0.0
        dst = [half + h * hd + j for j in range(hd) if half + h * hd + j < D - 1]
        for j, c in enumerate(dst):
            l0.wo.weight[c, h * hd + j] = 1.0 / math.sqrt(half)          # back to the embedding's scale
    ln = model.layers[nope_layer]
    for h in range(2):
        rows = slice(h * hd, (h + 1) * hd)
        ln.wq.weight[rows] = 0.0
        ln.wk.weight[rows] = 0.0
        ln.wv.weight[rows] = 0.0
        ln.wo.weight[:, rows] = 0.0
        src = list(range(h * hd, (h + 1) * hd))
        prev = [half + c for c in src]
        for j, (c, p) in enumerate(zip(src, prev)):
            if p < D - 1:
                ln.wq.weight[h * hd + j, c] = match_scale
                ln.wk.weight[h * hd + j, p] = match_scale
            ln.wv.weight[h * hd + j, c] = 1.0
            ln.wo.weight[c, h * hd + j] = copy_scale / math.sqrt(half)
