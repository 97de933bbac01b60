"""The retrieval tasks of :mod:`tinyattn.retrieval.tasks` for a pretrained model's subword (BPE) tokenizer.

Same needles, questions, answers, seeds and filler as the character-level generator (``_layout`` and
:func:`~tinyattn.retrieval.tasks.filler_text`: TinyStories text, no digits, no ``<>``), laid out in *tokens*:

    [BOS if the tokenizer adds one] INSTRUCTION filler ... " <needle>" ... filler "\\n" "<question>"   -> answer

- :data:`INSTRUCTION` is the standard opening of the passkey test (Mohtashami & Jaggi 2023, "Landmark Attention",
  the prompt Quest's passkey evaluation uses): a pretrained model is told that something is hidden in the text,
  and a needle at depth 0 is not the very first tokens of the prompt (the tokens a pretrained model uses as an
  attention sink; without it SmolLM2-135M missed the depth-0 needle even with dense attention);

- the filler is the whole filler text encoded once per tokenizer, read from a seeded token offset (wrapping
  around), cut to make the prompt exactly ``context_tokens`` long;
- each needle is encoded on its own with a leading space and inserted at a token boundary where a word starts
  (the first token at or after the requested position whose text begins with a space or newline);
- the question follows one ``"\\n"`` token (the harness decodes from the prompt's last newline on), and the answer
  is ``tokenizer.encode(answer, bos=False)`` (five digits: five tokens for SmolLM2, which splits digits).

Use it as ``evaluate_tasks(model, tokenizer, make_sample=make_subword_sample, ...)`` with an
:class:`tinyattn.models.HFTokenizer` (``eval --model smollm2 --task passkey`` does).
"""

from __future__ import annotations

import random
from functools import lru_cache

from .tasks import TASKS, Sample, _layout, filler_text

__all__ = ["INSTRUCTION", "make_subword_sample", "min_subword_context"]

#: the passkey test's opening line (Landmark Attention's prompt, as used by Quest)
INSTRUCTION = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
               "I will quiz you about the important information there.")


@lru_cache(maxsize=4)
def _filler_tokens(tokenizer) -> tuple[int, ...]:
    return tuple(tokenizer.encode(filler_text(), bos=False))


@lru_cache(maxsize=4096)
def _starts_word(tokenizer, token: int) -> bool:
    text = tokenizer.decode([token], skip_special=False)
    return text[:1] in (" ", "\n")


def _pieces(task: str, rng: random.Random, tokenizer):
    asked, others, extras, question, answer = _layout(task, rng)
    enc = lambda s: tokenizer.encode(s, bos=False)   # noqa: E731
    head = tokenizer.encode(INSTRUCTION, bos=True)
    return (head, [enc(" " + asked)], [enc(" " + t) for t in others], [enc(" " + t) for t in extras],
            enc("\n"), enc(question), enc(answer))


def min_subword_context(task: str, tokenizer) -> int:
    """The shortest ``context_tokens`` :func:`make_subword_sample` accepts for ``task`` (no filler)."""
    head, asked, others, extras, newline, question, _ = _pieces(task, random.Random(f"{task}:0"), tokenizer)
    return len(head) + sum(map(len, asked + others + extras)) + len(newline) + len(question)


def make_subword_sample(task: str, *, context_tokens: int, depth: float, seed: int, tokenizer) -> Sample:
    """A prompt of ``task`` of exactly ``context_tokens`` tokens of ``tokenizer`` with its asked needle at
    ``depth`` of the filler (moved to the next word start); see the module docstring.

    Raises:
        ValueError: unknown ``task``; ``depth`` outside ``[0, 1]``; ``context_tokens`` below
        :func:`min_subword_context`; ``tokenizer`` is ``None``.
    """
    if task not in TASKS:
        raise ValueError(f"task: expected one of {TASKS}, got {task!r}")
    if isinstance(depth, bool) or not isinstance(depth, (int, float)) or not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth: expected a number in [0, 1], got {depth!r}")
    if tokenizer is None:
        raise ValueError("tokenizer: expected the model's subword tokenizer (e.g. tinyattn.models.HFTokenizer), "
                         "got None")
    rng = random.Random(f"{task}:{seed}")
    head, asked, others, extras, newline, question, answer = _pieces(task, rng, tokenizer)
    pieces = asked + others + extras
    need = len(head) + sum(map(len, pieces)) + len(newline) + len(question)
    if context_tokens < need:
        raise ValueError(f"context_tokens: the {task} task needs at least {need} tokens of this tokenizer (needles "
                         f"and question with no filler), got {context_tokens}")
    n_fill = context_tokens - need
    source = _filler_tokens(tokenizer)
    start = rng.randrange(len(source))
    filler = list((source * (1 + (start + n_fill) // len(source)))[start:start + n_fill])

    def word_start(i: int) -> int:
        while 0 < i < len(filler) and not _starts_word(tokenizer, filler[i]):
            i += 1
        return min(i, len(filler))

    where = [word_start(round(depth * n_fill))] + [word_start(rng.randrange(n_fill + 1)) for _ in pieces[1:]]
    asked_tie = -1 if depth < 0.5 else len(pieces)
    order = sorted(range(len(pieces)), key=lambda i: (where[i], i if i else asked_tie))
    prompt, spans, cursor = list(head), {}, 0
    for i in order:
        prompt += filler[cursor:where[i]]
        cursor = where[i]
        spans[i] = (len(prompt), len(prompt) + len(pieces[i]))
        prompt += pieces[i]
    prompt += filler[cursor:] + newline + question
    assert len(prompt) == context_tokens, (len(prompt), context_tokens)
    needed = [0] + list(range(1, 1 + len(others)))
    return Sample(task=task, prompt=prompt, answer=answer, context_tokens=context_tokens,
                  depth=where[0] / n_fill if n_fill else float(depth), needle_positions=[spans[i] for i in needed],
                  text=tokenizer.decode(prompt, skip_special=False))
