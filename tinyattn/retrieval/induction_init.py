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

:func:`write_context_induction_circuit` (the shipped model's start since its second version) adds a second
matching head that compares the characters 5-8 back, so that names one letter apart are told apart.
"""

from __future__ import annotations

import math

import torch

__all__ = ["write_induction_circuit", "write_context_induction_circuit", "ONE_HOT_CHARS"]


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


def _offset_qk(head_dim: int, theta: float, offsets, pairs: int, r: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k (``[head_dim]``) for a constant input such that, after interleaved RoPE, ``q_t . k_s`` over the
    ``pairs`` fastest frequencies is the sum of the one-offset kernels of :func:`_prev_token_qk` at ``offsets``:
    ``r² Σ_i Σ_o cos(θ_i (t - s - o))``. For two adjacent offsets the kernel is symmetric about their middle, so
    both get the same score (and half the attention each) and every other offset in a 64-token window scores
    lower."""
    q, k = torch.zeros(head_dim), torch.zeros(head_dim)
    c = sum(offsets) / len(offsets)
    for i in range(pairs):
        f = theta ** (-2 * i / head_dim)
        a = sum(math.cos(f * (o - c)) for o in offsets)          # amplitude of frequency i, phase at the middle
        m = r * math.sqrt(abs(a))
        sign = 1.0 if a >= 0 else -1.0
        k[2 * i] = m
        q[2 * i], q[2 * i + 1] = sign * m * math.cos(f * c), -sign * m * math.sin(f * c)
    return q, k


#: characters given their own content channel by :func:`write_context_induction_circuit` (the rest share them)
ONE_HOT_CHARS = "0123456789 " + "abcdefghijklmnopqrstuvwxyz" + "ABCDEFGHIJKLMNOPRSTUVWXYZ" + "<"   # no Q


@torch.no_grad()
def write_context_induction_circuit(model, *, nope_layer: int, tokenizer=None, offsets=((5, 6), (7, 8)),
                                    prev_scale: float = 9.0, box_scale: float = 9.0, match_scale: float = 2.0,
                                    context_scale: float = 2.5, gate_scale: float = 3.0, sink_scale: float = 3.5,
                                    copy_scale: float = 3.0, gate_chars: str = "<") -> None:
    """An induction circuit whose matching head compares the characters 5-8 positions back as well as the
    previous one: the multikey task's names differ in one letter, 5-7 characters before the ``<`` of the value,
    and :func:`write_induction_circuit`'s head (my token vs the previous one) sees every ``<`` as the same.

    Layout of the residual stream (``dim >= 192``, ``head_dim >= 64``, ``n_heads >= 3``), channels:
    ``[0, 64)`` content: the 63 characters of :data:`ONE_HOT_CHARS` (digits, space, letters but ``Q``, ``<``)
    and BOS one-hot, the other tokens random unit vectors; ``[64, 128)`` the previous token's content;
    ``[128, 190)`` the context bag ``S``: half the sum of the contents of the tokens 5, 6, 7 and 8 back (content
    channels 0-61: digits, space, letters); channel ``dim - 1`` constant.

    * layer 0, head 0: previous-token head (as :func:`write_induction_circuit`), content -> previous channels;
      heads 1 and 2: the same construction with RoPE kernels peaking equally at the two offsets of
      ``offsets[0]`` and of ``offsets[1]`` (the kernel of two adjacent offsets is symmetric about their middle),
      content -> ``S``;
    * layer ``nope_layer``, head 0: "my token" vs "the previous token" (query = content, key = previous
      channels), copying what follows, as before; head 1: "my context bag" vs "the key's context bag",
      ``S(query) . S(key)``, plus a gate (query: my token is one of ``gate_chars``; key: its previous token
      is) and an attention sink at BOS (value 0) that outscores any ungated match: head 1 copies only for a
      ``<`` query, from a position right after a ``<``. At the ``<`` of ``... of Tom is <`` the bag (5-8 back)
      is ``" Tom"``, at the first digit of ``The pass key of Tom is <48213>`` it is ``"Tom "``: the same
      letters, which the needles of ``Tim``, ``Kit`` or ``Ben`` do not give (one letter differs), nor the
      distractors ``Tom counted <...``.

    With no training, head 1 puts nearly all its attention on the asked needle's first digit and the first
    answer digit is right on 16 of 16 multikey prompts of 1024 tokens (the previous-token circuit: 0 of 16;
    ``tests/retrieval/test_retrieval.py``). Every other weight keeps its random initialisation.
    """
    from .tokenizer import CharTokenizer

    cfg = model.config
    D, hd = cfg.dim, cfg.head_dim
    C = 64
    if D < 3 * C or hd < C or cfg.n_heads < 3 or cfg.n_kv_heads != cfg.n_heads:
        raise ValueError(f"model: the context induction circuit needs dim >= 192, head_dim >= 64, n_heads >= 3 == "
                         f"n_kv_heads, got dim={D}, head_dim={hd}, n_heads={cfg.n_heads}, n_kv_heads={cfg.n_kv_heads}")
    tok = tokenizer or CharTokenizer()
    PREV, S, NS = C, 2 * C, C - 2                                  # channel offsets; S holds content 0..61
    E = model.tok_embeddings.weight
    E.zero_()
    E[:, :C] = torch.randn(E.shape[0], C) / math.sqrt(C)
    ids = [tok.encode(ch, bos=False)[0] for ch in ONE_HOT_CHARS] + [tok.bos_id]     # BOS: content channel 63
    E[ids, :C] = torch.eye(C)
    E[:, D - 1] = 1.0
    const = math.sqrt(D / 2)                                       # the constant channel after RMSNorm
    scale_in = math.sqrt(D / 2)                                    # a unit content vector after RMSNorm
    l0 = model.layers[0]
    kernels = [(0, (1,), prev_scale, PREV, C), (1, offsets[0], box_scale, S, NS), (2, offsets[1], box_scale, S, NS)]
    for h, offs, r, dst, n in kernels:
        rows = slice(h * hd, (h + 1) * hd)
        q, k = _offset_qk(hd, cfg.rope_theta, offs, pairs=4 if len(offs) == 1 else 6, r=r / math.sqrt(len(offs)))
        for w in (l0.wq, l0.wk, l0.wv):
            w.weight[rows] = 0.0
        l0.wo.weight[:, rows] = 0.0
        l0.wq.weight[rows, D - 1] = q / const
        l0.wk.weight[rows, D - 1] = k / const
        for j in range(n):
            l0.wv.weight[h * hd + j, j] = 1.0
            l0.wo.weight[dst + j, h * hd + j] = (1.0 if len(offs) == 1 else 0.5 * len(offs)) / scale_in
    ln = model.layers[nope_layer]
    for h in range(2):
        rows = slice(h * hd, (h + 1) * hd)
        for w in (ln.wq, ln.wk, ln.wv):
            w.weight[rows] = 0.0
        ln.wo.weight[:, rows] = 0.0
        for j in range(C - 1):                                     # not BOS's channel: the sink copies nothing
            ln.wv.weight[h * hd + j, j] = 1.0
            ln.wo.weight[j, h * hd + j] = copy_scale / scale_in
    for j in range(C):                                             # head 0: my token vs the previous token
        ln.wq.weight[j, j] = match_scale
        ln.wk.weight[j, PREV + j] = match_scale
    for j in range(NS):                                            # head 1: my context vs the key's
        ln.wq.weight[hd + j, S + j] = context_scale
        ln.wk.weight[hd + j, S + j] = context_scale
    gate = [tok.encode(ch, bos=False)[0] for ch in gate_chars]
    g = E[gate, :C].sum(0)                                         # [C]: the gate characters' direction
    ln.wq.weight[hd + NS, :C] = gate_scale * g
    ln.wk.weight[hd + NS, PREV:PREV + C] = gate_scale * g
    # an attention sink: every query scores BOS (position 0, value 0) above an ungated match of the context, so
    # head 1 copies only where the gate holds (a gate-character query, a key right after a gate character)
    ln.wq.weight[hd + NS + 1, D - 1] = sink_scale
    ln.wk.weight[hd + NS + 1, C - 1] = sink_scale
