"""Named spans around each phase of an op, for :mod:`tinyattn.profiler`.

The ops wrap their phases (``"metadata"``, ``"score"``, ``"topk"``, ``"attention"``) in
``span(name, **info)``; a model runtime wraps each layer in ``layer(i)``. With no profiler active both
return a shared no-op context (one global read), so the hot path pays nothing; an active profiler
installs itself as ``recorder``, times each span and reads its ``info`` (the op's tensors, by reference).
"""

from __future__ import annotations

import contextlib

recorder = None   # set by tinyattn.profiler while a profile() block is active
_NULL = contextlib.nullcontext()


def span(name: str, **info):
    """Context manager timing phase ``name`` when a profiler is active.

    ``info`` holds what the profiler needs to count pages and bytes (and, for ``"attention"``, to compare
    the selection with the oracle): the op's tensors and sizes, passed by reference, never copied here.
    """
    if recorder is None:
        return _NULL
    return recorder.span(name, **info)


def layer(index: int):
    """Context manager attributing the spans inside it to model layer ``index`` (no-op without a profiler).

    A model runtime calls it once per layer::

        for li, block in enumerate(self.layers):
            with tinyattn.profiler.layer(li):
                ...
    """
    if recorder is None:
        return _NULL
    return recorder.layer(index)
