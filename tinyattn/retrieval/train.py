"""Train the retrieval model from scratch on the tasks of :mod:`tinyattn.retrieval.tasks` (CPU-friendly).

Recipe (docs/retrieval.md): a LLaMA-family model (:class:`tinyattn.models.LlamaModel`, character
vocabulary) whose layers are sliding-window RoPE layers around one full-attention layer without positional
encoding (NoPE): the sliding layers see only nearby characters, so they build "what precedes me" features
that do not depend on the context length, and the NoPE layer matches them over the whole context, which is
why the model retrieves far past its training lengths (Kazemnejad et al. 2023 on NoPE length
generalisation; the interleaving of SmolLM3 / Llama 4).

Each step draws a batch of prompts of one length (the curriculum stage's length range), cycling over the
tasks, with needle depths uniform in [0, 1]; the loss is the cross-entropy of the answer tokens plus
``lm_weight`` x that of every other token (language modelling of the filler). Training prompts use seeds
from 10**9 on, so they never repeat the small seeds evaluations use. Everything is seeded: the same command
gives the same weights on the same PyTorch build and thread count.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from tinyattn.models.config import LlamaConfig
from .forward import full_forward
from .induction_init import write_context_induction_circuit, write_induction_circuit
from .recipe import MODEL_DEFAULTS, TrainConfig
from .tasks import Sample, filler_slice, make_sample, min_context_tokens
from .tokenizer import CharTokenizer

__all__ = ["TrainConfig", "default_model_config", "train", "answer_accuracy", "make_batch", "Batch", "COPY",
           "copy_sample"]

_TRAIN_SEED_BASE = 10 ** 9


def default_model_config(**overrides) -> LlamaConfig:
    """The shipped architecture (:data:`~tinyattn.retrieval.recipe.MODEL_DEFAULTS`, keyword ``overrides``):
    ``n_layers`` layers, all ``"sliding_attention"`` with RoPE except layer ``nope_layer``, a
    ``"full_attention"`` layer without RoPE; character vocabulary (99 ids)."""
    unknown = set(overrides) - set(MODEL_DEFAULTS)
    if unknown:
        raise ValueError(f"overrides: expected keys among {sorted(MODEL_DEFAULTS)}, got {sorted(unknown)}")
    o = {**MODEL_DEFAULTS, **overrides}
    dim, n_layers, n_heads, nope_layer = o["dim"], o["n_layers"], o["n_heads"], o["nope_layer"]
    hidden_dim, sliding_window, max_seq_len = o["hidden_dim"], o["sliding_window"], o["max_seq_len"]
    types = tuple("full_attention" if i == nope_layer else "sliding_attention" for i in range(n_layers))
    return LlamaConfig(dim=dim, hidden_dim=hidden_dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_heads,
                       vocab_size=CharTokenizer().vocab_size, max_seq_len=max_seq_len, layer_types=types,
                       sliding_window=sliding_window, nope_layers=(nope_layer,))


@dataclass
class Batch:
    """A training batch: ``tokens`` ``[B, W]`` (prompts of one length, then their answers, EOS-padded to the
    longest answer); over the targets ``tokens[:, 1:]``, ``valid`` ``[B, W-1]`` (not padding) and ``is_answer``
    (answer tokens), both bool; ``tasks``: each row's task."""

    tokens: torch.Tensor
    valid: torch.Tensor
    is_answer: torch.Tensor
    tasks: list


#: a training-only task: recall a random passage from its first characters (dense induction-head signal)
COPY = "copy"
_COPY_CHARS, _COPY_CUE = 32, 6
# digits, capitals and symbols: rare or absent in the filler, so one character of context already locates the
# passage, which is what makes the copying circuit appear quickly
_COPY_ALPHABET = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ#$%&*+=@^~"


def copy_sample(*, context_tokens: int, depth: float, seed: int) -> Sample:
    """A training-only prompt: filler with a passage of random digits, capitals and symbols in ``<`` ``>`` at
    ``depth``; the prompt ends with ``Recall: `` and the passage's first characters, the answer is the rest of
    the passage.
    Nothing but attention to the passage predicts the answer, and every answer character is a copy target,
    which teaches the copying (induction) circuit the retrieval tasks need much faster than their few answer
    digits do (Olsson et al. 2022 on induction heads)."""
    rng = random.Random(f"{COPY}:{seed}")
    passage = "<" + "".join(rng.choice(_COPY_ALPHABET) for _ in range(_COPY_CHARS)) + ">"
    question = "\nRecall: " + passage[:_COPY_CUE]
    n_fill = context_tokens - 1 - len(passage) - 1 - len(question)
    if n_fill < 0:
        raise ValueError(f"context_tokens: the copy task needs at least {context_tokens - n_fill} tokens, got "
                         f"{context_tokens}")
    filler = filler_slice(rng, n_fill)
    at = round(depth * n_fill)
    body = filler[:at] + passage + " " + filler[at:] + question
    tok = CharTokenizer()
    return Sample(task=COPY, prompt=tok.encode(body), answer=tok.encode(passage[_COPY_CUE:], bos=False),
                  context_tokens=context_tokens, depth=at / max(1, n_fill),
                  needle_positions=[(1 + at, 1 + at + len(passage))], text=body)


