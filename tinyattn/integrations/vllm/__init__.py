"""vLLM integration: tinyattn as an attention backend of vLLM's v1 engine (opt-in plug-in).

Installed with tinyattn, the plug-in is announced to vLLM through the entry point group
``vllm.general_plugins`` (``pyproject.toml``); vLLM calls :func:`register` in every process it starts.
Nothing changes unless ``TINYATTN_VLLM=1``. Then :func:`register`:

- reads the settings (:func:`settings_from_env`): ``TINYATTN_PAGE_BUDGET`` (pages kept per request and KV
  head at each decode step; unset or 0 = dense), ``TINYATTN_SINK_PAGES`` (default 0),
  ``TINYATTN_RECENT_PAGES`` (default 1), ``TINYATTN_DENSE_LAYERS`` (leading dense layers, default 0),
  ``TINYATTN_GAMMA`` (the page estimate of the quest selection, in ``[0, 1]``, 1 = Quest's bound; default
  :data:`tinyattn.layer.DEFAULT_GAMMA`) and
  ``TINYATTN_TOP_P`` (the adaptive budget, in ``(0, 1]``; unset = the fixed budget), ``TINYATTN_RERANK``
  (``int4``: the quest selection's second stage, which keeps 4-bit key codes beside each layer's cache; unset or
  ``none`` = off) and ``TINYATTN_CANDIDATES`` (its candidates as a multiple of the budget, >= 1; default 1); a bad
  value stops start-up with a ``ValueError`` naming the variable and the allowed values;
- reads ``TINYATTN_VLLM_CUDA_GRAPHS`` (:func:`cuda_graphs_enabled`; ``1`` on, unset / ``0`` off): whether the
  backend declares CUDA-graph support for uniform single-token decode batches to vLLM. Off by default: the
  graph path has never run on a GPU, and a graph replayed over stale metadata would give wrong tokens silently;
- registers :class:`tinyattn.integrations.vllm.backend.TinyAttnBackend` as vLLM's ``CUSTOM`` attention
  backend (``--attention-backend CUSTOM`` on CUDA) and, on vLLM's CPU platform, which always picks its own
  ``CPU_ATTN`` backend, in place of that one;
- logs one INFO line naming tinyattn and its settings.

This module imports neither vLLM nor the backend until :func:`register` runs with ``TINYATTN_VLLM=1``.
See ``docs/vllm.md``.
"""

from __future__ import annotations

import logging
import os

from tinyattn.layer import DEFAULT_GAMMA, format_settings, quest_settings

__all__ = ["register", "settings_from_env", "cuda_graphs_enabled", "ENV_VARS", "BACKEND_PATH"]

BACKEND_PATH = "tinyattn.integrations.vllm.backend.TinyAttnBackend"

#: variable -> (meaning, default); the first four are ints >= 0, the last two numbers in their ranges (None: the
#: library decides, see the meaning)
ENV_VARS = {
    "TINYATTN_PAGE_BUDGET": ("pages kept per request and KV head at each decode step; 0 or unset = dense", 0),
    "TINYATTN_SINK_PAGES": ("leading pages always kept; unset = one when the budget is 16 or more", None),
    "TINYATTN_RECENT_PAGES": ("trailing pages always kept (the page being written always is)", 1),
    "TINYATTN_DENSE_LAYERS": ("leading layers that stay dense", 0),
    "TINYATTN_GAMMA": ("page estimate of the quest selection, a number in [0, 1]: q·c + gamma·|q|·r over each "
                       "page's key box; 1 = Quest's bound", DEFAULT_GAMMA),
    "TINYATTN_TOP_P": ("adaptive budget of the quest selection, a number in (0, 1]: the fewest pages whose estimated "
                       "attention mass reaches it, TINYATTN_PAGE_BUDGET the most; unset = the fixed budget", None),
    "TINYATTN_RERANK": ("second stage of the quest selection: int4 re-ranks the candidates by their attention mass "
                        "estimated from 4-bit key codes; unset or none = off", None),
    "TINYATTN_CANDIDATES": ("candidates TINYATTN_RERANK re-ranks, a multiple of TINYATTN_PAGE_BUDGET, a number >= 1",
                            1.0),
}
_INT_VARS = ("TINYATTN_PAGE_BUDGET", "TINYATTN_SINK_PAGES", "TINYATTN_RECENT_PAGES", "TINYATTN_DENSE_LAYERS")

