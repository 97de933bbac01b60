"""``finetune``: long-context fine-tuning of a llama2.c model in chunks, with a KV retention policy.

Each training sequence (``--seq-len`` tokens of the text, after a BOS) is processed in chunks of
``--chunk-size`` tokens; earlier chunks' K/V stay in a paged memory of at most ``--kv-budget-pages`` pages
per sequence and layer (``--retention full`` keeps the whole sequence). When a chunk does not fit, the
policy frees pages: ``recency`` the oldest (sinks and newest kept), ``gradient`` the pages with the
smallest EMA of a gradient-based score, the signed first-order loss change of removing the page,
-Σ(dK·K + dV·V) (TinyServe, arXiv 2509.12211, §3.4; Molchanov et al., ICLR 2017). The loss of every
chunk is back-propagated (into the weights, and into the memory pages for the gradient policy), and the
optimizer steps once per batch of sequences.

Evaluation runs held-out sequences (the last ``--eval-sequences`` of the data, never trained on) the same
way, under the same policy and budget (the gradient policy back-propagates each chunk's loss to score the
pages, without touching the weights), and also with full retention.

Prints the figures and, with ``--json``, writes ``{retention, peak_kv_bytes, peak_memory_bytes, train_loss,
eval_nll, ...}`` there. ``--model``, ``--tokenizer`` and ``--data`` default to the stories260K model and the
TinyStories sample shipped with tinyattn (:mod:`tinyattn.assets`).

    python -m tinyattn finetune --chunk-size 64 --retention gradient --kv-budget-pages 16 --steps 100 \\
        --json out/finetune/gradient.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from pathlib import Path

from ..argtypes import non_negative_int, positive_float, positive_int

__all__ = ["add_arguments", "run", "main", "load_sequences", "finetune", "EPILOG"]

EPILOG = ("examples:\n"
          "  python -m tinyattn finetune --chunk-size 64 --retention gradient --kv-budget-pages 16 --steps 20\n"
          "  python -m tinyattn finetune --model stories15M.bin --tokenizer tokenizer.bin --data my_text.txt \\\n"
          "      --chunk-size 64 --retention recency --kv-budget-pages 16 --steps 100 --json out/recency.json")


def _decay(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``finetune`` options (used by ``python -m tinyattn finetune`` and by this module's ``main``)."""
    g = parser.add_argument_group("model and data")
    g.add_argument("--task", choices=["text", "recall"], default="text",
                   help="text: language modelling on --data (every target counts); recall: generated sequences with "
                        "pass keys early and questions late, only the answer digits count (the retrieval model; "
                        "see docs/training.md) (default: text)")
    g.add_argument("--model", type=Path, default=None,
                   help="llama2.c checkpoint (legacy format); default: the stories260K model shipped with tinyattn. "
                        "With --task recall: a retrieval checkpoint directory (config.json + model.safetensors), "
                        "default: the retrieval model shipped with tinyattn")
    g.add_argument("--tokenizer", type=Path, default=None,
                   help="llama2.c tokenizer .bin; default: the shipped stories260K's tok512.bin")
    g.add_argument("--data", type=Path, default=None,
                   help="UTF-8 text to fine-tune on; its last --eval-sequences sequences are held out for evaluation "
                        "(default: about 254 TinyStories stories shipped with tinyattn, 195 sequences of 512 tokens)")
    g.add_argument("--seq-len", type=positive_int, default=None,
                   help="tokens per sequence (default: 512, stories260K's context; 1024 with --task recall)")
    g.add_argument("--eval-sequences", type=positive_int, default=16,
                   help="held-out sequences at the end of --data for evaluation (default: 16); with --task recall, "
                        "sequences of seeds never trained on")
    g.add_argument("--num-keys", type=positive_int, default=4, help="--task recall: pass keys per sequence (default: 4)")
    g.add_argument("--num-questions", type=positive_int, default=4,
                   help="--task recall: questions per sequence, spread from --first-question to the end (default: 4)")
    g.add_argument("--first-question", type=float, default=0.3,
                   help="--task recall: where the first question starts, a fraction of the sequence; the keys lie "
                        "in its first 10%% (default: 0.3)")

    g = parser.add_argument_group("chunked KV memory and retention")
    g.add_argument("--chunk-size", type=positive_int, required=True,
                   help="tokens per chunk; a multiple of --page-size")
    g.add_argument("--page-size", type=positive_int, default=16, help="tokens per KV page (default: 16)")
    g.add_argument("--retention", choices=["full", "gradient", "recency"], required=True,
                   help="full: keep every page; recency: free the oldest pages (sinks and newest kept); "
                        "gradient: free the pages with the smallest EMA of the signed first-order loss change "
                        "-sum(dK*K + dV*V) of removing them")
    g.add_argument("--kv-budget-pages", type=positive_int, default=None,
                   help="pages per sequence and layer the KV memory may hold, the current chunk included "
                        "(required unless --retention full; ignored by full)")
    g.add_argument("--sink-pages", type=non_negative_int, default=1,
                   help="leading pages never freed (attention sinks; default: 1)")
    g.add_argument("--recent-pages", type=non_negative_int, default=None,
                   help="newest pages never freed (default: one chunk, --chunk-size / --page-size)")
    g.add_argument("--ema-decay", type=_decay, default=0.5,
                   help="EMA factor of the gradient policy's page scores (default: 0.5)")
    g.add_argument("--gradient-recent-pages", type=non_negative_int, default=0,
                   help="gradient policy: the newest N held pages rank above all others (by recency), the score "
                        "chooses among the older ones (H2O-style; default: 0, the score alone)")

    g = parser.add_argument_group("optimisation")
    g.add_argument("--steps", type=positive_int, required=True, help="optimizer steps (one batch of sequences each)")
    g.add_argument("--batch-size", type=positive_int, default=4, help="sequences per step (default: 4)")
    g.add_argument("--lr", type=positive_float, default=5e-4, help="AdamW learning rate (default: 5e-4)")
    g.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (default: 0)")
    g.add_argument("--grad-clip", type=positive_float, default=1.0, help="gradient-norm clip (default: 1.0)")
    g.add_argument("--seed", type=int, default=0,
                   help="seed of the data order; with --task recall also of the generated training sequences "
                        "(the evaluation sequences stay the same) (default: 0)")

    g = parser.add_argument_group("run")
    g.add_argument("--json", type=Path, default=None, help="also write the results there (JSON)")
    g.add_argument("--save", type=Path, default=None, help="also save the fine-tuned weights (torch state dict)")
    g.add_argument("--eval-before", action="store_true",
                   help="also evaluate the model before fine-tuning (same policy and budget)")
    g.add_argument("--backend", choices=["torch", "triton"], default=None,
                   help="attention backend (default: triton on CUDA, torch on CPU)")
    g.add_argument("--threads", type=positive_int, default=None, help="PyTorch CPU threads (default: 1)")
    g.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def split_stories(text: str) -> list[str]:
    """Stories of a TinyStories text: split on ``<|endoftext|>`` when present; otherwise the text is paragraphs
    separated by blank lines, and a paragraph that starts with "Once" (``Once upon a time``, ``Once there was``)
    starts a new story (the first paragraph always does)."""
    if "<|endoftext|>" in text:
        return [s.strip() for s in text.split("<|endoftext|>") if s.strip()]
    stories: list[list[str]] = []
    for para in (p.strip() for p in re.split(r"\n[ \t]*\n", text)):
        if not para:
            continue
        if not stories or re.match(r"Once\b", para):
            stories.append([])
        stories[-1].append(para)
    return ["\n\n".join(s) for s in stories]