def _sample(task: str, **kw) -> Sample:
    return copy_sample(**kw) if task == COPY else make_sample(task, **kw)


def make_batch(tasks, length: int, batch: int, first_seed: int, rng: random.Random) -> Batch:
    """``batch`` prompts of ``length`` tokens with their answers (:class:`Batch`); row ``b`` is task
    ``tasks[(first_seed + b) % len(tasks)]`` (one of :data:`~tinyattn.retrieval.TASKS` or :data:`COPY`) with
    seed ``first_seed + b`` and a depth drawn from ``rng``."""
    samples = [_sample(tasks[(first_seed + b) % len(tasks)], context_tokens=length, depth=rng.random(),
                       seed=first_seed + b) for b in range(batch)]
    width = length + max(len(s.answer) for s in samples)
    tokens = torch.full((batch, width), CharTokenizer.eos_id, dtype=torch.long)
    is_answer = torch.zeros(batch, width - 1, dtype=torch.bool)
    valid = torch.zeros(batch, width - 1, dtype=torch.bool)
    for b, s in enumerate(samples):
        seq = s.prompt + s.answer
        tokens[b, :len(seq)] = torch.tensor(seq)
        is_answer[b, length - 1:len(seq) - 1] = True              # target t+1 is an answer token
        valid[b, :len(seq) - 1] = True
    return Batch(tokens, valid, is_answer, [s.task for s in samples])


def _exact_by_task(logits: torch.Tensor, batch: Batch) -> dict:
    """Per task, the fraction of rows whose every answer token is the argmax (teacher forced = greedy)."""
    right = ((logits.argmax(-1) == batch.tokens[:, 1:]) | ~batch.is_answer).all(-1).tolist()
    out = {}
    for task, ok in zip(batch.tasks, right):
        out.setdefault(task, []).append(ok)
    return {t: round(sum(v) / len(v), 3) for t, v in out.items()}