_logger = logging.getLogger("tinyattn.vllm")
_registered = False


def _int_setting(name: str, environ) -> int:
    meaning, default = ENV_VARS[name]
    raw = environ.get(name, "").strip()
    if raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{name}: expected an integer >= 0 ({meaning}), got {raw!r}")
    return value


def _fraction_setting(name: str, environ, *, open_low: bool):
    """A number in ``[0, 1]`` (``(0, 1]`` with ``open_low``) from the environment, or the default when unset."""
    meaning, default = ENV_VARS[name]
    raw = environ.get(name, "").strip()
    if raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (0.0 < value <= 1.0 if open_low else 0.0 <= value <= 1.0):       # NaN fails both
        bound = "(0, 1]" if open_low else "[0, 1]"
        raise ValueError(f"{name}: expected a number in {bound} ({meaning}), got {raw!r}")
    return value


def settings_from_env(environ=None):
    """The :class:`tinyattn.layer.SparsityConfig` the environment asks for.

    Raises:
        ValueError naming the variable and its allowed values, e.g. ``TINYATTN_PAGE_BUDGET: expected an
        integer >= 0 ...``, ``TINYATTN_TOP_P: expected a number in (0, 1] ...``, a budget too small for the
        always-kept pages (``num_sink_pages + max(num_recent_pages, 1) <= page_budget``), or a setting nothing
        would read (``TINYATTN_TOP_P`` / ``TINYATTN_RERANK`` without ``TINYATTN_PAGE_BUDGET``,
        ``TINYATTN_CANDIDATES`` without ``TINYATTN_RERANK``).
    """
    from tinyattn.layer import SparsityConfig

    environ = os.environ if environ is None else environ
    budget, sinks, recent, dense = (_int_setting(n, environ) for n in _INT_VARS)
    gamma = _fraction_setting("TINYATTN_GAMMA", environ, open_low=False)
    top_p = _fraction_setting("TINYATTN_TOP_P", environ, open_low=True)
    rerank, candidates = _rerank_settings(environ)
    if sinks is None:                   # unset: the library's default recipe (tinyattn.layer)
        from tinyattn.layer import default_num_sink_pages

        sinks = default_num_sink_pages(budget or None, recent)
    # settings nothing would read: a dense run (no budget) ignores top-p and the re-rank, no re-rank its candidates
    unread = [name for name, v in (("TINYATTN_TOP_P", top_p), ("TINYATTN_RERANK", rerank)) if v is not None]
    if unread and not budget:
        _refuse_unread(unread, "TINYATTN_PAGE_BUDGET (the capacity, > 0)")
    if candidates != 1.0 and rerank is None:
        _refuse_unread(["TINYATTN_CANDIDATES"], "TINYATTN_RERANK=int4")
    if budget and sinks + max(recent, 1) > budget:
        raise ValueError(f"TINYATTN_PAGE_BUDGET: expected at least TINYATTN_SINK_PAGES + max(TINYATTN_RECENT_PAGES, 1) "
                         f"= {sinks} + {max(recent, 1)} = {sinks + max(recent, 1)} (the pages always kept), or 0 for "
                         f"dense, got {budget}")
    return SparsityConfig(page_budget=budget or None, num_sink_pages=sinks, num_recent_pages=recent,
                          dense_layers=dense, gamma=gamma, top_p=top_p, rerank=rerank, candidates=candidates)


def _refuse_unread(names: list[str], need: str) -> None:
    raise ValueError(f"{', '.join(names)}: set without {need}, so nothing would read "
                     f"{'it' if len(names) == 1 else 'them'} (a dense run passing for a sparse one)")