def load_sequences(tokenizer, path, seq_len: int):
    """int64 ``[N, seq_len + 1]``: consecutive windows of the token stream (inputs ``[:, :-1]``, targets ``[:, 1:]``).

    The stream is every story encoded with a leading BOS, one after another: the format llama2.c trains its
    TinyStories models on (``tinystories.py`` pretokenize; windows do not start at story boundaries).
    """
    import torch

    stories = split_stories(Path(path).read_text(encoding="utf-8"))
    stream = [t for story in stories for t in tokenizer.encode(story, bos=True)]
    n = (len(stream) - 1) // seq_len
    if n == 0:
        raise ValueError(f"--data: {path} has {len(stream)} tokens, fewer than one sequence of --seq-len {seq_len}")
    flat = torch.tensor(stream[: n * seq_len + 1], dtype=torch.int64)
    return torch.stack([flat[i * seq_len: (i + 1) * seq_len + 1] for i in range(n)])


def _param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def evaluate_chunked(model, sequences, *, retention: str, batch_size: int, progress: bool = False, desc="eval",
                     loss_mask=None, **options) -> dict:
    """Mean NLL and argmax accuracy of ``sequences`` (of the targets ``loss_mask`` counts, default all) run chunk
    by chunk under ``retention`` (weights untouched)."""
    from tqdm.auto import tqdm

    from .chunked import run_sequences
    from .retention import make_policy

    was = [p.requires_grad for p in model.parameters()]
    model.requires_grad_(False)
    nll_sum, tokens, correct, peak_kv = 0.0, 0, 0, 0
    try:
        for i in tqdm(range(0, len(sequences), batch_size), desc=desc, disable=None if progress else True, leave=False):
            policy = make_policy(retention, decay=options.get("ema_decay", 0.5),
                                 recent_pages=options.get("gradient_recent_pages", 0))
            st = run_sequences(model, sequences[i:i + batch_size], policy, train=False,
                               loss_mask=None if loss_mask is None else loss_mask[i:i + batch_size],
                               **{k: v for k, v in options.items() if k not in ("ema_decay", "gradient_recent_pages")})
            nll_sum += st.nll_sum
            tokens += st.num_tokens
            correct += st.num_correct
            peak_kv = max(peak_kv, st.peak_kv_bytes)
    finally:
        for p, w in zip(model.parameters(), was):
            p.requires_grad_(w)
    return dict(nll=nll_sum / max(tokens, 1), accuracy=correct / max(tokens, 1), tokens=tokens, peak_kv_bytes=peak_kv)


