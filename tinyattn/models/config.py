"""LlamaConfig: the shape of a LLaMA-family model, in its own module so that the checkpoint loaders
(:mod:`tinyattn.models.llama2c`) and the model (:mod:`tinyattn.models.llama`) both import it and never
each other (``llama`` imports ``llama2c`` lazily, ``llama2c`` imports only this module)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LlamaConfig", "LAYER_TYPES"]

#: Per-layer attention kinds (Hugging Face's ``layer_types`` names, as in Gemma 2/3, Qwen2/3 and SmolLM3).
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of a LLaMA-family model (names follow llama2.c), plus the per-layer options of hybrid models.

    Per-layer options (default: every layer full attention with RoPE, plain LLaMA):

    * ``layer_types``: one of :data:`LAYER_TYPES` per layer, or ``None`` (all ``"full_attention"``). A
      ``"sliding_attention"`` layer's query at position ``i`` sees only keys ``j`` with
      ``i - sliding_window < j <= i`` (Mistral / Gemma; Hugging Face's mask; FlashInfer's
      ``window_left = sliding_window - 1``).
    * ``sliding_window``: the window in tokens, itself included; required iff some layer slides.
    * ``nope_layers``: indices of layers that apply no rotary embedding to q and k ("NoPE", Kazemnejad et al.
      2023; SmolLM3 and Llama 4 interleave such layers). A full-attention NoPE layer between sliding RoPE layers
      is what lets a small model retrieve far past its training length.
    """

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
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None
    nope_layers: tuple[int, ...] = ()

    def __post_init__(self):
        if self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for RoPE")
        self._check_layer_options()

    def _check_layer_options(self) -> None:
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
            if len(self.layer_types) != self.n_layers:
                raise ValueError(f"layer_types: expected {self.n_layers} entries (n_layers), got {len(self.layer_types)}")
            bad = [t for t in self.layer_types if t not in LAYER_TYPES]
            if bad:
                raise ValueError(f"layer_types: expected entries in {LAYER_TYPES}, got {bad[0]!r}")
        slides = any(self.is_sliding(i) for i in range(self.n_layers))
        if slides and (isinstance(self.sliding_window, bool) or not isinstance(self.sliding_window, int)
                       or self.sliding_window < 1):
            raise ValueError(f"sliding_window: expected an int >= 1 for the sliding_attention layers, "
                             f"got {self.sliding_window!r}")
        if not slides and self.sliding_window is not None:
            raise ValueError(f"sliding_window={self.sliding_window} but no layer_types entry is 'sliding_attention'")
        object.__setattr__(self, "nope_layers", tuple(sorted(set(self.nope_layers))))
        bad = [i for i in self.nope_layers if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.n_layers]
        if bad:
            raise ValueError(f"nope_layers: expected layer indices in [0, {self.n_layers}), got {bad[0]!r}")

    def is_sliding(self, layer: int) -> bool:
        """Whether ``layer`` is a sliding-window layer."""
        return self.layer_types is not None and self.layer_types[layer] == "sliding_attention"

    def uses_rope(self, layer: int) -> bool:
        """Whether ``layer`` rotates q and k (every layer except ``nope_layers``)."""
        return layer not in self.nope_layers

    def window_left(self, layer: int) -> int:
        """Keys before the query that ``layer`` sees: ``sliding_window - 1`` for a sliding layer, ``-1`` (no
        limit) otherwise; FlashInfer's ``window_left`` convention."""
        return self.sliding_window - 1 if self.is_sliding(layer) else -1

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads
