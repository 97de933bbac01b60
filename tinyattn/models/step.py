"""The state of one forward step of :class:`tinyattn.models.llama.LlamaModel`, shared by the eager step
(``llama.py``) and the captured one (``graphs.py``), which both build it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ForwardStep"]


@dataclass
class ForwardStep:
    """One forward step of :class:`~tinyattn.models.llama.LlamaModel` (from its ``start_step``): ``B`` rows of ``T`` new
    tokens, their cache slots, the planned attention layer, RoPE factors ``cis`` ``[B*T, 1, D/2]`` and each
    layer's ``(k_cache, v_cache, k_min, k_max)`` and ``scales`` (``k_scale``/``v_scale`` keywords of a quantized
    cache, else empty)."""
    tokens: torch.Tensor
    batch: int
    num_tokens: int
    cache: object
    slots: torch.Tensor
    attention: object
    cis: torch.Tensor
    pools: list
    scales: list
    weights: list = None          # each block's FusedWeights, then the folded classifier (LlamaModel._weights)
    norm_eps: list = None         # each block's (attention_norm, ffn_norm) eps, then the final norm's
    attn_out: torch.Tensor = None  # a [B, Hq, D] buffer every layer's attention writes into (a graphed step)
    trusted_slots: bool = False   # slots in range by construction: the cache skips its range check (graphs.py)
    codes: list = None            # each layer's 4-bit key codes (a cache with key_codes=True), else None per layer
