"""lm-evaluation-harness (``lm_eval``) on a tinyattn model: the model ``"tinyattn"``.

Importing this module registers ``"tinyattn"`` in lm-eval's model registry: lm-eval's own Hugging Face model
(``HFLM``, ``--model hf``) whose model is opted in with :func:`tinyattn.integrations.hf.enable`, so every
``generate()`` lm-eval makes (``generate_until`` tasks: RULER, GSM8K, ...) decodes through a
:class:`~tinyattn.integrations.hf.TinyAttnCache`; loglikelihood tasks run the model without a cache (plain SDPA,
stock's numbers). The page settings are ``--model_args``; everything else is ``HFLM``'s. From the shell (lm-eval's
own CLI, with ``"tinyattn"`` registered first)::

    python -m tinyattn.integrations.lm_eval run --model tinyattn \\
        --model_args pretrained=PATH,page_size=16,page_budget=16,policy=quest \\
        --tasks niah_single_1 --metadata '{"max_seq_lengths":[2048]}' --limit 20 --device cpu --batch_size 1

or from Python::

    import lm_eval, tinyattn.integrations.lm_eval                      # registers "tinyattn"
    lm_eval.simple_evaluate(model="tinyattn", model_args="pretrained=PATH,page_budget=16", tasks=["niah_single_1"])

``--model_args`` of ``"tinyattn"`` (besides ``HFLM``'s ``pretrained``, ``dtype``, ``batch_size``, ...):

====================  ===========  ===============================================================================
argument              default      meaning (:class:`~tinyattn.integrations.hf.TinyAttnCache`)
====================  ===========  ===============================================================================
``page_size``         16           tokens per page
``page_budget``       ``None``     pages per (row, KV head) at each decode step; ``none`` / ``dense`` = dense
``num_sink_pages``    ``None``     leading pages always kept (``None``: the default recipe)
``num_recent_pages``  1            trailing pages always kept
``dense_layers``      0            leading layers kept dense
``policy``            ``quest``    page-selection policy (``quest``, ``streaming``, ``h2o``, ...)
``kv_cache_dtype``    ``auto``     the pool's storage format (``auto``, ``fp16``, ``bf16``, ``int8``, ``fp8_e4m3``)
``box_dtype``         ``auto``     dtype of the page boxes
``gamma``             ``DEFAULT``  page estimate of ``quest``, in ``[0, 1]``: ``q·c + gamma·|q|·r``, by default
                                   :data:`tinyattn.layer.DEFAULT_GAMMA`; 1 = Quest's bound (issue 35 measured 0.25
                                   best on RULER)
``top_p``             ``None``     adaptive budget of ``quest``, in ``(0, 1]``: the fewest pages whose estimated
                                   attention mass reaches it, ``page_budget`` the capacity; ``none`` = fixed budget
``rerank``            ``None``     ``int4``: the second stage of ``quest`` (candidates re-ranked by their mass estimated
                                   from 4-bit key codes); ``none`` = off
``candidates``        ``1``        the candidates ``rerank`` re-ranks, a multiple of ``page_budget``
``attn_backend``      ``None``     tinyattn's backend (``torch``, ``triton``; ``None``: by device). ``HFLM`` has a
                                   ``backend`` argument of its own (causal / seq2seq)
====================  ===========  ===============================================================================

Needs ``pip install "lm-eval>=0.4.13"`` (and ``wonderwords`` for RULER's synthetic tasks), i.e. the ``eval``
extra of tinyattn. Command, scores and output of a RULER run on SmolLM2-135M: ``docs/lm_eval.md``.
"""

from __future__ import annotations

try:
    from lm_eval.api.registry import register_model
    from lm_eval.models.huggingface import HFLM
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("tinyattn.integrations.lm_eval needs lm-evaluation-harness: pip install -e '.[eval]' "
                      "(lm-eval>=0.4.13 and wonderwords)") from e

from ..layer import DEFAULT_GAMMA
from . import hf