def finetune(model, train_seqs, eval_seqs, *, retention: str, steps: int, batch_size: int, chunk_size: int,
             page_size: int, capacity, num_sink_pages: int, num_recent_pages, ema_decay: float, lr: float,
             gradient_recent_pages: int = 0,
             weight_decay: float = 0.0, grad_clip: float = 1.0, seed: int = 0, backend=None, eval_before=False,
             progress: bool = True, train_mask=None, eval_mask=None) -> dict:
    """Fine-tune ``model`` in place; returns the result dict written by the CLI.

    ``train_mask`` / ``eval_mask``: bool ``[N, L]`` loss masks of the sequences (see
    :func:`tinyattn.training.chunked.run_sequences`); default: every target counts."""
    import torch
    from tqdm.auto import tqdm

    from .chunked import run_sequences
    from .retention import make_policy

    options = dict(chunk_size=chunk_size, page_size=page_size, capacity=capacity, num_sink_pages=num_sink_pages,
                   num_recent_pages=num_recent_pages, backend=backend)
    result: dict = dict(retention=retention)
    if eval_before:
        before = evaluate_chunked(model, eval_seqs, retention=retention, batch_size=batch_size,
                                  progress=progress, desc="eval (before)", ema_decay=ema_decay,
                                  gradient_recent_pages=gradient_recent_pages, loss_mask=eval_mask, **options)
        result["eval_nll_before"], result["eval_accuracy_before"] = before["nll"], before["accuracy"]
    model.requires_grad_(True).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(train_seqs), generator=gen)
    losses, peak_kv, peak_chunk, pool_bytes, evicted = [], 0, 0, 0, 0
    t0 = time.perf_counter()
    bar = tqdm(range(steps), desc=f"finetune ({retention})", disable=None if progress else True)
    cursor = 0
    for _ in bar:
        if cursor + batch_size > len(order):
            order, cursor = torch.randperm(len(train_seqs), generator=gen), 0
        rows = order[cursor:cursor + batch_size]
        cursor += batch_size
        policy = make_policy(retention, decay=ema_decay, recent_pages=gradient_recent_pages)
        st = run_sequences(model, train_seqs[rows], policy, train=True,
                           loss_mask=None if train_mask is None else train_mask[rows], **options)
        if grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(st.nll)
        peak_kv, peak_chunk = max(peak_kv, st.peak_kv_bytes), max(peak_chunk, st.peak_chunk_bytes)
        pool_bytes, evicted = max(pool_bytes, st.pool_bytes), evicted + st.evicted_pages
        bar.set_postfix(loss=f"{st.nll:.4f}")
    train_s = time.perf_counter() - t0
    model.requires_grad_(False).eval()
    tail = max(1, steps // 4)
    ev = evaluate_chunked(model, eval_seqs, retention=retention, batch_size=batch_size, progress=progress,
                          ema_decay=ema_decay, gradient_recent_pages=gradient_recent_pages, loss_mask=eval_mask,
                          **options)
    ev_full = evaluate_chunked(model, eval_seqs, retention="full", batch_size=batch_size, progress=progress,
                               desc="eval (full context)", loss_mask=eval_mask, **options)
    # weights + gradients + AdamW's two moments, plus the largest chunk: KV pools, saved activations,
    # pool-shaped page gradients (see SequenceStats)
    peak_memory = 4 * _param_bytes(model) + pool_bytes + peak_chunk
    result.update(
        peak_kv_bytes=peak_kv,
        peak_memory_bytes=peak_memory,
        train_loss=sum(losses[-tail:]) / tail,
        eval_nll=ev["nll"],
        eval_nll_full_retention=ev_full["nll"],
        eval_accuracy=ev["accuracy"],
        eval_accuracy_full_retention=ev_full["accuracy"],
        eval_peak_kv_bytes=ev["peak_kv_bytes"],
        first_train_loss=losses[0],
        kv_budget_pages=capacity,
        evicted_pages_per_step=evicted / steps,
        steps=steps, batch_size=batch_size, seq_len=train_seqs.shape[1] - 1, chunk_size=chunk_size,
        page_size=page_size, num_sink_pages=num_sink_pages, num_recent_pages=num_recent_pages,
        ema_decay=ema_decay if retention == "gradient" else None,
        gradient_recent_pages=gradient_recent_pages if retention == "gradient" else None, lr=lr,
        train_sequences=len(train_seqs), eval_sequences=len(eval_seqs), eval_tokens=ev["tokens"],
        train_seconds=round(train_s, 2), backend=backend or "auto",
    )
    return result


def check_budget(args) -> None:
    """``--kv-budget-pages`` must hold the protected pages and the chunk being written (unless it covers the whole
    sequence, which is full retention); the error names the flags (ChunkedKVMemory's own check names its
    ``capacity`` argument)."""
    if args.retention == "full" or args.kv_budget_pages is None:
        return
    full_pages = math.ceil(args.seq_len / args.page_size)
    chunk_pages = args.chunk_size // args.page_size
    recent = chunk_pages if args.recent_pages is None else args.recent_pages
    floor = args.sink_pages + recent + chunk_pages
    if args.kv_budget_pages < full_pages and args.kv_budget_pages < floor:
        recent_text = (f"--recent-pages ({recent}, the default: one chunk)" if args.recent_pages is None
                       else f"--recent-pages ({recent})")
        raise ValueError(
            f"--kv-budget-pages ({args.kv_budget_pages}) is too small: it must hold --sink-pages ({args.sink_pages}) "
            f"+ {recent_text} + the chunk being written (--chunk-size {args.chunk_size} / --page-size "
            f"{args.page_size} = {chunk_pages} pages) = {floor} pages; raise --kv-budget-pages to at least {floor} "
            f"or lower --sink-pages / --recent-pages")


def run(args) -> int:
    """Run the command from parsed ``args`` (see :func:`add_arguments`); returns the exit status."""
    if args.backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        import torch

        if not torch.cuda.is_available() and "triton" not in sys.modules:
            os.environ["TRITON_INTERPRET"] = "1"   # before triton is imported
            print("note: no CUDA device; the Triton kernels run in the interpreter (slow)", file=sys.stderr)
    import torch

    if args.seq_len is None:
        args.seq_len = 1024 if args.task == "recall" else 512
    if args.chunk_size % args.page_size:
        raise ValueError(f"--chunk-size ({args.chunk_size}) must be a multiple of --page-size ({args.page_size})")
    if args.retention != "full" and args.kv_budget_pages is None:
        raise ValueError(f"--kv-budget-pages is required with --retention {args.retention}")
    check_budget(args)
    torch.set_num_threads(args.threads or 1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.task == "recall":
        model, data = _recall_data(args, device)
    else:
        model, data = _text_data(args, device)
    train_seqs, train_mask, eval_seqs, eval_mask = data
    capacity = None if args.retention == "full" else args.kv_budget_pages
    result = finetune(model, train_seqs, eval_seqs, retention=args.retention, steps=args.steps,
                      batch_size=args.batch_size, chunk_size=args.chunk_size, page_size=args.page_size,
                      capacity=capacity, num_sink_pages=args.sink_pages, num_recent_pages=args.recent_pages,
                      ema_decay=args.ema_decay, gradient_recent_pages=args.gradient_recent_pages, lr=args.lr,
                      weight_decay=args.weight_decay, grad_clip=args.grad_clip,
                      seed=args.seed, backend=args.backend, eval_before=args.eval_before,
                      progress=not args.no_progress, train_mask=train_mask, eval_mask=eval_mask)
    result["task"] = args.task
    full_pages = math.ceil(args.seq_len / args.page_size)
    result["full_kv_pages"] = full_pages
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if args.save is not None:
        torch.save(model.state_dict(), args.save)
    if args.task == "recall":
        print(f"{args.retention}: answer-digit accuracy {result['eval_accuracy']:.1%} (full retention "
              f"{result['eval_accuracy_full_retention']:.1%})")
    print(f"{args.retention}: train_loss {result['train_loss']:.4f}  eval_nll {result['eval_nll']:.4f}  "
          f"(full-retention eval {result['eval_nll_full_retention']:.4f})  peak_kv_bytes {result['peak_kv_bytes']:,}  "
          f"peak_memory_bytes {result['peak_memory_bytes']:,}" + (f"  -> {args.json}" if args.json else ""))
    return 0


def _text_data(args, device):
    """The llama2.c model and consecutive windows of ``--data`` (no loss mask); the last ones held out."""
    from .. import assets
    from ..models import LlamaModel, Tokenizer

    args.model = assets.resolve_file(args.model, "--model", assets.default_model_path)
    args.tokenizer = assets.resolve_file(args.tokenizer, "--tokenizer", assets.default_tokenizer_path)
    args.data = assets.resolve_file(args.data, "--data", assets.default_finetune_text_path)
    model = LlamaModel.from_llama2c(args.model, device=device)
    tokenizer = Tokenizer(args.tokenizer)
    if tokenizer.vocab_size != model.config.vocab_size:
        raise ValueError(f"--tokenizer: {args.tokenizer} has {tokenizer.vocab_size} tokens, the model expects "
                         f"{model.config.vocab_size}")
    if args.seq_len > model.config.max_seq_len:
        print(f"warning: --seq-len {args.seq_len} is past the model's context ({model.config.max_seq_len})",
              file=sys.stderr)
    seqs = load_sequences(tokenizer, args.data, args.seq_len).to(device)
    if len(seqs) <= args.eval_sequences:
        raise ValueError(f"--eval-sequences ({args.eval_sequences}) leaves no training sequence: {args.data} gives "
                         f"{len(seqs)} sequences of {args.seq_len} tokens")
    return model, (seqs[: -args.eval_sequences], None, seqs[-args.eval_sequences:], None)


_EVAL_SEED = 10 ** 6      # recall evaluation seeds start here; training uses 0, 1, ...


def _recall_data(args, device):
    """The retrieval model and generated recall sequences with their answer masks (one per training step and
    row: ``steps * batch_size`` seeds from ``--seed * 100000``; evaluation seeds from 10**6, never trained on)."""
    from ..retrieval import load_retrieval_model
    from ..retrieval.recall import recall_batch

    if args.data is not None or args.tokenizer is not None:
        raise ValueError("--data and --tokenizer do not apply to --task recall (the sequences are generated with the "
                         "retrieval model's character tokenizer)")
    model, _ = load_retrieval_model(args.model)
    model = model.to(device)
    options = dict(seq_len=args.seq_len, num_keys=args.num_keys, num_questions=args.num_questions,
                   first_question=args.first_question)
    train, train_mask = recall_batch(args.steps * args.batch_size, first_seed=args.seed * 100_000, **options)
    evals, eval_mask = recall_batch(args.eval_sequences, first_seed=_EVAL_SEED, **options)
    return model, (train.to(device), train_mask.to(device), evals.to(device), eval_mask.to(device))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tinyattn.training.finetune",
        description="Chunked long-context fine-tuning with a paged KV memory and a retention policy "
                    "(full / recency / gradient-aware, TinyServe §3.4). Prints (and with --json writes) memory and "
                    "loss figures.",
        epilog=EPILOG.replace("python -m tinyattn finetune", "python -m tinyattn.training.finetune"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (ValueError, OSError) as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
