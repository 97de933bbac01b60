"""``train-retrieval``: train the retrieval model from scratch (``python -m tinyattn train-retrieval``).

The options map one to one onto :class:`tinyattn.retrieval.train.TrainConfig`; this module imports torch
only when the command runs, so ``--help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..argtypes import non_negative_float, non_negative_int, positive_float, positive_int, positive_int_list

__all__ = ["add_arguments", "run", "DESCRIPTION", "EPILOG", "parse_curriculum"]

DESCRIPTION = ("Train the small retrieval model (character vocabulary, sliding-window RoPE layers around one "
               "full-attention NoPE layer) from scratch on seeded passkey / multikey / multihop / decoy prompts, "
               "then report its greedy answer accuracy per task and context length. The shipped model "
               "(tinyattn/data/retrieval/) was made by this command with its defaults; docs/retrieval.md has the "
               "log.")
EPILOG = ("examples:\n"
          "  python -m tinyattn train-retrieval --out my-retrieval\n"
          "  python -m tinyattn train-retrieval --out quick --curriculum 512:50 --eval-samples 4\n"
          "then: tinyattn.retrieval.load_retrieval_model('my-retrieval') -> (LlamaModel, CharTokenizer)")


def parse_curriculum(text: str) -> tuple:
    """``"256:150:passkey,1024:300"`` -> ``((256, 150, ("passkey",)), (1024, 300))``: stages of max length,
    steps and optionally the stage's tasks (joined by ``+``), lengths increasing."""
    stages = []
    for item in text.split(","):
        parts = item.strip().split(":")
        try:
            length, steps = int(parts[0]), int(parts[1])
            if len(parts) > 3:
                raise ValueError
        except (ValueError, IndexError):
            raise argparse.ArgumentTypeError(f"expected LENGTH:STEPS[:TASK+TASK...][,...] with integer lengths and "
                                             f"steps, got {text!r}") from None
        if length < 1 or steps < 1 or (stages and length < stages[-1][0]):
            raise argparse.ArgumentTypeError(f"expected positive lengths and steps with non-decreasing lengths, "
                                             f"got {text!r}")
        stages.append((length, steps) if len(parts) == 2 else (length, steps, _tasks(parts[2].replace("+", ","))))
    return tuple(stages)