__all__ = ["MODEL_NAME", "TinyAttnLM", "main"]

#: the name ``--model`` takes
MODEL_NAME = "tinyattn"


class TinyAttnLM(HFLM):
    """``HFLM`` with its model opted in to tinyattn (:func:`tinyattn.integrations.hf.enable`).

    Args:
        pretrained: a Hugging Face folder or hub id, or a loaded ``PreTrainedModel`` (``HFLM``'s argument).
        page_size, page_budget, num_sink_pages, num_recent_pages, dense_layers, policy, kv_cache_dtype, box_dtype,
            gamma, top_p, rerank, candidates, attn_backend: the :class:`~tinyattn.integrations.hf.TinyAttnCache` settings (module table);
            ``attn_backend`` is TinyAttnCache's ``backend``.
        **kwargs: ``HFLM``'s (``dtype``, ``device``, ``batch_size``, ``max_length``, ...).

    Raises:
        ValueError (from :func:`~tinyattn.integrations.hf.enable`) for a bad setting, naming it; ``attn_implementation``
        other than ``"tinyattn"`` in ``kwargs``.
    """

    def __init__(self, pretrained, *, page_size: int = 16, page_budget: int | None = None,
                 num_sink_pages: int | None = None, num_recent_pages: int = 1, dense_layers: int = 0,
                 policy: str = "quest", kv_cache_dtype: str = "auto", box_dtype: str = "auto",
                 attn_backend: str | None = None, gamma: float = DEFAULT_GAMMA, top_p: float | None = None,
                 rerank: str | None = None, candidates: float = 1.0, **kwargs):
        impl = kwargs.pop("attn_implementation", hf.ATTN_IMPLEMENTATION)
        if impl != hf.ATTN_IMPLEMENTATION:
            raise ValueError(f"attn_implementation: the tinyattn model runs {hf.ATTN_IMPLEMENTATION!r}, got {impl!r} "
                             f"(use --model hf for another attention)")
        settings = dict(page_size=page_size, page_budget=page_budget, num_sink_pages=num_sink_pages,
                        num_recent_pages=num_recent_pages, dense_layers=dense_layers, policy=policy,
                        kv_cache_dtype=kv_cache_dtype, box_dtype=box_dtype, backend=attn_backend, gamma=gamma,
                        top_p=top_p, rerank=rerank, candidates=candidates)
        settings = {k: _from_arg(v) for k, v in settings.items()}
        if isinstance(pretrained, str):
            kwargs["attn_implementation"] = hf.ATTN_IMPLEMENTATION     # loaded with it: no switch after loading
        super().__init__(pretrained, **kwargs)
        hf.enable(self.model, **settings)
        self.tinyattn_settings = settings


def _from_arg(value):
    """A ``--model_args`` value as lm-eval's command line hands it over (it may leave strings): ``"none"`` /
    ``"None"`` / ``"dense"`` -> ``None``, an integer string -> ``int``, a decimal one (``"0.25"``) -> ``float``,
    anything else unchanged (TinyAttnCache checks it and names it in its ``ValueError`` / ``TypeError``)."""
    if isinstance(value, str):
        text = value.strip()
        if text.lower() in ("none", "dense", ""):
            return None
        if text.lstrip("+-").isdigit():
            return int(text)
        try:
            number = float(text)
        except ValueError:
            return value
        return number if number == number and abs(number) != float("inf") else value
    return value


if __name__ != "__main__":          # run as a script, the module registers on its import by main()
    register_model(MODEL_NAME)(TinyAttnLM)


def main(argv=None) -> None:
    """lm-eval's command line with ``"tinyattn"`` registered (``python -m tinyattn.integrations.lm_eval ...``):
    every argument is lm-eval's (``python -m tinyattn.integrations.lm_eval run --help``)."""
    import sys

    import tinyattn.integrations.lm_eval  # noqa: F401  (registers "tinyattn" when this runs as __main__)
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
