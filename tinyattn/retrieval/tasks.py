"""Seeded long-context retrieval tasks over TinyStories filler: passkey, multikey, multihop, decoy.

Every prompt is BOS, then TinyStories text (``tinyattn/data/tinystories_sample.txt`` followed by
``tinystories_valid_excerpt.txt``, passed through :func:`~tinyattn.retrieval.normalize_text`, read from a
seeded offset and wrapping around) with one or more *needles* inserted at word boundaries, then a question
whose answer the model must produce greedily. The needle sentence is the one of passkey retrieval
(Mohtashami & Jaggi 2023, "Landmark Attention", the test Quest, Tang et al. 2024, reports in its Fig. 6):

* ``passkey``: one needle, ``The pass key is <48213>. Remember it. <48213> is the pass key.``; the question
  ``What is the pass key? The pass key is <`` and the answer ``48213``.
* ``multikey``: four needles ``The pass key of Tom is <48213>.`` with similar three-letter names (one letter
  apart where the name list allows: Tom, Tim, Tam, ...) and different values, plus two distractor
  sentences that pair the asked name with another five-digit number (``Tom counted <70215> stars.``); the
  question asks for one name's key (``What is the pass key of Tom? The pass key of Tom is <``).
* ``multihop``: a link ``Tom has the same pass key as <Sue>.``, the value ``The pass key of Sue is <48213>.``
  (anywhere in the filler) and two other ``pass key of`` needles; the question ``What is the pass key of
  Tom? Tom has the same pass key as <`` and the answer ``Sue>. The pass key of Sue is <48213``: the model
  retrieves twice, the second time with a query it wrote itself.
* ``decoy``: the needle ``The pass key of Tom is <48213>.`` and, elsewhere, a block of six copies of a
  similar needle (``The pass key of Tim is <90357>.``). The repeated block draws attention mass (and H2O's
  heavy hitters) during the prompt while the answer lies in the single needle.

Values are bracketed by ``<`` ``>``, characters the filler never contains (nor digits): a rare character
before the value lets a small model learn to copy in minutes instead of hours (matching the one character
before the answer is enough to start; matching the name is learnt next). Otherwise the sentence is the
passkey test's.

Lengths are exact: ``len(sample.prompt) == context_tokens`` (the filler is cut to fit). The values are
five digits; the names, values, filler offset and distractor positions depend only on ``(task, seed)``, so a
seed gives the same needles at every ``context_tokens`` and ``depth``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache

from .tokenizer import CharTokenizer, normalize_text

__all__ = ["TASKS", "Sample", "make_sample", "min_context_tokens", "NAMES", "filler_text", "filler_slice"]

TASKS = ("passkey", "multikey", "multihop", "decoy")

#: the keys of multikey / multihop / decoy: three-letter names, many of them one letter apart
NAMES = ("Tom", "Tim", "Tam", "Sam", "Sim", "Kim", "Kit", "Ken", "Ben", "Bea", "Ann", "Amy", "Max", "Mia", "Mae",
         "Lee", "Leo", "Lou", "Lia", "Zoe", "Zac", "Ivy", "Ida", "Eli", "Eve", "Ada", "Abe", "Kai", "Kay", "Ray",
         "Roy", "Rex", "Rod", "Ted", "Tad", "Ned", "Nat", "Nan", "Dan", "Don", "Dot", "Sue", "Sal", "Pam", "Pat")

_NUM_PAIRS = 4          # multikey: key-value needles (the asked one included)
_NUM_DISTRACTORS = 2    # multikey: sentences pairing the asked name with another number
_NUM_DECOYS = 6         # decoy: copies of the similar needle in one block

_TOKENIZER = CharTokenizer()


@dataclass(frozen=True)
class Sample:
    """One prompt of a retrieval task.

    Attributes:
        task: one of :data:`TASKS`.
        prompt: token ids, BOS first, ending right before the answer.
        answer: the token ids the model must produce greedily (no EOS).
        context_tokens: ``len(prompt)`` (exactly the ``context_tokens`` asked of :func:`make_sample`).
        depth: relative position in ``[0, 1]`` of the asked needle (multihop: the link, its first hop) in the
            filler, as placed (the requested depth moved to the next word boundary; the requested depth when the
            prompt has no filler).
        needle_positions: ``[start, end)`` token positions in ``prompt`` of the needles the answer depends on,
            the asked one first (multihop: the link, then the value needle); distractors and decoys excluded.
        text: the prompt's text (without BOS), for reading and debugging.
    """

    task: str
    prompt: list[int]
    answer: list[int]
    context_tokens: int
    depth: float
    needle_positions: list[tuple[int, int]]
    text: str = ""


@lru_cache(maxsize=1)
@lru_cache(maxsize=1)
def filler_text() -> str:
    """The filler (read once per process): the shipped TinyStories text (sample, then the validation excerpt, stories separated by
    blank lines), normalized to the tokenizer's characters, with runs of blank lines collapsed and no digits (so that the only numbers in a
    prompt are the task's)."""
    from tinyattn.assets import data_path

    parts = [data_path(n).read_text(encoding="utf-8") for n in ("tinystories_sample.txt",
                                                                 "tinystories_valid_excerpt.txt")]
    text = normalize_text("\n\n".join(parts).replace("<|endoftext|>", "\n\n"))   # the excerpt's separator
    text = "".join(ch for ch in text if not ch.isdigit() and ch not in "<>")
    while "\n\n\n" in text:
        text = text.replace("\n\n\n", "\n\n")
    return text


