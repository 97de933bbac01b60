"""LlamaConfig: the shape of a LLaMA-family model, in its own module so that the checkpoint loaders
(:mod:`tinyattn.models.llama2c`) and the model (:mod:`tinyattn.models.llama`) both import it and never
each other (``llama`` imports ``llama2c`` lazily, ``llama2c`` imports only this module)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LlamaConfig"]


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of a LLaMA-family model (names follow llama2.c)."""

    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    max_seq_len: int = 2048
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    shared_classifier: bool = True

    def __post_init__(self):
        if self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads
