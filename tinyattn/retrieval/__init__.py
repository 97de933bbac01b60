"""A small retrieval-capable model and the long-context retrieval tasks it is measured on.

- :class:`CharTokenizer`: the character-level tokenizer (:mod:`tinyattn.retrieval.tokenizer`).
- :data:`TASKS`, :class:`Sample`, :func:`make_sample`: seeded generators of passkey, multikey, multihop
  and decoy prompts over TinyStories filler (:mod:`tinyattn.retrieval.tasks`).
- :func:`load_retrieval_model`: the shipped model (``tinyattn/data/retrieval/``) as a
  :class:`tinyattn.models.LlamaModel` plus its tokenizer (:mod:`tinyattn.retrieval.model`).

See docs/retrieval.md.
"""

from .tokenizer import CharTokenizer, normalize_text
from .tasks import TASKS, Sample, make_sample

__all__ = ["CharTokenizer", "normalize_text", "TASKS", "Sample", "make_sample", "load_retrieval_model",
           "save_retrieval_model"]


def __getattr__(name):            # the model module imports torch: only on demand
    if name in ("load_retrieval_model", "save_retrieval_model"):
        from . import model
        return getattr(model, name)
    raise AttributeError(f"module 'tinyattn.retrieval' has no attribute {name!r}")
