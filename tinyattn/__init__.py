"""tinyattn: query-aware sparse paged attention (Quest / TinyServe) as Triton kernels and PyTorch ops.

Public contract: ``docs/api.md`` (it implements the project's design card, ``docs/DESIGN.md``). The kernels live in
``tinyattn.kernels``, the public functions and their PyTorch twins in ``tinyattn.ops``.

Everything ``docs/api.md`` documents is importable from here. The ops are imported eagerly; the cache,
the model runtime, selection policies, training helpers and the subpackages (``tinyattn.models``,
``tinyattn.kernels``, ...) load on first access (PEP 562 ``__getattr__``), so that ``import tinyattn``
stays light: it imports neither triton nor the model code.
"""

import importlib
import os as _os
import sys as _sys

# The command line (``python -m tinyattn ...``, the ``tinyattn`` script) runs this before torch loads: it asks
# OpenMP for idle workers that sleep rather than spin (``OMP_WAIT_POLICY=PASSIVE``, read once when torch loads
# its OpenMP runtime). On a machine where another process holds a core, spinning workers made a decode step of
# the README's snippet 25-30x slower (README "CPU threads"). A library user's process is left as it is; a value
# already set is kept.
if "torch" not in _sys.modules and _sys.argv and (_sys.argv[0] == "-m" or _os.path.basename(_sys.argv[0]) == "tinyattn"):
    _os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from .ops import (encode_key_codes, page_scores, paged_attention, reference, rerank_scores, select_pages,
                  sparse_paged_attention, update_page_metadata, value_checks)
from .ops.plan import PagedAttentionPlan

__version__ = "0.1.0"

# name -> module it lives in (relative to this package), loaded on first access
_LAZY = {
    "PagedAttention": ".layer",
    "PagedKVCache": ".cache",
    "CacheFullError": ".cache",
    "page_grad_norms": ".ops.page_grad",
    "LlamaConfig": ".models",
    "LlamaModel": ".models",
    "LlamaRuntime": ".models",
    "SparsityConfig": ".models",
    "GenerationOutput": ".models",
    "GenerationStats": ".models",
    "Tokenizer": ".models",
    "load_llama2c": ".models",
    "SelectionPolicy": ".selection",
    "SelectionContext": ".selection",
    "SelectionMetrics": ".selection",
    "get_policy": ".selection",
    "ChunkedKVMemory": ".training",
    "Engine": ".engine",
    "SamplingParams": ".engine",
}
_SUBMODULES = ("cache", "engine", "integrations", "kernels", "layer", "metrics", "models", "ops", "profiler", "selection",
               "training")

__all__ = ["paged_attention", "update_page_metadata", "page_scores", "select_pages", "sparse_paged_attention",
           "rerank_scores", "encode_key_codes",
           "reference", "value_checks", "PagedAttentionPlan", "__version__", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module 'tinyattn' has no attribute {name!r}")
    globals()[name] = value          # later accesses skip __getattr__
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULES))
