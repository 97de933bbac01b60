"""Convert a llama2.c checkpoint (and its tokenizer) into a Hugging Face Llama checkpoint.

::

    python -m tinyattn convert                                   # the shipped stories260K -> out/stories260K-hf
    python -m tinyattn convert --model stories15M.bin --tokenizer tokenizer.bin --out /tmp/stories15M-hf

writes ``DIR/config.json``, ``DIR/model.safetensors`` and ``DIR/generation_config.json`` and, with
``--tokenizer``, ``DIR/tokenizer.json`` + ``DIR/tokenizer_config.json`` (a byte-fallback BPE that encodes
like llama2.c's ``run.c``), so that ``AutoModelForCausalLM.from_pretrained(DIR)`` and
``AutoTokenizer.from_pretrained(DIR)`` work with no network.

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

__all__ = ["permute_rope", "llama2c_to_hf_state_dict", "hf_config_dict", "convert", "write_tokenizer", "check",
           "add_arguments", "run", "main"]


def permute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder the output rows of a q/k projection ``[n_heads * D, dim]`` from interleaved RoPE pairs
    ``(2i, 2i+1)`` to rotate-half pairs ``(i, i + D/2)``, head by head."""
    out_features, in_features = w.shape
    D = out_features // n_heads
    return w.view(n_heads, D // 2, 2, in_features).transpose(1, 2).reshape(out_features, in_features)


def llama2c_to_hf_state_dict(cfg, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """tinyattn/llama2.c parameter names (from :func:`tinyattn.models.load_llama2c`) -> ``LlamaForCausalLM`` names."""
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


def hf_config_dict(cfg) -> dict:
    """``config.json`` of the equivalent ``LlamaForCausalLM`` (fp32, tied embeddings when shared)."""
    return {
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


def convert(model_path: str | os.PathLike, out_dir: str | os.PathLike, tokenizer_path=None, *,
            dtype: torch.dtype = torch.float32) -> Path:
    """Write the Hugging Face checkpoint of a llama2.c ``model_path`` into ``out_dir``; returns ``out_dir``."""
    from safetensors.torch import save_file

    from tinyattn.models import load_llama2c

    cfg, sd = load_llama2c(model_path)
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


def _chmod_like_umask(path: Path) -> None:
    """Give ``path`` the mode a plain ``open(path, "w")`` would have (0666 minus the umask, e.g. 0644)."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


DESCRIPTION = (
    "Convert a llama2.c checkpoint (legacy version-0 .bin, e.g. stories260K.bin) into a Hugging Face "
    "LlamaForCausalLM checkpoint directory: config.json, model.safetensors, generation_config.json and, with "
    "--tokenizer, tokenizer.json + tokenizer_config.json. The q/k projections are permuted from llama2.c's "
    "interleaved RoPE pairs to transformers' rotate-half layout, so the converted model's logits match "
    "tinyattn's runtime. With no --model, converts the stories260K model shipped with tinyattn (and its "
    "tokenizer). Needs the hf extra (transformers, safetensors).")
EPILOG = ("examples:\n"
          "  python -m tinyattn convert --check                      # shipped stories260K -> out/stories260K-hf\n"
          "  python -m tinyattn convert --out /tmp/stories260K-hf --check\n"
          "  python -m tinyattn convert --model stories15M.bin --tokenizer tokenizer.bin --out /tmp/stories15M-hf")


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the converter's options to ``p`` (a parser or a ``convert`` sub-parser of the tinyattn CLI)."""
    p.add_argument("--model", default=None, metavar="PATH",
                   help="llama2.c checkpoint in the legacy format written by llama2.c export.py (7 int32 header "
                        "fields, then fp32 tensors), e.g. stories260K.bin (default: the stories260K model shipped "
                        "with tinyattn)")
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
                        "with tinyattn's llama2.c runtime (same weights, fp32 math); exit with status 1 if they "
                        "differ by more than 1e-4")
    return p


_PROG = "python -m tinyattn.integrations.convert"
_TORCH_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def _parser() -> argparse.ArgumentParser:
    return add_arguments(argparse.ArgumentParser(prog=_PROG, description=DESCRIPTION,
                                                 epilog=EPILOG,
                                                 formatter_class=argparse.RawDescriptionHelpFormatter))


def check(model_path, out_dir, atol: float = 1e-4, dtype: torch.dtype = torch.float32) -> float:
    """Max |logit difference| between the converted model (transformers, SDPA, loaded in fp32) and
    :class:`tinyattn.models.LlamaModel` with the same (``dtype``-rounded) weights, on 33 tokens;
    raises ``AssertionError`` above ``atol``."""
    from transformers import LlamaForCausalLM

    from tinyattn.models import LlamaModel

    ref = LlamaModel.from_llama2c(model_path)
    for param in ref.parameters():             # the weights as saved (rounded to dtype), math in fp32 on both sides
        param.data = param.data.to(dtype).float()
    hf = LlamaForCausalLM.from_pretrained(str(out_dir), attn_implementation="sdpa", dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, ref.config.vocab_size, (1, 33), generator=g)
    tokens[0, 0] = 1
    cache = ref.new_cache(page_size=16, num_pages=4)
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

    if args.model is None and args.tokenizer is None:
        args.tokenizer = str(assets.default_tokenizer_path())
    args.model = str(assets.resolve_file(args.model, "--model", assets.default_model_path))
    if args.tokenizer is not None:
        args.tokenizer = str(assets.resolve_file(args.tokenizer, "--tokenizer"))
    if args.out is None:
        args.out = str(Path("out") / f"{Path(args.model).stem}-hf")
    dtype = getattr(torch, _TORCH_NAMES.get(args.dtype, args.dtype))
    out = convert(args.model, args.out, args.tokenizer, dtype=dtype)
    print(f"wrote {out}/config.json, model.safetensors, generation_config.json"
          + (", tokenizer.json, tokenizer_config.json" if args.tokenizer else ""))
    if args.check:
        try:
            diff = check(args.model, out, dtype=dtype)
        except AssertionError as e:
            print(f"check FAILED: {e}", file=sys.stderr)
            return 1
        print(f"check: max |logit difference| vs tinyattn runtime = {diff:.2e}")
    return 0


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
