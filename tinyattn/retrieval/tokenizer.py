"""A character-level tokenizer for the retrieval model (:mod:`tinyattn.retrieval`).

One token per character over a fixed vocabulary: ids 0, 1, 2 are ``<unk>``, BOS and EOS (the ids of
:class:`tinyattn.models.Tokenizer`, llama2.c's convention), then ``"\\n"`` and the 95 printable ASCII
characters (space to ``~``) in code-point order: 99 ids. That covers the TinyStories filler once
:func:`normalize_text` has mapped its typographic quotes and dashes to ASCII, and every symbol of the tasks
(digits, letters, punctuation). A character level model can copy any string it has seen, which is what
passkey-style retrieval asks for.
"""

from __future__ import annotations

__all__ = ["CharTokenizer", "normalize_text"]

# typographic characters of the TinyStories text -> ASCII; the mis-decoded forms ("â€™", UTF-8 read as
# cp1252) come first so that their pieces are never mapped on their own
_ASCII_FOR = (("â€™", "'"), ("â€˜", "'"), ("â€œ", '"'), ("â€\x9d", '"'), ("â€“", "-"), ("â€”", "-"),
              ("â€¦", "..."), ("’", "'"), ("‘", "'"), ("“", '"'), ("”", '"'), ("–", "-"), ("—", "-"),
              ("…", "..."))


def normalize_text(text: str) -> str:
    """``text`` with curly quotes, dashes and ellipses (and their mis-decoded UTF-8 forms such as ``"â€™"``)
    replaced by ASCII, and every other character outside :class:`CharTokenizer`'s vocabulary removed."""
    for src, dst in _ASCII_FOR:
        text = text.replace(src, dst)
    return "".join(ch for ch in text if ch == "\n" or " " <= ch <= "~")


class CharTokenizer:
    """Character-level tokenizer: one id per character (see the module docstring for the vocabulary).

    The method names are those of :class:`tinyattn.models.Tokenizer` (``encode``, ``decode``, ``vocab_size``,
    ``bos_id``, ``eos_id``, ``unk_id``).

    Args:
        unknown: what :meth:`encode` does with a character outside the vocabulary: ``"error"`` (the default)
            raises ``ValueError`` naming it; ``"unk"`` maps it to :attr:`unk_id`.
    """

    unk_id = 0
    bos_id = 1
    eos_id = 2
    #: the characters of ids 3, 4, ...
    CHARS = "\n" + "".join(chr(c) for c in range(32, 127))

    def __init__(self, unknown: str = "error"):
        if unknown not in ("error", "unk"):
            raise ValueError(f"unknown: expected 'error' or 'unk', got {unknown!r}")
        self.unknown = unknown
        self._id = {ch: i + 3 for i, ch in enumerate(self.CHARS)}

    @property
    def vocab_size(self) -> int:
        """Number of ids: 3 special + 96 characters = 99."""
        return 3 + len(self.CHARS)

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size}, unknown={self.unknown!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, CharTokenizer) and other.CHARS == self.CHARS and other.unknown == self.unknown

    def __hash__(self) -> int:
        return hash((self.CHARS, self.unknown))

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        """Token ids of ``text``, one per character, with BOS first (``bos``) and EOS last (``eos``).

        Raises ``ValueError`` naming the first character outside the vocabulary and its position (unless the
        tokenizer was made with ``unknown="unk"``); :func:`normalize_text` makes any text encodable.
        """
        if not isinstance(text, str):
            raise TypeError(f"text: expected a str, got {type(text).__name__}")
        ids = [self.bos_id] if bos else []
        get = self._id.get
        for pos, ch in enumerate(text):
            i = get(ch)
            if i is None:
                if self.unknown == "error":
                    raise ValueError(f"text: character {ch!r} (U+{ord(ch):04X}) at position {pos} is not in the "
                                     f"CharTokenizer vocabulary (newline and printable ASCII); pass the text "
                                     f"through tinyattn.retrieval.normalize_text or use unknown='unk'")
                i = self.unk_id
            ids.append(i)
        if eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids, skip_special: bool = True) -> str:
        """The text of ``ids`` (a list or 1-D tensor); BOS/EOS/unk are dropped (``skip_special``) or shown as
        ``<s>``, ``</s>``, ``<unk>``. Raises ``ValueError`` for an id outside ``[0, vocab_size)``."""
        specials = ("<unk>", "<s>", "</s>")
        out = []
        for i in (ids.tolist() if hasattr(ids, "tolist") else ids):
            i = int(i)
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"ids: expected token ids in [0, {self.vocab_size}), got {i}")
            if i < 3:
                if not skip_special:
                    out.append(specials[i])
            else:
                out.append(self.CHARS[i - 3])
        return "".join(out)
