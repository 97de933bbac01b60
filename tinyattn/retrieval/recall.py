"""Recall sequences for long-context fine-tuning: keys early, questions late.

A sequence is BOS, TinyStories filler (:func:`tinyattn.retrieval.tasks.filler_text`) with ``num_keys`` needles
``The pass key of Tom is <48213>.`` (the ``multikey`` task's phrasing, :mod:`tinyattn.retrieval.tasks`) placed in
its first ``keys_end`` fraction, then ``num_questions`` questions spread evenly from ``first_question`` to the end,
each on its own line: ``What is the pass key of Tom? The pass key of Tom is <48213>.`` (names drawn from the keys,
each asked at most once while keys remain unasked). The **loss mask** marks the targets that are answer digits: a model run in
chunks with a bounded KV memory can only lower that loss if the memory still holds the key pages when a
question comes. With the first question placed inside the memory's horizon, a policy that watches gradients
(TinyServe's gradient-aware retention) can learn there which pages matter; recency cannot.

Lengths are exact and everything depends only on ``seed``.
"""

from __future__ import annotations

import random

from .tasks import NAMES, _word_boundary, filler_slice
from .tokenizer import CharTokenizer

__all__ = ["recall_sequence", "recall_batch"]

_TOKENIZER = CharTokenizer()


def _check_fraction(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name}: expected a number in [0, 1], got {value!r}")
    return float(value)


def recall_sequence(*, seq_len: int, seed: int, num_keys: int = 4, num_questions: int = 4, keys_end: float = 0.1,
                    first_question: float = 0.3, tokenizer=None) -> tuple[list[int], list[bool]]:
    """One recall sequence: ``(tokens, loss_mask)``.

    Args:
        seq_len: targets per sequence ``L``; ``tokens`` has ``L + 1`` ids (BOS first), inputs ``tokens[:-1]``.
        seed: picks names, values, filler offset and key positions.
        num_keys: key needles (distinct names and five-digit values).
        num_questions: questions, each asking one key.
        keys_end: the keys lie in the first ``keys_end`` fraction of the sequence.
        first_question: where the first question starts (fraction of the sequence); the rest follow evenly up to
            the end.
        tokenizer: a one-token-per-character tokenizer (default: the shipped :class:`CharTokenizer`).

    Returns:
        ``tokens`` (``L + 1`` ints) and ``loss_mask`` (``L`` bools: target ``t`` = ``tokens[t + 1]`` is an
        answer digit).

    Raises:
        ValueError naming the argument: counts below 1, more keys than names, fractions outside ``[0, 1]``,
        ``keys_end > first_question``, or a ``seq_len`` too short for the keys and questions.
    """
    for name, v in (("seq_len", seq_len), ("num_keys", num_keys), ("num_questions", num_questions)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
    if num_keys > len(NAMES):
        raise ValueError(f"num_keys: expected at most {len(NAMES)} (the names available), got {num_keys}")
    keys_end, first_question = _check_fraction("keys_end", keys_end), _check_fraction("first_question", first_question)
    if keys_end > first_question:
        raise ValueError(f"keys_end ({keys_end}) must not exceed first_question ({first_question})")
    tok = _TOKENIZER if tokenizer is None else tokenizer
    rng = random.Random(f"recall:{seed}")
    names = rng.sample(NAMES, num_keys)
    values = [str(v) for v in rng.sample(range(10000, 100000), num_keys)]
    keys = [f"The pass key of {n} is <{v}>. " for n, v in zip(names, values)]
    asked = [i for _ in range(-(-num_questions // num_keys)) for i in rng.sample(range(num_keys), num_keys)]
    questions = [(f"\nWhat is the pass key of {names[i]}? The pass key of {names[i]} is <", values[i], ">.\n")
                 for i in asked[:num_questions]]
    fixed = sum(map(len, keys)) + sum(len(a) + len(b) + len(c) for a, b, c in questions)
    n_fill = seq_len + 1 - 1 - fixed                                   # L + 1 tokens, BOS first
    if n_fill < 0:
        raise ValueError(f"seq_len: {num_keys} keys and {num_questions} questions need at least {fixed} tokens, "
                         f"got {seq_len}")
    filler = filler_slice(rng, n_fill)
    key_at = sorted(_word_boundary(filler, rng.randrange(max(1, round(keys_end * n_fill)))) for _ in keys)
    span = max(0.0, 1.0 - first_question)
    q_at = [_word_boundary(filler, round(n_fill * (first_question + span * j / num_questions)))
            for j in range(num_questions)]
    inserts = sorted([(p, 0, k) for p, k in zip(key_at, keys)] + [(p, 1, q) for p, q in zip(q_at, questions)],
                     key=lambda x: (x[0], x[1]))
    pieces, answers, pos, cursor = [], [], 1, 0                          # pos: token position (BOS = 0)
    for at, kind, item in inserts:
        pieces.append(filler[cursor:at])
        pos += at - cursor
        cursor = at
        if kind == 0:
            pieces.append(item)
            pos += len(item)
        else:
            question, answer, tail = item
            pieces += [question, answer, tail]
            answers.append((pos + len(question), pos + len(question) + len(answer)))
            pos += len(question) + len(answer) + len(tail)
    pieces.append(filler[cursor:])
    tokens = tok.encode("".join(pieces), bos=True)
    if len(tokens) != seq_len + 1:
        raise ValueError(f"tokenizer: expected one token per character, got {len(tokens)} tokens for "
                         f"{seq_len + 1} positions")
    mask = [False] * seq_len
    for a, b in answers:
        for t in range(a, b):
            mask[t - 1] = True                                           # target t-1 predicts token t
    return tokens, mask


def recall_batch(count: int, *, seq_len: int, first_seed: int = 0, **options):
    """``count`` sequences (seeds ``first_seed, first_seed + 1, ...``) as int64 ``tokens [count, L + 1]`` and
    bool ``loss_mask [count, L]`` (options as :func:`recall_sequence`)."""
    import torch

    pairs = [recall_sequence(seq_len=seq_len, seed=first_seed + i, **options) for i in range(count)]
    return (torch.tensor([t for t, _ in pairs], dtype=torch.int64),
            torch.tensor([m for _, m in pairs], dtype=torch.bool))
