"""Named spans around each phase of an op, for :mod:`tinyattn.profiler`.

The ops wrap their phases (``"metadata"``, ``"score"``, ``"topk"``, ``"attention"``) in
``span(name, **info)``. With no profiler active this is a shared no-op context (one global read), so
the hot path pays nothing; an active profiler installs itself as ``recorder`` and times each span.
"""

from __future__ import annotations

import contextlib

recorder = None   # set by tinyattn.profiler while a profile() block is active
_NULL = contextlib.nullcontext()


def span(name: str, **info):
    """Context manager timing phase ``name`` when a profiler is active; ``info`` holds sizes (bytes, pages)."""
    if recorder is None:
        return _NULL
    return recorder.span(name, **info)