def _rerank_settings(environ) -> tuple:
    """``(rerank, candidates)`` from ``TINYATTN_RERANK`` (``int4``; unset / ``none`` = off) and
    ``TINYATTN_CANDIDATES`` (a number >= 1)."""
    raw = environ.get("TINYATTN_RERANK", "").strip().lower()
    if raw not in ("", "none", "int4"):
        raise ValueError(f"TINYATTN_RERANK: expected int4, none or unset ({ENV_VARS['TINYATTN_RERANK'][0]}), got "
                         f"{environ.get('TINYATTN_RERANK')!r}")
    text = environ.get("TINYATTN_CANDIDATES", "").strip()
    try:
        candidates = float(text) if text else ENV_VARS["TINYATTN_CANDIDATES"][1]
    except ValueError:
        candidates = float("nan")
    if not 1.0 <= candidates < float("inf"):
        raise ValueError(f"TINYATTN_CANDIDATES: expected a number >= 1 ({ENV_VARS['TINYATTN_CANDIDATES'][0]}), got "
                         f"{environ.get('TINYATTN_CANDIDATES')!r}")
    return (None if raw in ("", "none") else raw), candidates


def describe(sparsity) -> str:
    if sparsity.page_budget is None:
        return "dense"
    return (f"page_budget={sparsity.page_budget} num_sink_pages={sparsity.num_sink_pages} "
            f"num_recent_pages={sparsity.num_recent_pages} dense_layers={sparsity.dense_layers}"
            + format_settings(quest_settings(sparsity.policy, sparsity.gamma, sparsity.top_p, sparsity.rerank,
                                             sparsity.candidates)).replace(",", ""))


def enabled(environ=None) -> bool:
    """``TINYATTN_VLLM``: ``1`` on, unset / empty / ``0`` off, anything else a ``ValueError``."""
    environ = os.environ if environ is None else environ
    raw = environ.get("TINYATTN_VLLM", "").strip()
    if raw not in ("", "0", "1"):
        raise ValueError(f"TINYATTN_VLLM: expected 1 (use tinyattn) or 0 / unset (vLLM's own backend), got {raw!r}")
    return raw == "1"


def cuda_graphs_enabled(environ=None) -> bool:
    """``TINYATTN_VLLM_CUDA_GRAPHS``: ``1`` declares CUDA-graph support (uniform single-token decode batches),
    unset / empty / ``0`` declares none (vLLM runs attention eagerly), anything else a ``ValueError``."""
    environ = os.environ if environ is None else environ
    raw = environ.get("TINYATTN_VLLM_CUDA_GRAPHS", "").strip()
    if raw not in ("", "0", "1"):
        raise ValueError(f"TINYATTN_VLLM_CUDA_GRAPHS: expected 1 (declare CUDA-graph support for uniform decode "
                         f"batches; opt-in, not yet run on a GPU) or 0 / unset (no CUDA graphs for attention), "
                         f"got {raw!r}")
    return raw == "1"


def register() -> bool:
    """vLLM's ``vllm.general_plugins`` entry point; returns whether tinyattn was registered."""
    global _registered
    if not enabled():
        return False
    sparsity = settings_from_env()
    graphs = cuda_graphs_enabled()
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)
    on_cpu = current_platform.is_cpu()
    if on_cpu:                        # the CPU platform always returns CPU_ATTN's path: take that one over
        register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)
    if not _registered:
        from vllm.logger import init_logger

        init_logger("vllm.tinyattn").info(
            "tinyattn %s attention backend registered (%s; %s%s)", _version(),
            "replaces CPU_ATTN" if on_cpu else "select it with --attention-backend CUSTOM", describe(sparsity),
            "; CUDA graphs for uniform decode declared (TINYATTN_VLLM_CUDA_GRAPHS=1, opt-in)" if graphs else "")
    _registered = True
    return True


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("tinyattn")
    except Exception:  # pragma: no cover
        return ""
