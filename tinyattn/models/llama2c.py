"""Loader for llama2.c checkpoints (the "legacy" version-0 format written by ``export.py``).

Layout (little endian)::

    7 x int32: dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len
    float32 tensors, each matrix stored (out_features, in_features) so that y = W @ x:
      token_embedding (vocab, dim)
      rms_att (L, dim); wq (L, H*hd, dim); wk (L, Hkv*hd, dim); wv (L, Hkv*hd, dim); wo (L, dim, H*hd)
      rms_ffn (L, dim); w1 (L, hidden, dim); w2 (L, dim, hidden); w3 (L, hidden, dim)
      rms_final (dim)
      freq_cis_real (seq_len, hd/2); freq_cis_imag (seq_len, hd/2)   (unused: RoPE is recomputed)
      wcls (vocab, dim)   only when the header's vocab_size is negative (unshared classifier)

A positive ``vocab_size`` means the classifier shares the token embedding.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import torch

from .config import LlamaConfig

__all__ = ["read_llama2c_header", "load_llama2c"]

_HEADER = struct.Struct("<7i")


def _not_a_checkpoint(path: Path, reason: str) -> ValueError:
    return ValueError(f"{str(path)!r} is not a llama2.c checkpoint (the legacy format of llama2.c export.py: "
                      f"7 int32 header fields, then fp32 tensors): {reason}")


def read_llama2c_header(path: str | os.PathLike) -> LlamaConfig:
    """Read and check the 28-byte header against the file; returns the :class:`LlamaConfig` it describes.

    A file that is not a llama2.c checkpoint (a tokenizer, text, random bytes) raises ``ValueError`` saying
    so: its header fields must be positive (``vocab_size`` nonzero; negative = unshared classifier), ``dim``
    a multiple of ``n_heads``, ``n_heads`` of ``n_kv_heads``, the head dimension even, and the file size
    exactly 28 bytes plus 4 per float of the tensors the header describes.
    """
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(_HEADER.size)
    if len(head) < _HEADER.size:
        raise _not_a_checkpoint(path, f"{len(head)} bytes, the header alone needs 28")
    dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len = _HEADER.unpack(head)
    fields = (f"dim={dim}, hidden_dim={hidden_dim}, n_layers={n_layers}, n_heads={n_heads}, n_kv_heads={n_kv_heads}, "
              f"vocab_size={vocab_size}, seq_len={seq_len}")
    if min(dim, hidden_dim, n_layers, n_heads, n_kv_heads, seq_len) <= 0 or vocab_size == 0:
        raise _not_a_checkpoint(path, f"its header reads {fields}; every field must be positive (vocab_size "
                                      f"nonzero)")
    if dim % n_heads or n_heads % n_kv_heads or (dim // n_heads) % 2:
        raise _not_a_checkpoint(path, f"its header reads {fields}; dim must be a multiple of n_heads, n_heads of "
                                      f"n_kv_heads, and dim / n_heads (the head dimension) even")
    cfg = LlamaConfig(dim=dim, hidden_dim=hidden_dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
                      vocab_size=abs(vocab_size), max_seq_len=seq_len, shared_classifier=vocab_size > 0)
    expected = _HEADER.size + 4 * sum(_prod(s) for _, s in _tensor_shapes(cfg))
    actual = path.stat().st_size
    if actual != expected:
        raise ValueError(
            f"{str(path)!r} is not a llama2.c checkpoint, or a truncated one: file size {actual:,} bytes does not "
            f"match its header ({fields}{'' if cfg.shared_classifier else ', unshared classifier'}), which needs "
            f"{expected:,} bytes"
        )
    return cfg


def _tensor_shapes(cfg: LlamaConfig) -> list[tuple[str, tuple[int, ...]]]:
    L, d, hd = cfg.n_layers, cfg.dim, cfg.head_dim
    shapes = [
        ("tok_embeddings", (cfg.vocab_size, d)),
        ("rms_att", (L, d)),
        ("wq", (L, cfg.n_heads * hd, d)),
        ("wk", (L, cfg.n_kv_heads * hd, d)),
        ("wv", (L, cfg.n_kv_heads * hd, d)),
        ("wo", (L, d, cfg.n_heads * hd)),
        ("rms_ffn", (L, d)),
        ("w1", (L, cfg.hidden_dim, d)),
        ("w2", (L, d, cfg.hidden_dim)),
        ("w3", (L, cfg.hidden_dim, d)),
        ("rms_final", (d,)),
        ("freq_cis_real", (cfg.max_seq_len, hd // 2)),
        ("freq_cis_imag", (cfg.max_seq_len, hd // 2)),
    ]
    if not cfg.shared_classifier:
        shapes.append(("wcls", (cfg.vocab_size, d)))
    return shapes


def load_llama2c(path: str | os.PathLike) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """Load a llama2.c legacy checkpoint.

    Returns ``(config, state_dict)`` where the state dict uses :class:`tinyattn.models.LlamaModel`'s
    parameter names (``layers.{i}.wq.weight`` ..., ``output.weight``), fp32 tensors.
    """
    path = Path(path)
    cfg = read_llama2c_header(path)            # also checks the file size against the header
    shapes = _tensor_shapes(cfg)
    flat = torch.frombuffer(bytearray(path.read_bytes()[_HEADER.size:]), dtype=torch.float32)
    raw: dict[str, torch.Tensor] = {}
    off = 0
    for name, shape in shapes:
        n = _prod(shape)
        raw[name] = flat[off : off + n].view(shape).clone()
        off += n

    sd: dict[str, torch.Tensor] = {"tok_embeddings.weight": raw["tok_embeddings"], "norm.weight": raw["rms_final"]}
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        sd[p + "attention_norm.weight"] = raw["rms_att"][i]
        sd[p + "wq.weight"] = raw["wq"][i]
        sd[p + "wk.weight"] = raw["wk"][i]
        sd[p + "wv.weight"] = raw["wv"][i]
        sd[p + "wo.weight"] = raw["wo"][i]
        sd[p + "ffn_norm.weight"] = raw["rms_ffn"][i]
        sd[p + "w1.weight"] = raw["w1"][i]
        sd[p + "w2.weight"] = raw["w2"][i]
        sd[p + "w3.weight"] = raw["w3"][i]
    sd["output.weight"] = raw["tok_embeddings"] if cfg.shared_classifier else raw["wcls"]
    return cfg, sd


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
