"""Adapters that put tinyattn inside other ecosystems.

- :mod:`tinyattn.integrations.hf`: Hugging Face ``transformers``. Importing it registers the attention
  implementation ``"tinyattn"`` and provides :class:`~tinyattn.integrations.hf.TinyAttnCache` and
  :func:`~tinyattn.integrations.hf.enable` (every ``generate()`` of a model gets a TinyAttnCache)
  (needs the ``hf`` extra: ``pip install -e ".[hf]"``).
- :mod:`tinyattn.integrations.lm_eval`: lm-evaluation-harness; importing it registers the model ``"tinyattn"``
  (``python -m tinyattn.integrations.lm_eval run --model tinyattn ...``; the ``eval`` extra, ``docs/lm_eval.md``).
- :mod:`tinyattn.integrations.vllm`: an attention backend for vLLM's v1 engine, registered through vLLM's
  ``vllm.general_plugins`` entry point and active only with ``TINYATTN_VLLM=1`` (``docs/vllm.md``).
- :mod:`tinyattn.integrations.convert`: llama2.c checkpoint or tinyattn model -> Hugging Face checkpoint
  (``LlamaForCausalLM``; ``SmolLM3ForCausalLM`` for hybrid sliding-window / NoPE models), and back
  (``python -m tinyattn.integrations.convert --help``).

Nothing is imported here, so ``import tinyattn.integrations`` never needs ``transformers``, ``vllm`` or
``lm_eval``.
"""