def _lr(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(1, cfg.total_steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def _schedule(cfg: TrainConfig, rng: random.Random):
    """``(length, tasks)`` of every step's batch, from the curriculum: lengths uniform between the previous
    stage's length (half the first stage's) and the stage's own, never below its tasks' minimum."""
    lo = cfg.curriculum[0][0] // 2
    for stage in cfg.curriculum:
        hi, steps = stage[0], stage[1]
        tasks = tuple(stage[2]) if len(stage) > 2 else tuple(cfg.tasks)
        floor = max(min_context_tokens(t) if t != COPY else 96 for t in tasks)
        for _ in range(steps):
            yield max(floor, rng.randint(min(lo, hi), hi)), tasks
        lo = hi


@torch.no_grad()
def answer_accuracy(model, task: str, length: int, samples: int, *, seed: int = 0) -> float:
    """Fraction of ``samples`` prompts of ``task`` at ``length`` tokens (seeds ``seed..seed+samples-1``, depths
    ``(i + 0.5) / samples``) whose whole answer the model produces greedily, through :func:`full_forward`.

    Teacher forcing gives the same verdict as greedy decoding: if the argmax at every answer position is the
    answer token, greedy decoding produces exactly the answer; otherwise greedy first differs there too."""
    hits = 0
    for i in range(samples):
        s = make_sample(task, context_tokens=length, depth=(i + 0.5) / samples, seed=seed + i)
        seq = torch.tensor([s.prompt + s.answer[:-1]])
        pred = full_forward(model, seq)[0, length - 1:].argmax(-1)
        hits += bool((pred == torch.tensor(s.answer)).all())
    return hits / samples


def train(cfg: TrainConfig, out_dir: str | Path | None = None, *, progress: bool = True,
          evaluate: bool = True):
    """Train a model per ``cfg``; returns ``(model, log)``. With ``out_dir``, writes the checkpoint
    (:func:`tinyattn.retrieval.save_retrieval_model`) and ``train_log.json`` there (the log also after every
    50 steps). ``log["steps"]``: per step ``{step, length, batch, loss, answer_loss, answer_token_acc, lr,
    answer_exact (per task), elapsed_s}``; ``log["eval"]``: per task and length the greedy answer accuracy (:func:`answer_accuracy`)."""
    from tqdm.auto import tqdm

    from tinyattn.models.llama import LlamaModel
    from .model import save_retrieval_model

    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    model = LlamaModel(default_model_config(**cfg.model)).train()
    _init(model)
    if cfg.induction_init and cfg.circuit == "context":
        write_context_induction_circuit(model, nope_layer=model.config.nope_layers[0])
    elif cfg.induction_init:
        write_induction_circuit(model, nope_layer=model.config.nope_layers[0])
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    rest = [p for n, p in model.named_parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    log = {"config": _jsonable(asdict(cfg)), "model": _jsonable(asdict(model.config)),
           "parameters": sum(p.numel() for p in model.parameters()), "torch": torch.__version__,
           "threads": cfg.threads, "steps": []}
    out = Path(out_dir) if out_dir is not None else None
    t0 = time.perf_counter()
    counter = _TRAIN_SEED_BASE + cfg.seed * 10 ** 7
    bar = tqdm(total=cfg.total_steps, disable=not progress, desc="train-retrieval", unit="step")
    for step, (length, tasks) in enumerate(_schedule(cfg, rng)):
        batch = max(1, cfg.batch_tokens // length)
        b = make_batch(tasks, length, batch, counter, rng)
        tokens, valid, is_answer = b.tokens, b.valid, b.is_answer
        counter += batch
        for group in opt.param_groups:
            group["lr"] = _lr(cfg, step)
        logits = full_forward(model, tokens[:, :-1])
        nll = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), reduction="none").view_as(valid)
        ans_loss = nll[is_answer].mean()
        lm_loss = nll[valid & ~is_answer].mean()
        loss = ans_loss + cfg.lm_weight * lm_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        acc = (logits.argmax(-1) == tokens[:, 1:])[is_answer].float().mean().item()
        log["steps"].append({"step": step, "length": length, "batch": batch, "loss": round(loss.item(), 4),
                             "answer_loss": round(ans_loss.item(), 4), "answer_token_acc": round(acc, 4),
                             "answer_exact": _exact_by_task(logits, b),
                             "lr": round(_lr(cfg, step), 6), "elapsed_s": round(time.perf_counter() - t0, 1)})
        bar.set_postfix(len=length, ans_loss=f"{ans_loss.item():.3f}", acc=f"{acc:.2f}")
        bar.update()
        if out is not None and (step + 1) % 50 == 0:
            save_retrieval_model(model, CharTokenizer(), out, training={"steps_done": step + 1})
            _write_log(out, log)
    bar.close()
    log["train_s"] = round(time.perf_counter() - t0, 1)
    model.eval()
    if evaluate and cfg.eval_samples:
        log["eval"] = {task: {str(n): answer_accuracy(model, task, n, cfg.eval_samples)
                              for n in cfg.eval_lengths} for task in cfg.tasks}
    if out is not None:
        save_retrieval_model(model, CharTokenizer(), out,
                             training={"command": "python -m tinyattn train-retrieval", "seed": cfg.seed,
                                       "steps": cfg.total_steps, "train_s": log["train_s"],
                                       "eval": log.get("eval")})
        _write_log(out, log)
    return model.requires_grad_(False), log


def _init(model) -> None:
    """Normal(0, 0.02) weights (GPT-2), output projections (``wo``, ``w2``) scaled by ``1 / sqrt(2 n_layers)``,
    and ``wq``, ``wk`` at ``1 / sqrt(dim)`` (LeCun): with 0.02 both the attention logits and their gradients
    start near zero (each factor's gradient is proportional to the other), and the copying circuit the
    tasks need took hundreds of steps longer to appear."""
    cfg = model.config
    for name, p in model.named_parameters():
        if p.dim() > 1:
            if name.endswith(("wq.weight", "wk.weight")):
                std = cfg.dim ** -0.5
            elif name.endswith(("wo.weight", "w2.weight")):
                std = 0.02 / math.sqrt(2 * cfg.n_layers)
            else:
                std = 0.02
            torch.nn.init.normal_(p, 0.0, std)


def _jsonable(d: dict) -> dict:
    return json.loads(json.dumps(d, default=list))


def _write_log(out: Path, log: dict) -> None:
    (out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
