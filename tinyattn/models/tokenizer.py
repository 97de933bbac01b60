"""llama2.c BPE tokenizer (``tokenizer.bin`` / ``tok512.bin`` format).

File format (little endian)::

    int32 max_token_length
    vocab_size x (float32 score, int32 length, length bytes)

``vocab_size`` is not stored: it is the number of records in the file (or given explicitly).
Ids 0, 1, 2 are ``<unk>``, BOS and EOS; ids 3..258 are the byte tokens ``<0x00>``..``<0xFF>``.

:meth:`Tokenizer.encode` reproduces ``encode()`` of llama2.c ``run.c`` token for token: prepend a
space ("dummy prefix"), map each UTF-8 character to its token (byte fallback: ``byte + 3``), then
repeatedly merge the adjacent pair whose concatenation is in the vocabulary with the highest
score, the leftmost pair winning ties. The merge loop uses a heap and a linked list, so it is
O(n log n) instead of run.c's O(n^2); :meth:`Tokenizer.encode_naive` is the literal run.c loop,
kept as the reference the fast one is tested against.
"""

from __future__ import annotations

import heapq
import os
import re
import struct
from pathlib import Path

__all__ = ["Tokenizer"]

_BYTE_PIECE = re.compile(rb"^<0x([0-9A-Fa-f]{2})>$")


