"""Perplexity of a Hugging Face causal LM on real text: stock attention vs tinyattn sparse decode.

Protocol (the same as :func:`tinyattn.models.evaluate`): each story is ``BOS + tokens`` truncated to
``--max-context``. The stock row is one teacher-forced forward pass per story with the model's stock
attention (SDPA). Each tinyattn row feeds the stories **one token per step through the decode path**
(``attn_implementation="tinyattn"`` + :class:`~tinyattn.integrations.hf.TinyAttnCache`), all stories
in one batch, so every prediction after the first pages was made with query-aware sparse attention.
Reported: mean NLL (nats / target token), perplexity, top-1 agreement with stock, and the fraction of
KV pages read per decode step relative to dense (sparse layers read ``min(pages, budget)``).

Example (converts the stories260K model shipped with tinyattn first when --model-dir does not exist; the
text defaults to the 7 TinyStories validation stories shipped with it)::

    python bench/hf_perplexity.py --model-dir /tmp/stories260K-hf --page-size 16 --page-budgets 2,4,8
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:           # run as `python bench/hf_perplexity.py` from a checkout without installing
    sys.path.insert(0, str(ROOT))

from tinyattn.argtypes import non_negative_int, positive_int, positive_int_list  # noqa: E402


def load_texts(path: Path) -> list[str]:
    from tinyattn.models import load_stories

    return load_stories(path)


@torch.no_grad()
def stock_logprobs(model, seqs: list[list[int]]) -> list[torch.Tensor]:
    """Teacher-forced log-probs ``[len-1, V]`` per story with the model's stock attention."""
    out = []
    for s in seqs:
        logits = model(torch.tensor([s]), use_cache=False).logits[0, :-1].float()
        out.append(torch.log_softmax(logits, dim=-1))
    return out


@torch.no_grad()
def decode_logprobs(model, seqs: list[list[int]], **cache_options) -> list[torch.Tensor]:
    """Log-probs ``[len-1, V]`` per story, every prediction made by one decode step through tinyattn."""
    from tinyattn.integrations.hf import TinyAttnCache

    B, T = len(seqs), max(len(s) for s in seqs)
    tokens = torch.zeros(B, T, dtype=torch.long)                # rows past their end feed token 0 (ignored)
    for b, s in enumerate(seqs):
        tokens[b, :len(s)] = torch.tensor(s)
    cache = TinyAttnCache(model.config, **cache_options)
    steps = []
    for t in range(T - 1):
        logits = model(tokens[:, t:t + 1], cache=cache, use_cache=True).logits[:, -1].float()
        steps.append(torch.log_softmax(logits, dim=-1))
    per_step = torch.stack(steps, dim=1)                        # [B, T-1, V]
    return [per_step[b, :len(s) - 1] for b, s in enumerate(seqs)]


def pages_read_fraction(seqs, page_size, page_budget, num_layers, dense_layers) -> float:
    """Pages attended per decode step over all layers, relative to dense (bounds not counted;
    :func:`tinyattn.metrics.pages_read`)."""
    from tinyattn.metrics import pages_read

    read = dense = 0
    for s in seqs:
        for n in range(1, len(s)):                              # the step that predicts s[n] sees n tokens
            pages = pages_read(n, page_size)
            sparse = pages_read(n, page_size, page_budget)
            read += dense_layers * pages + (num_layers - dense_layers) * sparse
            dense += num_layers * pages
    return read / dense


def summarize(logp: list[torch.Tensor], seqs, ref: list[torch.Tensor]):
    nll = agree = n = 0
    for lp, s, r in zip(logp, seqs, ref):
        targets = torch.tensor(s[1:])
        nll -= float(lp.gather(-1, targets[:, None]).sum())
        agree += int((lp.argmax(-1) == r.argmax(-1)).sum())
        n += len(targets)
    return nll / n, agree / n, n


def parse_args(argv=None) -> argparse.Namespace:
    """The options; budgets are comma-separated like ``python -m tinyattn eval --page-budgets 2,4,8``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", default="/tmp/stories260K-hf",
                   help="Hugging Face checkpoint directory (converted from the stories260K model shipped with "
                        "tinyattn when it does not exist; default: /tmp/stories260K-hf)")
    p.add_argument("--text", default=None,
                   help="text file of stories (split on <|endoftext|> or blank lines; default: the 7 TinyStories "
                        "validation stories shipped with tinyattn)")
    p.add_argument("--page-size", type=positive_int, default=16)
    p.add_argument("--page-budgets", type=positive_int_list, default=[2, 4, 8], metavar="K1,K2,...",
                   help="comma-separated page budgets (default: 2,4,8)")
    p.add_argument("--num-sink-pages", type=non_negative_int, default=0)
    p.add_argument("--num-recent-pages", type=non_negative_int, default=1)
    p.add_argument("--dense-layers", type=non_negative_int, default=0)
    p.add_argument("--max-context", type=positive_int, default=512, help="tokens per story including BOS")
    p.add_argument("--backend", choices=["torch", "triton"], default=None,
                   help="tinyattn backend (default: by device)")
    p.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads (default 1)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from tinyattn import assets

    text = assets.resolve_file(args.text, "--text", assets.default_text_path)

    import tinyattn.integrations.hf  # noqa: F401  registers "tinyattn"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = Path(args.model_dir)
    if not (model_dir / "config.json").exists():
        from tinyattn.integrations.convert import convert

        convert(assets.default_model_path(), model_dir, assets.default_tokenizer_path())
    tok = AutoTokenizer.from_pretrained(model_dir)
    stock = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").eval()
    tiny = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="tinyattn").eval()
    seqs = [tok(t)["input_ids"][: args.max_context] for t in load_texts(text)]
    seqs = [s for s in seqs if len(s) >= 2]
    L = tiny.config.num_hidden_layers

    t0 = time.perf_counter()
    ref = stock_logprobs(stock, seqs)
    nll, _, n = summarize(ref, seqs, ref)
    print(f"{len(seqs)} stories, {n} target tokens, context <= {args.max_context}, page_size={args.page_size}, "
          f"num_sink_pages={args.num_sink_pages}, num_recent_pages={args.num_recent_pages}, "
          f"dense_layers={args.dense_layers}, model {model_dir}\n")
    print("| attention | page_budget | token budget | mean NLL | ppl | top-1 agreement with stock | pages read | s |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| stock sdpa (teacher-forced prefill) | all | all | {nll:.4f} | {math.exp(nll):.3f} | 100.00% | 100.0% | "
          f"{time.perf_counter() - t0:.1f} |")
    for budget in [None] + args.page_budgets:
        t0 = time.perf_counter()
        logp = decode_logprobs(tiny, seqs, page_size=args.page_size, page_budget=budget,
                               num_sink_pages=args.num_sink_pages if budget else 0,
                               num_recent_pages=args.num_recent_pages, dense_layers=args.dense_layers,
                               backend=args.backend)
        nll, agree, _ = summarize(logp, seqs, ref)
        frac = pages_read_fraction(seqs, args.page_size, budget, L, args.dense_layers)
        name = "tinyattn dense decode" if budget is None else "tinyattn sparse decode"
        tb = "all" if budget is None else str(budget * args.page_size)
        print(f"| {name} | {budget or 'all'} | {tb} | {nll:.4f} | {math.exp(nll):.3f} | {agree:.2%} | {frac:.1%} | "
              f"{time.perf_counter() - t0:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
