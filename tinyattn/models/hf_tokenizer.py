"""HFTokenizer: a transformers tokenizer behind the interface of tinyattn's llama2.c :class:`Tokenizer`
(``encode(text, bos=True, eos=False)``, ``decode(ids)``, ``bos_id``, ``eos_id``, ``vocab_size``), so that the
runtime's commands (``generate``, ``eval``) and the retrieval harness take a pretrained model's own tokenizer.

``bos=True`` adds the special tokens the tokenizer itself adds (``add_special_tokens=True``): none for SmolLM2,
whose GGUF says ``add_bos_token = false``; ``bos=False`` adds none. ``eos=True`` appends ``eos_id``.
"""

from __future__ import annotations

import os

__all__ = ["HFTokenizer"]


class HFTokenizer:
    """Wraps ``transformers.PreTrainedTokenizerBase`` ``tokenizer`` (see the module docstring)."""

    def __init__(self, tokenizer):
        self.hf = tokenizer
        self.bos_id = tokenizer.bos_token_id
        self.eos_id = tokenizer.eos_token_id

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "HFTokenizer":
        """``AutoTokenizer.from_pretrained(path)`` (a folder with ``tokenizer.json``; no network)."""
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(path)))

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce (added tokens included)."""
        return len(self.hf)

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"HFTokenizer({type(self.hf).__name__}, vocab_size={self.vocab_size})"

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        """Token ids of ``text`` (``TypeError`` for a non-string)."""
        if not isinstance(text, str):
            raise TypeError(f"text: expected a str, got {type(text).__name__}")
        ids = list(self.hf.encode(text, add_special_tokens=bos))
        return ids + [self.eos_id] if eos and self.eos_id is not None else ids

    def decode(self, ids, skip_special: bool = True) -> str:
        """The text of ``ids`` (special tokens dropped unless ``skip_special=False``)."""
        return self.hf.decode(list(ids), skip_special_tokens=skip_special)
