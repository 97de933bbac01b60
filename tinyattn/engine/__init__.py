"""The scheduling pipeline: requests, continuous batching, chunked prefill, preemption, plug-ins, serve-bench.

TinyServe's dispatch loop (docs/engine.md): requests arrive at any time (:meth:`Engine.add_request`), join
and leave the running batch at every :meth:`Engine.step`, and go through plug-ins that choose each layer's
attention, stop tokens early, or change logits, without touching the model.

- :class:`Engine` (:mod:`.engine`), :class:`SamplingParams` (:mod:`.params`), :class:`RequestOutput`
  (:mod:`.request`), :class:`EngineStats` (:mod:`.stats`), :class:`Scheduler` (:mod:`.scheduler`).
- Plug-ins (:mod:`.plugins`): :class:`Plugin`, :class:`LayerPolicies`, :class:`EarlyExit`,
  :class:`ApproximateAttention`.
- ``python -m tinyattn serve-bench`` (:mod:`.serve_bench`): Poisson arrivals, TTFT / TPOT / throughput.
"""

import importlib

# name -> module: loaded on first access, so that ``serve-bench --help`` imports no torch
_LAZY = {"Engine": ".engine", "SamplingParams": ".params", "RequestOutput": ".request", "RequestStatus": ".request",
         "EngineStats": ".stats", "Scheduler": ".scheduler", "ScheduledBatch": ".scheduler", "Plugin": ".plugins",
         "LayerPolicies": ".plugins", "EarlyExit": ".plugins", "ApproximateAttention": ".plugins",
         "teacher_forced_nll": ".nll"}

__all__ = list(_LAZY)


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'tinyattn.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