def _tasks(text: str) -> tuple[str, ...]:
    from .tasks import TASKS

    TASKS = TASKS + ("copy",)      # tinyattn.retrieval.train.COPY, a training-only task
    items = tuple(dict.fromkeys(t.strip() for t in text.split(",")))
    bad = [t for t in items if t not in TASKS]
    if bad or not items:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(TASKS)}, got {text!r}")
    return items


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``train-retrieval`` options."""
    from .recipe import CIRCUITS, MODEL_DEFAULTS as m, TrainConfig

    d = TrainConfig()
    # ", " between stages (parse_curriculum strips it): argparse's help wrapping breaks only at spaces and
    # would otherwise split a stage mid-number ("512:30 0:...")
    cur = ", ".join(":".join([str(st[0]), str(st[1])] + (["+".join(st[2])] if len(st) > 2 else []))
                   for st in d.curriculum)
    g = p.add_argument_group("output")
    g.add_argument("--out", type=Path, required=True, metavar="DIR",
                   help="directory for the checkpoint (model.safetensors + config.json) and train_log.json "
                        "(per-step loss and answer accuracy, final accuracy per task and length); written every "
                        "50 steps and at the end")
    g.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    g = p.add_argument_group("training")
    g.add_argument("--seed", type=non_negative_int, default=d.seed,
                   help=f"seeds the initialisation, the prompts (names, values, filler offsets, depths) and the "
                        f"lengths (default: {d.seed}); same seed, PyTorch build and --threads = same weights")
    g.add_argument("--curriculum", type=parse_curriculum, default=d.curriculum, metavar="LEN:STEPS,...",
                   help=f"length curriculum: stages of max prompt length in tokens, optimizer steps and optionally "
                        f"the stage's tasks (joined by +; default --tasks); a stage's batches have lengths drawn "
                        f"uniformly between the previous stage's length (half the first stage's, at least the "
                        f"tasks' minimum) and its own (default: {cur})")
    g.add_argument("--batch-tokens", type=positive_int, default=d.batch_tokens,
                   help=f"prompt tokens per batch; batch size = batch-tokens // length (default: {d.batch_tokens})")
    g.add_argument("--lr", type=positive_float, default=d.lr,
                   help=f"peak AdamW learning rate, after --warmup-steps of linear warm-up, then cosine decay to "
                        f"{d.min_lr_ratio} x (default: {d.lr})")
    g.add_argument("--warmup-steps", type=non_negative_int, default=d.warmup_steps,
                   help=f"linear warm-up steps (default: {d.warmup_steps})")
    g.add_argument("--lm-weight", type=non_negative_float, default=d.lm_weight,
                   help=f"weight of the next-character loss on non-answer tokens (filler, needles, question) next "
                        f"to the answer tokens' loss (default: {d.lm_weight})")
    g.add_argument("--tasks", type=_tasks, default=d.tasks, metavar="T1,T2,...",
                   help=f"tasks of the stages that name none, cycled within each batch (default: "
                        f"{','.join(d.tasks)})")
    g.add_argument("--threads", type=positive_int, default=d.threads,
                   help=f"PyTorch CPU threads (default: {d.threads}; on a shared machine more threads can be slower)")
    g = p.add_argument_group("model (tinyattn.retrieval.train.default_model_config)")
    g.add_argument("--dim", type=positive_int, default=m["dim"], help=f"model width (default: {m['dim']})")
    g.add_argument("--layers", type=positive_int, default=m["n_layers"], help=f"layers (default: {m['n_layers']})")
    g.add_argument("--heads", type=positive_int, default=m["n_heads"],
                   help=f"attention heads, as many KV heads (default: {m['n_heads']})")
    g.add_argument("--hidden-dim", type=positive_int, default=m["hidden_dim"],
                   help=f"SwiGLU hidden width (default: {m['hidden_dim']})")
    g.add_argument("--sliding-window", type=positive_int, default=m["sliding_window"],
                   help=f"window of the sliding_attention (RoPE) layers in tokens, the query included "
                        f"(default: {m['sliding_window']})")
    g.add_argument("--nope-layer", type=non_negative_int, default=m["nope_layer"],
                   help=f"index of the one full_attention layer, which has no positional encoding "
                        f"(default: {m['nope_layer']})")
    g.add_argument("--circuit", choices=CIRCUITS, default=d.circuit,
                   help=f"constructed starting circuit (tinyattn/retrieval/induction_init.py): context = the matching "
                        f"head compares the characters 5-8 back as well as the previous one (needs --dim >= 192, "
                        f"--heads <= dim / 64); previous = the previous character only, the first model's (default: "
                        f"{d.circuit})")
    g = p.add_argument_group("final evaluation (greedy answer accuracy through the training forward)")
    g.add_argument("--eval-lengths", type=positive_int_list, default=list(d.eval_lengths), metavar="N1,N2,...",
                   help=f"context lengths in tokens (default: {','.join(map(str, d.eval_lengths))})")
    g.add_argument("--eval-samples", type=non_negative_int, default=d.eval_samples,
                   help=f"prompts per task and length, seeds 0.. and evenly spread depths; 0 skips the "
                        f"evaluation (default: {d.eval_samples})")


def run(args) -> int:
    """Run ``train-retrieval`` from parsed ``args``; prints the accuracy table, returns 0."""
    from .recipe import TrainConfig
    from .train import train

    if args.nope_layer >= args.layers:
        raise ValueError(f"--nope-layer: expected a layer index below --layers ({args.layers}), got "
                         f"{args.nope_layer}")
    cfg = TrainConfig(seed=args.seed, curriculum=args.curriculum, batch_tokens=args.batch_tokens, lr=args.lr,
                      warmup_steps=args.warmup_steps, lm_weight=args.lm_weight, tasks=args.tasks,
                      threads=args.threads, eval_lengths=tuple(args.eval_lengths), eval_samples=args.eval_samples,
                      circuit=args.circuit, model=dict(dim=args.dim, n_layers=args.layers, n_heads=args.heads, hidden_dim=args.hidden_dim,
                                 sliding_window=args.sliding_window, nope_layer=args.nope_layer))
    _, log = train(cfg, args.out, progress=not args.no_progress)
    last = log["steps"][-1]
    print(f"trained {len(log['steps'])} steps in {log['train_s']:.0f} s ({cfg.threads} thread(s)); last answer "
          f"loss {last['answer_loss']:.3f}; wrote {args.out}", file=sys.stderr)
    if log.get("eval"):
        lengths = [str(n) for n in cfg.eval_lengths]
        print("task      " + "".join(f"{n:>8}" for n in lengths))
        for task, row in log["eval"].items():
            print(f"{task:<10}" + "".join(f"{row[n]:>8.0%}" for n in lengths))
    else:
        print(json.dumps({"train_s": log["train_s"]}))
    return 0