class Tokenizer:
    """A llama2.c tokenizer.

    Args:
        path: the ``tokenizer.bin`` file.
        vocab_size: number of records to read; ``None`` reads every record in the file.
    """

    unk_id = 0
    bos_id = 1
    eos_id = 2

    def __init__(self, path: str | os.PathLike, vocab_size: int | None = None):
        self.path = Path(path)
        data = self.path.read_bytes()
        if len(data) < 4:
            raise ValueError(f"tokenizer file {str(self.path)!r} is too short ({len(data)} bytes)")
        (self.max_token_length,) = struct.unpack_from("<i", data, 0)
        offset = 4
        pieces: list[bytes] = []
        scores: list[float] = []
        while offset < len(data) and (vocab_size is None or len(pieces) < vocab_size):
            if offset + 8 > len(data):
                raise ValueError(
                    f"tokenizer file {str(self.path)!r} is truncated: record {len(pieces)} header at byte "
                    f"{offset} needs 8 bytes, {len(data) - offset} left"
                )
            score, length = struct.unpack_from("<fi", data, offset)
            offset += 8
            if length < 0 or offset + length > len(data):
                raise ValueError(
                    f"tokenizer file {str(self.path)!r} is truncated or corrupt: record {len(pieces)} "
                    f"claims {length} bytes at byte {offset}, {len(data) - offset} left"
                )
            pieces.append(data[offset : offset + length])
            scores.append(score)
            offset += length
        if vocab_size is not None and len(pieces) != vocab_size:
            raise ValueError(
                f"tokenizer file {str(self.path)!r} holds {len(pieces)} records, expected vocab_size={vocab_size}"
            )
        if len(pieces) < 259:
            raise ValueError(
                f"tokenizer file {str(self.path)!r} holds {len(pieces)} records; a llama2.c vocabulary needs "
                f"at least 259 (3 special tokens + 256 byte tokens)"
            )
        self.pieces = pieces
        self.scores = scores
        # run.c looks strings up with bsearch over a sorted vocabulary; with unique pieces any
        # lookup gives the same id. Keep the first id on (unexpected) duplicates.
        self.piece_to_id: dict[bytes, int] = {}
        for i, p in enumerate(pieces):
            self.piece_to_id.setdefault(p, i)
        # raw bytes each id decodes to (byte tokens -> the byte itself)
        self._decoded: list[bytes] = []
        for p in pieces:
            m = _BYTE_PIECE.match(p)
            self._decoded.append(bytes([int(m.group(1), 16)]) if m else p)

    @property
    def vocab_size(self) -> int:
        return len(self.pieces)

    def __len__(self) -> int:
        return len(self.pieces)

    def __repr__(self) -> str:
        return f"Tokenizer(path={str(self.path)!r}, vocab_size={self.vocab_size})"

    # ------------------------------------------------------------------ encoding
    def _initial_tokens(self, text: str) -> list[int]:
        """The dummy prefix and the per-character tokens, as run.c builds them before merging."""
        raw = text.encode("utf-8", errors="surrogatepass")
        tokens: list[int] = []
        if raw:
            space = self.piece_to_id.get(b" ")
            tokens.append(space if space is not None else ord(" ") + 3)
        lookup = self.piece_to_id
        buf = bytearray()
        n = len(raw)
        for i, c in enumerate(raw):
            if c & 0xC0 != 0x80:  # not a continuation byte: start a new character
                buf.clear()
            buf.append(c)
            if i + 1 < n and raw[i + 1] & 0xC0 == 0x80 and len(buf) < 4:
                continue
            tid = lookup.get(bytes(buf))
            if tid is not None:
                tokens.append(tid)
            else:
                tokens.extend(b + 3 for b in buf)
            buf.clear()
        return tokens

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        """Token ids of ``text`` exactly as llama2.c ``run.c`` ``encode()`` (heap merge, O(n log n))."""
        tokens = self._merge(self._initial_tokens(text))
        if bos:
            tokens.insert(0, self.bos_id)
        if eos:
            tokens.append(self.eos_id)
        return tokens

    def encode_naive(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        """The literal run.c merge loop (O(n^2)); the reference :meth:`encode` is tested against."""
        tokens = self._initial_tokens(text)
        pieces, scores, lookup = self.pieces, self.scores, self.piece_to_id
        while True:
            best_score, best_id, best_idx = -1e10, -1, -1
            for i in range(len(tokens) - 1):
                tid = lookup.get(pieces[tokens[i]] + pieces[tokens[i + 1]])
                if tid is not None and scores[tid] > best_score:
                    best_score, best_id, best_idx = scores[tid], tid, i
            if best_idx == -1:
                break
            tokens[best_idx : best_idx + 2] = [best_id]
        if bos:
            tokens.insert(0, self.bos_id)
        if eos:
            tokens.append(self.eos_id)
        return tokens

    def _merge(self, tokens: list[int]) -> list[int]:
        """run.c's merge loop with a heap of candidate pairs and a doubly linked list.

        Heap entries are ``(-score, left_position, left_token, right_token, merged_id)``. A node keeps
        the position of its leftmost original token, and merging keeps list order, so among pairs of
        equal score the heap pops the leftmost one, as run.c's strict ``>`` scan does. Entries made
        stale by an earlier merge are recognised (left node gone, or its token / its right neighbour's
        token changed) and skipped.
        """
        n = len(tokens)
        if n < 2:
            return list(tokens)
        pieces, scores, lookup = self.pieces, self.scores, self.piece_to_id
        tok = list(tokens)
        prev = list(range(-1, n - 1))
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        alive = [True] * n

        def candidate(i: int):
            """The heap entry of the pair (node i, its right neighbour), or None if it is not a merge."""
            j = nxt[i]
            if j == -1:
                return None
            tid = lookup.get(pieces[tok[i]] + pieces[tok[j]])
            return None if tid is None else (-scores[tid], i, tok[i], tok[j], tid)

        heap = [c for c in map(candidate, range(n - 1)) if c is not None]
        heapq.heapify(heap)

        def push(i: int) -> None:
            c = candidate(i)
            if c is not None:
                heapq.heappush(heap, c)

        while heap:
            _, i, ti, tj, tid = heapq.heappop(heap)
            if not alive[i] or tok[i] != ti:
                continue
            j = nxt[i]
            if j == -1 or tok[j] != tj:
                continue
            # merge node j into node i
            tok[i] = tid
            alive[j] = False
            k = nxt[j]
            nxt[i] = k
            if k != -1:
                prev[k] = i
            p = prev[i]
            if p != -1:
                push(p)
            push(i)

        out = []
        i = 0
        while i != -1:
            out.append(tok[i])
            i = nxt[i]
        return out

    # ------------------------------------------------------------------ decoding
    def decode_piece(self, prev_token: int, token: int) -> bytes:
        """Bytes of one token as run.c ``decode()``: the leading space after BOS is stripped."""
        piece = self._decoded[token]
        if prev_token == self.bos_id and self.pieces[token].startswith(b" "):
            piece = piece[1:]
        return piece

    def decode_bytes(self, ids, skip_special: bool = True) -> bytes:
        ids = [int(t) for t in ids]
        out = bytearray()
        prev = -1
        for t in ids:
            if not 0 <= t < len(self.pieces):
                raise ValueError(f"token id {t} out of range [0, {len(self.pieces)})")
            if skip_special and t in (self.unk_id, self.bos_id, self.eos_id):
                prev = t
                continue
            out += self.decode_piece(prev, t)
            prev = t
        return bytes(out)

    def decode(self, ids, skip_special: bool = True) -> str:
        """Text of ``ids``: special tokens dropped, the space after BOS stripped, byte tokens as raw
        bytes; the bytes are read as UTF-8 (invalid sequences replaced)."""
        return self.decode_bytes(ids, skip_special=skip_special).decode("utf-8", errors="replace")
