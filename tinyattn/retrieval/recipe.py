"""The training recipe's options (:class:`TrainConfig`) and the model's shape (:data:`MODEL_DEFAULTS`), apart
from :mod:`tinyattn.retrieval.train` so that the command line can show the defaults without importing torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from .tasks import TASKS

__all__ = ["TrainConfig", "MODEL_DEFAULTS", "CIRCUITS"]

#: the shipped model's shape (keyword arguments of :func:`tinyattn.retrieval.train.default_model_config`)
MODEL_DEFAULTS = dict(dim=192, n_layers=4, n_heads=3, hidden_dim=384, sliding_window=64, nope_layer=2,
                      max_seq_len=16384)

#: the constructed circuits :func:`tinyattn.retrieval.train.train` can start from (``TrainConfig.circuit``)
CIRCUITS = ("context", "previous")


@dataclass
class TrainConfig:
    """Options of :func:`tinyattn.retrieval.train.train` (the ``train-retrieval`` command's flags).

    ``curriculum``: stages ``(max_length, steps)`` or ``(max_length, steps, tasks)``; a stage's batches have
    lengths drawn uniformly between the previous stage's ``max_length`` (half its own for the first) and its
    own (at least the longest :func:`~tinyattn.retrieval.tasks.min_context_tokens` of its tasks), and its rows
    cycle over ``tasks`` (default: :attr:`tasks`). ``batch_tokens``: prompt tokens per batch (batch size =
    ``batch_tokens // length``, at least 1)."""

    seed: int = 0
    curriculum: tuple = ((512, 300, ("copy",) + TASKS), (1024, 250, ("copy",) + TASKS))
    batch_tokens: int = 3072
    lr: float = 1.5e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    lm_weight: float = 0.1
    tasks: tuple = TASKS
    threads: int = 1
    eval_lengths: tuple = (2048, 4096, 8192)
    eval_samples: int = 8
    model: dict = field(default_factory=dict)    # overrides of MODEL_DEFAULTS
    induction_init: bool = True                  # start from tinyattn.retrieval.induction_init's circuit
    circuit: str = "context"                     # which one (CIRCUITS): the context match or the previous token

    @property
    def total_steps(self) -> int:
        return sum(stage[1] for stage in self.curriculum)


