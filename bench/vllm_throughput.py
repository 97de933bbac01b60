"""Offline throughput inside vLLM: vLLM's own CPU backend vs tinyattn dense vs tinyattn sparse.

Several concurrent requests with long prompts on a random LLaMA-shaped model (float32), greedy, ``ignore_eos``;
TTFT and TPOT as vLLM's per-request stats report them (engine-core timestamps) and the batch's wall time. The
scheduler may admit all prompts in one step (``max_num_batched_tokens`` = requests x prompt length) or spread
them over several, and then the TPOT of the early requests includes the later ones' prefills; the column
"decode step" is the TPOT of the request whose first token came last (only decode steps follow it).
Each backend runs in its own subprocess (the ``TINYATTN_*`` settings are read when vLLM starts). Needs the
vLLM venv of ``.ci/vllm.sh``::

    python bench/vllm_throughput.py --prompt-len 8192 --num-requests 4 --output-len 32 --page-budget 32 \\
        --out docs/bench/vllm_throughput_8k.json

Prints a Markdown table (docs/vllm.md quotes it). On a CPU the numbers are the torch backend's, not the
Triton kernels'.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BACKENDS = {
    "vllm CPU_ATTN": {},
    "tinyattn dense": {"TINYATTN_VLLM": "1"},
    "tinyattn sparse": {"TINYATTN_VLLM": "1", "TINYATTN_PAGE_BUDGET": None},      # filled from --page-budget
}


def make_model(out: Path, args) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                                   num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                   num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                                   max_position_embeddings=args.prompt_len + args.output_len + 64,
                                   tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg).float()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(std=0.05)
    model.save_pretrained(out)


def worker(cfg: dict) -> dict:
    """One backend: start the engine, warm up, run the batch; stats as vLLM reports them."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    import random

    t0 = time.perf_counter()
    llm = LLM(model=cfg["model"], dtype="float32", block_size=cfg["block_size"], enforce_eager=True,
              skip_tokenizer_init=True, seed=0, disable_log_stats=False, max_model_len=cfg["max_model_len"],
              max_num_seqs=cfg["num_requests"], max_num_batched_tokens=cfg["max_num_batched_tokens"])
    start_s = time.perf_counter() - t0
    rng = random.Random(0)
    prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(1, cfg["vocab"]) for _ in range(cfg["prompt_len"])])
               for _ in range(cfg["num_requests"])]
    params = SamplingParams(temperature=0.0, max_tokens=cfg["output_len"], ignore_eos=True, detokenize=False)
    llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], SamplingParams(max_tokens=4, detokenize=False),
                 use_tqdm=False)                                                 # warm-up
    t1 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t1
    ttft, tpot, last = [], [], None
    for o in outs:
        m = o.metrics
        if m is not None and m.first_token_ts:
            ttft.append(m.first_token_ts - m.scheduled_ts)
            if m.num_generation_tokens > 1:
                tpot.append((m.last_token_ts - m.first_token_ts) / (m.num_generation_tokens - 1))
                if last is None or m.first_token_ts > last[0]:
                    last = (m.first_token_ts, tpot[-1])
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"engine_start_s": start_s, "wall_s": wall, "output_tokens": n_out,
            "output_tok_per_s": n_out / wall, "total_tok_per_s": (n_out + cfg["prompt_len"] * len(outs)) / wall,
            "mean_ttft_s": sum(ttft) / len(ttft) if ttft else None,
            "mean_tpot_s": sum(tpot) / len(tpot) if tpot else None,
            "decode_step_s": last[1] if last else None,
            "tokens": [list(o.outputs[0].token_ids) for o in outs]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt-len", type=int, default=8192)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--num-requests", type=int, default=4)
    p.add_argument("--page-budget", type=int, default=32, help="tinyattn sparse: pages per request and KV head")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated names of: " + ", ".join(BACKENDS))
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        cfg = json.loads(Path(args.worker).read_text())
        Path(cfg["result"]).write_text(json.dumps(worker(cfg)))
        return 0
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        make_model(model, args)
        for name in args.backends.split(","):
            env = {k: v for k, v in os.environ.items() if not k.startswith("TINYATTN_") and k != "TRITON_INTERPRET"}
            env.setdefault("OPENBLAS_NUM_THREADS", "1")
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
            env.update({k: (v if v is not None else str(args.page_budget)) for k, v in BACKENDS[name].items()})
            cfg = dict(model=str(model), block_size=args.block_size, prompt_len=args.prompt_len,
                       output_len=args.output_len, num_requests=args.num_requests, vocab=args.vocab,
                       max_model_len=args.prompt_len + args.output_len + 8,
                       max_num_batched_tokens=max(8192, args.num_requests * (args.prompt_len + 8)),
                       result=str(Path(tmp) / "r.json"))
            (Path(tmp) / "cfg.json").write_text(json.dumps(cfg))
            r = subprocess.run([sys.executable, __file__, "--worker", str(Path(tmp) / "cfg.json")], env=env,
                               capture_output=True, text=True)
            if r.returncode:
                print(r.stdout[-3000:], r.stderr[-3000:], file=sys.stderr)
                return r.returncode
            results[name] = json.loads((Path(tmp) / "r.json").read_text())
            print(f"{name}: {results[name]['wall_s']:.1f} s", file=sys.stderr)
    base = results.get("vllm CPU_ATTN")
    lines = [f"{args.num_requests} requests x {args.prompt_len} prompt tokens + {args.output_len} output tokens, "
             f"Llama hidden {args.hidden}, {args.layers} layers, {args.heads}/{args.kv_heads} heads, head_dim "
             f"{args.head_dim}, float32, block size {args.block_size}, sparse budget {args.page_budget} pages "
             f"({args.page_budget * args.block_size} tokens)", "",
             "| backend | wall s | output tok/s | mean TTFT s | mean TPOT ms | decode step ms | same greedy tokens "
             "as CPU_ATTN |", "|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        same = "-" if base is None or r is base else \
            f"{sum(a == b for x, y in zip(r['tokens'], base['tokens']) for a, b in zip(x, y))}/{r['output_tokens']}"
        tpot = f"{1e3 * r['mean_tpot_s']:.0f}" if r["mean_tpot_s"] is not None else "-"
        ttft = f"{r['mean_ttft_s']:.1f}" if r["mean_ttft_s"] is not None else "-"
        step = f"{1e3 * r['decode_step_s']:.0f}" if r.get("decode_step_s") is not None else "-"
        lines.append(f"| {name} | {r['wall_s']:.1f} | {r['output_tok_per_s']:.2f} | {ttft} | {tpot} | {step} "
                     f"| {same} |")
    print("\n".join(lines))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k not in ("out", "worker")},
                                        "results": results, "table": lines}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
