"""Convert a llama2.c checkpoint (and its tokenizer), or a tinyattn model, into a Hugging Face checkpoint.

::

    python -m tinyattn convert                                   # the shipped stories260K -> out/stories260K-hf
    python -m tinyattn convert --model stories15M.bin --tokenizer tokenizer.bin --out /tmp/stories15M-hf

writes ``DIR/config.json``, ``DIR/model.safetensors`` and ``DIR/generation_config.json`` and, with
``--tokenizer``, ``DIR/tokenizer.json`` + ``DIR/tokenizer_config.json`` (a byte-fallback BPE that encodes
like llama2.c's ``run.c``), so that ``AutoModelForCausalLM.from_pretrained(DIR)`` and
``AutoTokenizer.from_pretrained(DIR)`` work with no network.

Model class. A plain LLaMA (every layer full attention with RoPE) becomes ``LlamaForCausalLM``. A hybrid
:class:`~tinyattn.models.LlamaConfig` (``"sliding_attention"`` layers and / or ``nope_layers``) becomes
``SmolLM3ForCausalLM``: the same LLaMA blocks and weight names, plus exactly our per-layer options
(``layer_types`` with ``sliding_window`` and ``use_sliding_window``; ``no_rope_layers``, 1 = the layer uses RoPE)
and nothing else, and vLLM runs it too (through its Transformers backend). Mistral / Qwen2 / Qwen3 slide in every
layer or lack NoPE, and Gemma adds norms and scalings of its own, so none of them represents such a model.
:func:`llama_config_from_hf` and :func:`hf_to_llama2c_state_dict` read a converted checkpoint back
(:func:`load_hf`).

RoPE layout. llama2.c (like Meta's original LLaMA code) rotates the interleaved channel pairs
``(2i, 2i+1)`` of each head; ``transformers`` rotates the halves ``(i, i + D/2)`` ("rotate_half").
The two agree once the output rows of ``wq`` and ``wk`` are permuted inside each head so that channel
``2i`` goes to ``i`` and ``2i+1`` to ``i + D/2`` (the permutation of ``convert_llama_weights_to_hf.py``).
The permutation is the same for queries and keys, so every ``q.k`` — and therefore every logit — is
unchanged; the keys in the cache are stored in the permuted channel order, and Quest's per-channel
page bounds (min/max per channel) are simply permuted with them, so page scores are unchanged too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

__all__ = ["permute_rope", "unpermute_rope", "llama2c_to_hf_state_dict", "hf_to_llama2c_state_dict",
           "hf_config_dict", "llama_config_from_hf", "is_hybrid", "convert", "convert_retrieval", "save_pretrained",
           "load_hf", "write_tokenizer", "write_char_tokenizer", "check", "add_arguments", "run", "main"]

#: ``--check``'s limit on max |logit difference| between the converted model and the runtime (fp32 math)
CHECK_ATOL = 1e-4


def permute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder the output rows of a q/k projection ``[n_heads * D, dim]`` from interleaved RoPE pairs
    ``(2i, 2i+1)`` to rotate-half pairs ``(i, i + D/2)``, head by head."""
    out_features, in_features = w.shape
    D = out_features // n_heads
    return w.view(n_heads, D // 2, 2, in_features).transpose(1, 2).reshape(out_features, in_features)


def unpermute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of :func:`permute_rope`: rotate-half rows ``(i, i + D/2)`` back to interleaved pairs."""
    out_features, in_features = w.shape
    D = out_features // n_heads
    return w.view(n_heads, 2, D // 2, in_features).transpose(1, 2).reshape(out_features, in_features)


def llama2c_to_hf_state_dict(cfg, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """tinyattn/llama2.c parameter names (from :func:`tinyattn.models.load_llama2c` or a
    :class:`~tinyattn.models.LlamaModel`'s ``state_dict()``) -> ``LlamaForCausalLM`` / ``SmolLM3ForCausalLM``
    names, with q/k rows permuted to rotate-half (:func:`permute_rope`).

    NoPE layers are permuted too: the same permutation of q and k leaves every ``q.k`` unchanged, and one rule for
    every layer keeps the reverse (:func:`hf_to_llama2c_state_dict`) free of per-layer cases."""
    out = {"model.embed_tokens.weight": sd["tok_embeddings.weight"], "model.norm.weight": sd["norm.weight"]}
    for i in range(cfg.n_layers):
        p, q = f"layers.{i}.", f"model.layers.{i}."
        out[q + "self_attn.q_proj.weight"] = permute_rope(sd[p + "wq.weight"], cfg.n_heads)
        out[q + "self_attn.k_proj.weight"] = permute_rope(sd[p + "wk.weight"], cfg.n_kv_heads)
        out[q + "self_attn.v_proj.weight"] = sd[p + "wv.weight"]
        out[q + "self_attn.o_proj.weight"] = sd[p + "wo.weight"]
        out[q + "mlp.gate_proj.weight"] = sd[p + "w1.weight"]
        out[q + "mlp.down_proj.weight"] = sd[p + "w2.weight"]
        out[q + "mlp.up_proj.weight"] = sd[p + "w3.weight"]
        out[q + "input_layernorm.weight"] = sd[p + "attention_norm.weight"]
        out[q + "post_attention_layernorm.weight"] = sd[p + "ffn_norm.weight"]
    if not cfg.shared_classifier:
        out["lm_head.weight"] = sd["output.weight"]
    return {k: v.contiguous().clone() for k, v in out.items()}


_HF_TO_LLAMA2C = {"self_attn.v_proj": "wv", "self_attn.o_proj": "wo", "mlp.gate_proj": "w1", "mlp.down_proj": "w2",
                  "mlp.up_proj": "w3", "input_layernorm": "attention_norm", "post_attention_layernorm": "ffn_norm"}


def hf_to_llama2c_state_dict(cfg, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`llama2c_to_hf_state_dict`: ``LlamaForCausalLM`` / ``SmolLM3ForCausalLM`` names ->
    :class:`~tinyattn.models.LlamaModel` names (``output.weight`` is the embedding when the classifier is shared).

    Raises:
        KeyError naming the first missing Hugging Face parameter.
    """
    out = {"tok_embeddings.weight": sd["model.embed_tokens.weight"], "norm.weight": sd["model.norm.weight"]}
    for i in range(cfg.n_layers):
        p, q = f"layers.{i}.", f"model.layers.{i}."
        out[p + "wq.weight"] = unpermute_rope(sd[q + "self_attn.q_proj.weight"], cfg.n_heads)
        out[p + "wk.weight"] = unpermute_rope(sd[q + "self_attn.k_proj.weight"], cfg.n_kv_heads)
        for hf_name, name in _HF_TO_LLAMA2C.items():
            out[p + name + ".weight"] = sd[q + hf_name + ".weight"]
    out["output.weight"] = out["tok_embeddings.weight"] if cfg.shared_classifier else sd["lm_head.weight"]
    return {k: v.contiguous().clone() for k, v in out.items()}


def is_hybrid(cfg) -> bool:
    """Whether a :class:`~tinyattn.models.LlamaConfig` has per-layer options (sliding-window or NoPE layers), and
    so converts to ``SmolLM3ForCausalLM`` rather than ``LlamaForCausalLM``."""
    return bool(cfg.nope_layers) or any(cfg.is_sliding(i) for i in range(cfg.n_layers))


def hf_config_dict(cfg) -> dict:
    """``config.json`` of the equivalent Hugging Face model (fp32, tied embeddings when shared):
    ``LlamaForCausalLM`` for a plain config, ``SmolLM3ForCausalLM`` for a hybrid one (:func:`is_hybrid`)."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.hidden_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": bool(cfg.shared_classifier),
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": None,
        "initializer_range": 0.02,
        "torch_dtype": "float32",
        "dtype": "float32",
        "use_cache": True,
    }
    if is_hybrid(cfg):
        config.update(_smollm3_fields(cfg))
    return config


def _smollm3_fields(cfg) -> dict:
    """SmolLM3's per-layer fields. ``use_sliding_window`` must be true for its attention modules to pass their
    window on (its mask builder reads ``layer_types`` alone); ``no_rope_layers`` is explicit, so its default
    (a NoPE layer every ``no_rope_layer_interval`` layers) never applies."""
    slides = any(cfg.is_sliding(i) for i in range(cfg.n_layers))
    return {
        "architectures": ["SmolLM3ForCausalLM"],
        "model_type": "smollm3",
        "layer_types": ["sliding_attention" if cfg.is_sliding(i) else "full_attention" for i in range(cfg.n_layers)],
        "use_sliding_window": slides,
        "sliding_window": cfg.sliding_window,
        "no_rope_layers": [int(cfg.uses_rope(i)) for i in range(cfg.n_layers)],
        "no_rope_layer_interval": 4,
    }


def llama_config_from_hf(config):
    """The :class:`~tinyattn.models.LlamaConfig` of a Hugging Face config (a ``PretrainedConfig`` or its
    ``config.json`` as a dict) of model type ``"llama"`` or ``"smollm3"``: the inverse of :func:`hf_config_dict`.

    Raises:
        ValueError for another model type, a RoPE type other than ``"default"``, attention or MLP biases, an
        activation other than SiLU, or a head_dim other than hidden_size / num_attention_heads (what the runtime
        does not model).
    """
    from transformers import AutoConfig

    from tinyattn.models import LlamaConfig

    kind = config.get("model_type") if isinstance(config, dict) else getattr(config, "model_type", None)
    if kind not in ("llama", "smollm3"):
        raise ValueError(f"config: expected model_type 'llama' or 'smollm3', got {kind!r}")
    if isinstance(config, dict):          # through transformers, so that its defaults fill what the file omits
        config = AutoConfig.for_model(**config)
    c = config.to_dict()
    rope = c.get("rope_parameters") or {"rope_type": "default", "rope_theta": c.get("rope_theta", 10000.0)}
    for name, value, want in (("rope_parameters.rope_type", rope.get("rope_type"), "default"),
                              ("attention_bias", c.get("attention_bias", False), False),
                              ("mlp_bias", c.get("mlp_bias", False), False),
                              ("hidden_act", c.get("hidden_act", "silu"), "silu")):
        if value != want:
            raise ValueError(f"config: {name} must be {want!r} for tinyattn's LLaMA runtime, got {value!r}")
    dim, n_heads = c["hidden_size"], c["num_attention_heads"]
    if c.get("head_dim") not in (None, dim // n_heads):
        raise ValueError(f"config: head_dim must be hidden_size / num_attention_heads = {dim // n_heads}, "
                         f"got {c['head_dim']}")
    layers = c["num_hidden_layers"]
    # layer_types decides, as in transformers' masks (eager / SDPA) and vLLM; SmolLM3's use_sliding_window only
    # reaches its flash-attention path
    layer_types = tuple(c.get("layer_types") or ()) or None
    if layer_types is not None and "sliding_attention" not in layer_types:
        layer_types = None
    nope = tuple(i for i, flag in enumerate(c.get("no_rope_layers") or [1] * layers) if not flag and i < layers)
    return LlamaConfig(dim=dim, hidden_dim=c["intermediate_size"], n_layers=layers, n_heads=n_heads,
                       n_kv_heads=c.get("num_key_value_heads") or n_heads, vocab_size=c["vocab_size"],
                       max_seq_len=c.get("max_position_embeddings", 2048), norm_eps=c.get("rms_norm_eps", 1e-5),
                       rope_theta=float(rope.get("rope_theta", 10000.0)),
                       shared_classifier=bool(c.get("tie_word_embeddings", False)), layer_types=layer_types,
                       sliding_window=c.get("sliding_window") if layer_types else None, nope_layers=nope)


def write_tokenizer(tokenizer_path: str | os.PathLike, out_dir: str | os.PathLike, model_max_length: int) -> None:
    """Write ``tokenizer.json`` + ``tokenizer_config.json``: a byte-fallback BPE equivalent to llama2.c's.

    llama2.c stores SentencePiece pieces with ``▁`` turned into a space and each merge's score (``-rank``).
    The ``tokenizers`` BPE gets the pieces back with ``▁``, and one merge per way of splitting a merged
    piece into two pieces of the vocabulary, ranked by the merged piece's score (the SentencePiece-BPE
    rule: merge the adjacent pair whose result scores highest). Needs the ``tokenizers`` package (a
    dependency of ``transformers``).
    """
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers, processors
    from transformers import PreTrainedTokenizerFast

    from tinyattn.models.tokenizer import Tokenizer

    tok = Tokenizer(tokenizer_path)
    specials = {0: "<unk>", 1: "<s>", 2: "</s>"}
    pieces, scores = [], []
    for i in range(tok.vocab_size):
        if i in specials:
            pieces.append(specials[i])
        else:
            pieces.append(tok.pieces[i].decode("utf-8", errors="replace").replace(" ", "\u2581"))
        scores.append(tok.scores[i])
    vocab = {p: i for i, p in enumerate(pieces)}
    merges = []
    for i, piece in enumerate(pieces):
        if i < 259 or len(piece) < 2:          # specials and byte tokens are never produced by a merge
            continue
        for cut in range(1, len(piece)):
            a, b = piece[:cut], piece[cut:]
            if a in vocab and b in vocab and vocab[a] >= 3 and vocab[b] >= 3:
                merges.append((scores[i], -i, vocab[a], vocab[b], a, b))
    merges.sort(key=lambda m: (-m[0], m[2], m[3]))
    bpe = models.BPE(vocab=vocab, merges=[(m[4], m[5]) for m in merges], unk_token="<unk>", fuse_unk=True,
                     byte_fallback=True)
    hf_tok = HFTokenizer(bpe)
    hf_tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    hf_tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                        decoders.Strip(" ", 1, 0)])
    hf_tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                          special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=hf_tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<unk>", model_max_length=model_max_length, padding_side="left",
                                   add_bos_token=True)
    fast.save_pretrained(str(out_dir))


def write_char_tokenizer(out_dir: str | os.PathLike, model_max_length: int) -> None:
    """Write ``tokenizer.json`` + ``tokenizer_config.json``: :class:`tinyattn.retrieval.CharTokenizer` (one id per
    character, ``<unk>`` / ``<s>`` / ``</s>`` = 0 / 1 / 2, BOS added, characters outside the vocabulary -> ``<unk>``)
    as a ``tokenizers`` BPE with no merges, left padding with ``<unk>``. Literal ``"<s>"`` in a text is encoded
    character by character, as the CharTokenizer does (``split_special_tokens``)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    from tinyattn.retrieval.tokenizer import CharTokenizer

    chars = CharTokenizer.CHARS
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{ch: i + 3 for i, ch in enumerate(chars)}}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()                        # characters join with nothing between them
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<unk>", model_max_length=model_max_length, padding_side="left",
                                   split_special_tokens=True)
    fast.save_pretrained(str(out_dir))


