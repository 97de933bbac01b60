"""The retrieval model's checkpoint format: ``model.safetensors`` + ``config.json`` in one directory.

``config.json`` holds ``{"format": "tinyattn-retrieval", "version": 1, "llama_config": {...LlamaConfig
fields...}, "tokenizer": {"type": "char", "chars": ..., "bos_id": 1, "eos_id": 2, "unk_id": 0}}`` plus
free-form ``"training"`` metadata; ``model.safetensors`` holds :class:`tinyattn.models.LlamaModel`'s state dict
under its own names (``tok_embeddings.weight``, ``layers.0.wq.weight``, ...; the tied classifier once).

The shipped model lives in ``tinyattn/data/retrieval/`` (docs/retrieval.md).
"""

from __future__ import annotations

import dataclasses
import json
import os
from importlib import resources
from pathlib import Path

import torch

from tinyattn.models.config import LlamaConfig
from .tokenizer import CharTokenizer

__all__ = ["load_retrieval_model", "save_retrieval_model", "default_retrieval_dir", "WEIGHTS", "CONFIG"]

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
_FORMAT = "tinyattn-retrieval"


def default_retrieval_dir() -> Path:
    """``tinyattn/data/retrieval/``: the shipped model's directory."""
    return Path(str(resources.files("tinyattn") / "data" / "retrieval"))


def save_retrieval_model(model, tokenizer: CharTokenizer, directory: str | os.PathLike, *,
                         training: dict | None = None) -> Path:
    """Write ``model`` (a :class:`tinyattn.models.LlamaModel`) and ``tokenizer`` to ``directory`` (created if
    needed) as ``model.safetensors`` + ``config.json``; ``training``: metadata stored in the config. Returns
    the directory."""
    from safetensors.torch import save_model

    if not isinstance(tokenizer, CharTokenizer):
        raise TypeError(f"tokenizer: expected a CharTokenizer, got {type(tokenizer).__name__}")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    save_model(model, str(out / WEIGHTS))                 # writes a tied classifier once
    cfg = dataclasses.asdict(model.config)
    cfg = {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()}
    meta = {"format": _FORMAT, "version": 1, "llama_config": cfg,
            "tokenizer": {"type": "char", "chars": tokenizer.CHARS, "bos_id": tokenizer.bos_id,
                          "eos_id": tokenizer.eos_id, "unk_id": tokenizer.unk_id}}
    if training is not None:
        meta["training"] = training
    (out / CONFIG).write_text(json.dumps(meta, indent=1) + "\n")
    return out


def load_retrieval_model(path: str | os.PathLike | None = None, *, dtype: torch.dtype = torch.float32,
                         device: str | torch.device = "cpu"):
    """Load a retrieval checkpoint: ``(LlamaModel, CharTokenizer)``, the model in eval mode without gradients.

    Args:
        path: the checkpoint directory (``model.safetensors`` + ``config.json``); default the shipped model,
            ``tinyattn/data/retrieval/``.
        dtype, device: where the weights go (default fp32 on the CPU).

    Raises:
        FileNotFoundError: a file of the checkpoint is missing (the message names it).
        ValueError: ``config.json`` is not a tinyattn retrieval checkpoint, or its tokenizer is not the
            :class:`CharTokenizer` vocabulary.
    """
    from safetensors.torch import load_model

    from tinyattn.models.llama import LlamaModel

    d = default_retrieval_dir() if path is None else Path(path)
    for name in (CONFIG, WEIGHTS):
        if not (d / name).is_file():
            raise FileNotFoundError(f"path: the retrieval checkpoint {str(d)!r} has no {name} (expected "
                                    f"{CONFIG} + {WEIGHTS}, as written by save_retrieval_model)")
    meta = json.loads((d / CONFIG).read_text())
    if meta.get("format") != _FORMAT:
        raise ValueError(f"path: {str(d / CONFIG)!r} has format {meta.get('format')!r}, expected {_FORMAT!r}")
    tok_meta = meta.get("tokenizer", {})
    tokenizer = CharTokenizer()
    if tok_meta.get("type") != "char" or tok_meta.get("chars") != tokenizer.CHARS:
        raise ValueError(f"path: {str(d / CONFIG)!r} has a tokenizer this version does not know "
                         f"(type {tok_meta.get('type')!r}); expected the CharTokenizer vocabulary")
    cfg = dict(meta["llama_config"])
    for key in ("layer_types", "nope_layers"):
        if cfg.get(key) is not None:
            cfg[key] = tuple(cfg[key])
    model = LlamaModel(LlamaConfig(**cfg))
    load_model(model, str(d / WEIGHTS), strict=True)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False), tokenizer
