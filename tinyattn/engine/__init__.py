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

from .engine import Engine
from .params import SamplingParams
from .plugins import ApproximateAttention, EarlyExit, LayerPolicies, Plugin
from .request import RequestOutput, RequestStatus
from .scheduler import ScheduledBatch, Scheduler
from .stats import EngineStats

__all__ = ["Engine", "SamplingParams", "RequestOutput", "RequestStatus", "EngineStats", "Scheduler",
           "ScheduledBatch", "Plugin", "LayerPolicies", "EarlyExit", "ApproximateAttention"]