def filler_slice(rng: random.Random, n_chars: int) -> str:
    """``n_chars`` characters of :func:`filler_text` from an offset drawn from ``rng`` (wrapping around)."""
    text = filler_text()
    start = rng.randrange(len(text))
    return (text * (1 + (start + n_chars) // len(text)))[start:start + n_chars]


def _value(rng: random.Random, taken: set[str]) -> str:
    while True:
        v = "".join(rng.choice("0123456789") for _ in range(5))
        if v not in taken:
            taken.add(v)
            return v


def _similar_names(rng: random.Random, name: str, k: int) -> list[str]:
    """``k`` names other than ``name``, those one letter apart from it first (in random order)."""
    near = [n for n in NAMES if n != name and sum(a != b for a, b in zip(n, name)) == 1]
    far = [n for n in NAMES if n != name and n not in near]
    rng.shuffle(near)
    rng.shuffle(far)
    return (near + far)[:k]


def _layout(task: str, rng: random.Random):
    """The task's needles, question and answer text: ``(asked, others, extras, question, answer)`` where
    ``asked`` is placed at the requested depth, ``others`` (needles the answer needs) and ``extras``
    (distractors, decoys) at seeded positions; each is a list of texts except ``asked``."""
    taken: set[str] = set()
    if task == "passkey":
        v = _value(rng, taken)
        return (f"The pass key is <{v}>. Remember it. <{v}> is the pass key.", [], [],
                "What is the pass key? The pass key is <", v)
    name = rng.choice(NAMES)
    if task == "multikey":
        v = _value(rng, taken)
        pairs = [f"The pass key of {n} is <{_value(rng, taken)}>." for n in _similar_names(rng, name, _NUM_PAIRS - 1)]
        distract = [f"{name} counted <{_value(rng, taken)}> stars." for _ in range(_NUM_DISTRACTORS)]
        return (f"The pass key of {name} is <{v}>.", [], pairs + distract,
                f"What is the pass key of {name}? The pass key of {name} is <", v)
    if task == "multihop":
        via, *others = _similar_names(rng, name, 3)
        v = _value(rng, taken)
        pairs = [f"The pass key of {n} is <{_value(rng, taken)}>." for n in others]
        return (f"{name} has the same pass key as <{via}>.", [f"The pass key of {via} is <{v}>."], pairs,
                f"What is the pass key of {name}? {name} has the same pass key as <",
                f"{via}>. The pass key of {via} is <{v}")
    if task == "decoy":
        (similar,) = _similar_names(rng, name, 1)
        v, w = _value(rng, taken), _value(rng, taken)
        block = " ".join([f"The pass key of {similar} is <{w}>."] * _NUM_DECOYS)
        return (f"The pass key of {name} is <{v}>.", [], [block],
                f"What is the pass key of {name}? The pass key of {name} is <", v)
    raise AssertionError(task)


def _word_boundary(filler: str, index: int) -> int:
    """The first index ``>= index`` just after a space or newline (or the end)."""
    while 0 < index < len(filler) and filler[index - 1] not in " \n":
        index += 1
    return min(index, len(filler))


def min_context_tokens(task: str) -> int:
    """The shortest ``context_tokens`` :func:`make_sample` accepts for ``task``: BOS, the needles (and
    distractors), the question, and no filler; the same for every seed."""
    if task not in TASKS:
        raise ValueError(f"task: expected one of {TASKS}, got {task!r}")
    return _needed(*_layout(task, random.Random(0))[:4])


def _needed(asked: str, others: list, extras: list, question: str) -> int:
    return 1 + sum(len(t) + 1 for t in [asked] + others + extras) + 1 + len(question)   # BOS ... "\n" question


def make_sample(task: str, *, context_tokens: int, depth: float, seed: int, tokenizer=None) -> Sample:
    """A prompt of ``task`` with exactly ``context_tokens`` tokens and its asked needle at ``depth``.

    Args:
        task: one of :data:`TASKS` (see the module docstring).
        context_tokens: the prompt length in tokens (BOS and question included), exact.
        depth: where the asked needle starts, as a fraction of the filler (0 = right after BOS, 1 = just
            before the question); moved forward to the next word boundary.
        seed: picks the names, values, filler offset and the other needles' positions (an int).
        tokenizer: a character-level tokenizer (one token per character, BOS id first), default the
            shipped :class:`~tinyattn.retrieval.CharTokenizer`.

    Returns:
        a :class:`Sample`.

    Raises:
        ValueError: ``task`` not in :data:`TASKS`; ``depth`` outside ``[0, 1]``; ``context_tokens`` too short
        for the task's needles and question (the message gives the minimum); ``seed`` not an int; a
        tokenizer that is not one token per character.
    """
    if task not in TASKS:
        raise ValueError(f"task: expected one of {TASKS}, got {task!r}")
    if isinstance(depth, bool) or not isinstance(depth, (int, float)) or not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth: expected a number in [0, 1], got {depth!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed: expected an int, got {seed!r}")
    if isinstance(context_tokens, bool) or not isinstance(context_tokens, int):
        raise ValueError(f"context_tokens: expected an int, got {context_tokens!r}")
    tok = _TOKENIZER if tokenizer is None else tokenizer
    rng = random.Random(f"{task}:{seed}")
    asked, others, extras, question, answer = _layout(task, rng)
    pieces = [asked + " "] + [t + " " for t in others + extras]
    need = _needed(asked, others, extras, question)
    if context_tokens < need:
        raise ValueError(f"context_tokens: the {task} task needs at least {need} tokens (BOS, needles and "
                         f"question with no filler), got {context_tokens}")
    n_fill = context_tokens - need
    filler = filler_slice(rng, n_fill)
    # where each piece goes in the filler: the asked needle at depth, the others at seeded positions
    where = [_word_boundary(filler, round(depth * n_fill))]
    where += [_word_boundary(filler, rng.randrange(n_fill + 1)) for _ in pieces[1:]]
    # at the same place the asked needle goes first at small depths and last at large ones (depth 1 = last)
    asked_tie = -1 if depth < 0.5 else len(pieces)
    order = sorted(range(len(pieces)), key=lambda i: (where[i], i if i else asked_tie))
    out, spans, cursor, pos = [], {}, 0, 1                         # pos: token position (after BOS)
    for i in order:
        out.append(filler[cursor:where[i]])
        pos += where[i] - cursor
        cursor = where[i]
        spans[i] = (pos, pos + len(pieces[i]) - 1)                 # the needle without its trailing space
        out.append(pieces[i])
        pos += len(pieces[i])
    out.append(filler[cursor:] + "\n" + question)
    prompt_text = "".join(out)
    prompt = tok.encode(prompt_text, bos=True)
    if len(prompt) != context_tokens or prompt[0] != tok.bos_id:
        raise ValueError(f"tokenizer: expected a character-level tokenizer with BOS first (one token per "
                         f"character), got {len(prompt)} tokens for {context_tokens} positions")
    needed = [0] + list(range(1, 1 + len(others)))
    return Sample(task=task, prompt=prompt, answer=tok.encode(answer, bos=False), context_tokens=context_tokens,
                  depth=where[0] / n_fill if n_fill else float(depth), needle_positions=[spans[i] for i in needed],
                  text=prompt_text)
