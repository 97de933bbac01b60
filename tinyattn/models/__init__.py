"""Model runtimes built on tinyattn's paged / sparse attention ops.

- :class:`LlamaModel`, :class:`LlamaRuntime`: LLaMA-family model over a paged KV cache, dense prefill,
  query-aware sparse decode (see :mod:`tinyattn.models.llama`).
- :func:`load_llama2c`: llama2.c checkpoints; :class:`Tokenizer`: llama2.c tokenizers.
- :mod:`tinyattn.models.sources`: pretrained sources (``"smollm2"``, a Llama GGUF, a Hugging Face folder) ->
  a cached Hugging Face folder, a :class:`LlamaModel` and an :class:`HFTokenizer`.
- :func:`evaluate`: teacher-forced NLL / perplexity / agreement with dense per page budget.
"""

from .llama import (
    GenerationOutput,
    GenerationStats,
    LlamaConfig,
    LlamaModel,
    LlamaRuntime,
    SparsityConfig,
    apply_rope,
    rope_tables,
)
from .llama2c import load_llama2c, read_llama2c_header
from .tokenizer import Tokenizer
from .hf_tokenizer import HFTokenizer
from .evaluate import EvalResult, evaluate, format_eval_table, load_stories

__all__ = [
    "LlamaConfig",
    "SparsityConfig",
    "LlamaModel",
    "LlamaRuntime",
    "GenerationOutput",
    "GenerationStats",
    "apply_rope",
    "rope_tables",
    "load_llama2c",
    "read_llama2c_header",
    "Tokenizer",
    "HFTokenizer",
    "EvalResult",
    "evaluate",
    "format_eval_table",
    "load_stories",
]