def _retrieval_checkpoint(path) -> bool:
    """Whether ``path`` is a directory written by :func:`tinyattn.retrieval.save_retrieval_model`."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    try:
        return json.loads(config.read_text()).get("format") == "tinyattn-retrieval"
    except (ValueError, AttributeError):
        return False


def convert_retrieval(path: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: torch.dtype = torch.float32
                      ) -> Path:
    """Write a tinyattn retrieval checkpoint (a directory from :func:`tinyattn.retrieval.save_retrieval_model`: its
    config holds the per-layer options) as a Hugging Face checkpoint with its character tokenizer
    (:func:`write_char_tokenizer`); returns ``out_dir``. Raises the loader's ``ValueError`` / ``FileNotFoundError``
    for a directory that is not one."""
    from tinyattn.retrieval.model import load_retrieval_model

    model, _ = load_retrieval_model(path)
    out = save_pretrained(model, out_dir, dtype=dtype)
    write_char_tokenizer(out, model.config.max_seq_len)
    return out


def _reference_weights(model_path) -> dict[str, torch.Tensor]:
    """The tinyattn state dict of a llama2.c file or a retrieval checkpoint directory (what :func:`check` reads)."""
    if _retrieval_checkpoint(model_path):
        from tinyattn.retrieval.model import load_retrieval_model

        return load_retrieval_model(model_path)[0].state_dict()
    from tinyattn.models import load_llama2c

    return load_llama2c(model_path)[1]


def convert(model_path: str | os.PathLike, out_dir: str | os.PathLike, tokenizer_path=None, *,
            dtype: torch.dtype = torch.float32, layer_types=None, sliding_window: int | None = None,
            nope_layers=()) -> Path:
    """Write the Hugging Face checkpoint of a llama2.c ``model_path`` into ``out_dir``; returns ``out_dir``.

    A llama2.c header holds no per-layer options: ``layer_types`` / ``sliding_window`` / ``nope_layers`` (as in
    :class:`~tinyattn.models.LlamaConfig`) say how a hybrid model stored in that format was trained, and make the
    result a ``SmolLM3ForCausalLM``. Raises ``ValueError`` for options the config rejects (naming them).
    """
    import dataclasses

    from tinyattn.models import load_llama2c

    cfg, sd = load_llama2c(model_path)
    cfg = dataclasses.replace(cfg, layer_types=layer_types, sliding_window=sliding_window,
                              nope_layers=tuple(nope_layers))
    return _write(cfg, sd, out_dir, tokenizer_path, dtype)


def save_pretrained(model, out_dir: str | os.PathLike, tokenizer_path=None, *, dtype: torch.dtype | None = None
                    ) -> Path:
    """Write a :class:`~tinyattn.models.LlamaModel` (e.g. one trained with tinyattn, hybrid or not) as a Hugging
    Face checkpoint into ``out_dir``; returns ``out_dir``.

    Args:
        model: the model; its ``config`` picks the class (:func:`hf_config_dict`).
        tokenizer_path: a llama2.c tokenizer file to write beside it (:func:`write_tokenizer`), or ``None``.
        dtype: dtype of the saved weights (default: the model's).
    """
    sd = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    return _write(model.config, sd, out_dir, tokenizer_path, dtype or model.dtype)


def _write(cfg, sd, out_dir, tokenizer_path, dtype: torch.dtype) -> Path:
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.to(dtype) for k, v in llama2c_to_hf_state_dict(cfg, sd).items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    _chmod_like_umask(out / "model.safetensors")   # safetensors creates it 0600; the other files follow the umask
    config = hf_config_dict(cfg)
    config["torch_dtype"] = config["dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    if tokenizer_path is not None:
        write_tokenizer(tokenizer_path, out, cfg.max_seq_len)
    return out


def load_hf(path: str | os.PathLike):
    """Read a Hugging Face ``llama`` / ``smollm3`` checkpoint directory (``config.json`` + ``model.safetensors``)
    back into ``(LlamaConfig, state_dict)`` with :class:`~tinyattn.models.LlamaModel`'s names, fp32: the inverse
    of :func:`convert` / :func:`save_pretrained` (``LlamaModel(cfg).load_state_dict(sd)``).

    Raises:
        ValueError for a config tinyattn's runtime does not model (:func:`llama_config_from_hf`); OSError for
        missing files.
    """
    from safetensors.torch import load_file

    path = Path(path)
    cfg = llama_config_from_hf(json.loads((path / "config.json").read_text()))
    sd = {k: v.float() for k, v in load_file(str(path / "model.safetensors")).items()}
    return cfg, hf_to_llama2c_state_dict(cfg, sd)


def _chmod_like_umask(path: Path) -> None:
    """Give ``path`` the mode a plain ``open(path, "w")`` would have (0666 minus the umask, e.g. 0644)."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


DESCRIPTION = (
    "Convert a llama2.c checkpoint (legacy version-0 .bin, e.g. stories260K.bin) into a Hugging Face "
    "checkpoint directory (LlamaForCausalLM; SmolLM3ForCausalLM with --layer-types / --nope-layers): config.json, model.safetensors, generation_config.json and, with "
    "--tokenizer, tokenizer.json + tokenizer_config.json. The q/k projections are permuted from llama2.c's "
    "interleaved RoPE pairs to transformers' rotate-half layout, so the converted model's logits match "
    "tinyattn's runtime. With no --model, converts the stories260K model shipped with tinyattn (and its "
    "tokenizer). Needs the hf extra (transformers, safetensors).")
EPILOG = ("examples:\n"
          "  python -m tinyattn convert --check                      # shipped stories260K -> out/stories260K-hf\n"
          "  python -m tinyattn convert --out /tmp/stories260K-hf --check\n"
          "  python -m tinyattn convert --model stories15M.bin --tokenizer tokenizer.bin --out /tmp/stories15M-hf\n"
          "      (llama2.c's TinyStories model and tokenizer: huggingface.co/karpathy/tinyllamas, "
          "github.com/karpathy/llama2.c)\n"
          "  python -m tinyattn convert --model hybrid.bin --out /tmp/hybrid-hf --nope-layers 2 --sliding-window 64 \\\n"
          "      --layer-types sliding_attention,sliding_attention,full_attention,sliding_attention")


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the converter's options to ``p`` (a parser or a ``convert`` sub-parser of the tinyattn CLI)."""
    p.add_argument("--model", default=None, metavar="PATH",
                   help="llama2.c checkpoint in the legacy format written by llama2.c export.py (7 int32 header "
                        "fields, then fp32 tensors), e.g. stories260K.bin, or a tinyattn retrieval checkpoint "
                        "directory (config.json + model.safetensors from train-retrieval: its per-layer options "
                        "and character tokenizer come along) (default: the stories260K model shipped with "
                        "tinyattn)")
    p.add_argument("--tokenizer", metavar="PATH", default=None,
                   help="llama2.c tokenizer file (tokenizer.bin / tok512.bin). When given, a Hugging Face "
                        "tokenizer that encodes and decodes like llama2.c (left padding) is written next to the "
                        "model; without it only the model is written (default: the shipped tok512.bin when "
                        "--model is omitted too)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="output directory (created if missing; files in it with the same names are overwritten; "
                        "default: out/<model name>-hf under the current directory, git-ignored in a checkout)")
    p.add_argument("--dtype", choices=["fp32", "fp16", "bf16", "float32", "float16", "bfloat16"], default="fp32",
                   help="dtype of the saved weights, spelled as in generate/eval (fp32, fp16, bf16) or as torch "
                        "does (default: fp32, the checkpoint's own precision)")
    p.add_argument("--check", action="store_true",
                   help="after writing, load the result with transformers and compare its logits on 33 tokens "
                        "(2 x --sliding-window + 1 if more, within the context length) with tinyattn's runtime "
                        "(same weights and per-layer options, fp32 math); exit with status 1 if they differ by more "
                        f"than {CHECK_ATOL:g}")
    p.add_argument("--layer-types", type=_name_list, default=None, metavar="T,T,...",
                   help="per-layer attention of a hybrid model stored in the llama2.c format (its header has no "
                        "such field): one of full_attention, sliding_attention per layer, comma-separated "
                        "(Hugging Face's layer_types); sliding layers need --sliding-window (default: every layer "
                        "full attention)")
    p.add_argument("--sliding-window", type=int, default=None, metavar="TOKENS",
                   help="window of the sliding_attention layers in tokens, the query itself included (query i "
                        "sees keys j with i - W < j <= i, Mistral's and Hugging Face's convention)")
    p.add_argument("--nope-layers", type=_index_list, default=(), metavar="I,I,...",
                   help="comma-separated indices of layers without rotary embedding (NoPE, as in SmolLM3; "
                        "default: none). Any per-layer option makes the result a SmolLM3ForCausalLM")
    return p


def _name_list(text: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in text.split(",") if t.strip())


def _index_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer indices, got {text!r}") from None


_PROG = "python -m tinyattn.integrations.convert"
_TORCH_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def _parser() -> argparse.ArgumentParser:
    return add_arguments(argparse.ArgumentParser(prog=_PROG, description=DESCRIPTION,
                                                 epilog=EPILOG,
                                                 formatter_class=argparse.RawDescriptionHelpFormatter))


def check(model_path, out_dir, atol: float = CHECK_ATOL, dtype: torch.dtype = torch.float32) -> float:
    """Max |logit difference| between the converted model in ``out_dir`` (transformers, SDPA, loaded in fp32) and
    :class:`tinyattn.models.LlamaModel` with the weights of ``model_path`` (a llama2.c file or a retrieval
    checkpoint directory, rounded to ``dtype``) and the
    converted config (its per-layer options included), on ``max(33, 2 * sliding_window + 1)`` tokens (capped by
    the context length) so that a window is crossed; raises ``AssertionError`` above ``atol``."""
    from transformers import AutoModelForCausalLM

    from tinyattn.models import LlamaModel

    cfg = llama_config_from_hf(json.loads((Path(out_dir) / "config.json").read_text()))
    ref = LlamaModel(cfg)
    ref.load_state_dict(_reference_weights(model_path), strict=True)
    ref.eval().requires_grad_(False)
    for param in ref.parameters():             # the weights as saved (rounded to dtype), math in fp32 on both sides
        param.data = param.data.to(dtype).float()
    hf = AutoModelForCausalLM.from_pretrained(str(out_dir), attn_implementation="sdpa", dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    T = min(cfg.max_seq_len, max(33, 2 * (cfg.sliding_window or 0) + 1))
    tokens = torch.randint(3, cfg.vocab_size, (1, T), generator=g)
    tokens[0, 0] = 1
    cache = ref.new_cache(page_size=16, num_pages=-(-T // 16) + 1)
    seq = cache.add_sequence()
    with torch.no_grad():
        want = ref(tokens, cache, [seq], backend="torch")
        got = hf(tokens).logits.float()
    diff = (want - got).abs().max().item()
    if not diff <= atol:
        raise AssertionError(f"converted logits differ from tinyattn's runtime by {diff:.3g} > {atol:g}")
    return diff


def run(args: argparse.Namespace) -> int:
    """Run a conversion from parsed arguments (see :func:`add_arguments`); returns the exit status."""
    import importlib.util

    missing = [m for m in ("safetensors", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"convert needs the hf extra (missing: {', '.join(missing)}); "
                         f"install it with: pip install -e '.[hf]'")
    from tinyattn import assets

    dtype = getattr(torch, _TORCH_NAMES.get(args.dtype, args.dtype))
    retrieval = args.model is not None and Path(args.model).is_dir()
    if retrieval:
        out = _run_retrieval(args, dtype)
    else:
        if args.model is None and args.tokenizer is None:
            args.tokenizer = str(assets.default_tokenizer_path())
        args.model = str(assets.resolve_file(args.model, "--model", assets.default_model_path))
        if args.tokenizer is not None:
            args.tokenizer = str(assets.resolve_file(args.tokenizer, "--tokenizer"))
        if args.out is None:
            args.out = str(Path("out") / f"{Path(args.model).stem}-hf")
        out = convert(args.model, args.out, args.tokenizer, dtype=dtype, layer_types=args.layer_types,
                      sliding_window=args.sliding_window, nope_layers=args.nope_layers)
    print(f"wrote {out}/config.json, model.safetensors, generation_config.json"
          + (", tokenizer.json, tokenizer_config.json" if args.tokenizer or retrieval else ""))
    if args.check:
        try:
            diff = check(args.model, out, dtype=dtype)
        except AssertionError as e:
            print(f"check FAILED: {e}", file=sys.stderr)
            return 1
        print(f"check passed: max |logit difference| vs tinyattn runtime = {diff:.2e} (limit {CHECK_ATOL:g})")
    return 0


def _run_retrieval(args: argparse.Namespace, dtype: torch.dtype) -> Path:
    """``--model DIR``: a retrieval checkpoint, whose config already holds the per-layer options and whose
    tokenizer is the character tokenizer."""
    if not _retrieval_checkpoint(args.model):
        raise ValueError(f"--model: {args.model!r} is a directory but not a tinyattn retrieval checkpoint "
                         f"(config.json with format 'tinyattn-retrieval' + model.safetensors); pass a llama2.c "
                         f".bin file or such a directory")
    given = [flag for flag, value in (("--tokenizer", args.tokenizer), ("--layer-types", args.layer_types),
                                      ("--sliding-window", args.sliding_window), ("--nope-layers", args.nope_layers))
             if value]
    if given:
        raise ValueError(f"{given[0]}: not used with a retrieval checkpoint (its config.json holds the per-layer "
                         f"options, and its tokenizer is the character tokenizer)")
    if args.out is None:
        args.out = str(Path("out") / f"{Path(args.model).resolve().name}-hf")
    return convert_retrieval(args.model, args.out, dtype=dtype)


def main(argv=None) -> int:
    """``python -m tinyattn.integrations.convert ...`` (and ``python -m tinyattn convert ...``)."""
    args = _parser().parse_args(argv)
    try:
        return run(args)
    except (ValueError, OSError) as exc:
        print(f"{_PROG}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
