"""Fine-tuning with a paged KV memory: chunked long-context training and gradient-aware KV retention.

- :mod:`.retention`: policies that decide which memory pages to free when over budget
  (:class:`FullRetention`, :class:`RecencyRetention`, :class:`GradientRetention`).
- :mod:`.memory`: :class:`ChunkedKVMemory`, per-layer page pools with differentiable chunk writes.
- :mod:`.chunked`: :func:`chunk_forward` / :func:`run_sequences`, the model's forward chunk by chunk.
- :mod:`.finetune`: ``python -m tinyattn.training.finetune`` (the ``finetune`` CLI command).

Method: TinyServe (Liu & Yu, arXiv 2509.12211, §3.4), gradient-aware memory management.
"""

from .chunked import SequenceStats, chunk_forward, run_sequences
from .memory import ChunkedKVMemory
from .retention import POLICIES, FullRetention, GradientRetention, RecencyRetention, RetentionPolicy, make_policy

__all__ = ["ChunkedKVMemory", "chunk_forward", "run_sequences", "SequenceStats", "RetentionPolicy", "FullRetention",
           "RecencyRetention", "GradientRetention", "make_policy", "POLICIES"]
