"""Speed on SmolLM2-135M-Instruct (dequantized Q4_1, fp32), batch 1, one run side by side: TTFT (the dense prefill
of a ``--context``-token prompt) and decode tokens/s for

- ``runtime dense``: :class:`tinyattn.models.LlamaRuntime`, no budget;
- ``runtime quest 1/8``: the same with ``page_budget = context / page_size / 8`` (Quest, defaults otherwise);
- ``HF stock``: transformers ``LlamaForCausalLM`` (SDPA, its ``DynamicCache``) from the same folder;
- ``HF + tinyattn quest 1/8``: ``attn_implementation="tinyattn"`` + ``TinyAttnCache`` with the same budget;

beside the bytes-per-step model (DESIGN.md, :mod:`tinyattn.metrics`): weights (fp32 parameters, the tied
embedding counted once) + KV read per step (dense: every key and value; sparse: the budget's pages in sparse
layers + every page's ``k_min``/``k_max``) and the ideal speed-up it implies (dense bytes / sparse bytes).

Each configuration runs a 64-token warm-up first (the runtime folds its weights at its first call; each side's
allocations and code paths are then warm), so TTFT is the steady-state prefill. Prints a markdown table and writes
``OUT/speed.json``; the machine and its load go beside it (``--note``).

    python bench/smollm2_speed.py --contexts 1024,4096,8192 --batches 1,4 --new-tokens 32 --out docs/smollm2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from pathlib import Path

import torch


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="8192", help="prompt lengths in tokens, comma-separated (e.g. 1024,4096,8192)")
    p.add_argument("--batches", default="1", help="batch sizes, comma-separated (rows: disjoint slices of the text)")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--fraction", type=int, default=8, help="budget = context / page_size / FRACTION pages")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--note", default="", help="machine load etc., stored with the results")
    p.add_argument("--skip", default="", help="comma-separated rows to skip (runtime_dense, runtime_quest, hf_stock, "
                                              "hf_tinyattn)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from tqdm.auto import tqdm

    import tinyattn.integrations.hf  # noqa: F401
    from tinyattn.assets import data_path
    from tinyattn.models import sources

    folder = sources.hf_checkpoint("smollm2")
    text = sources.load_tokenizer(folder).encode(data_path("book_of_mormon_1nephi.txt").read_text(encoding="utf-8"))
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    skip = set(filter(None, args.skip.split(",")))
    names = [n for n in ("runtime_dense", "runtime_quest", "hf_stock", "hf_tinyattn") if n not in skip]
    model = sources.load_model(folder)
    hf = {n: _load_hf(folder, n) for n in names if n.startswith("hf_")}
    rows = []
    bar = tqdm(total=len(contexts) * len(batches) * len(names), desc="smollm2 speed", unit="run")
    for context in contexts:
        for batch in batches:
            if batch * context > len(text):
                raise SystemExit(f"--contexts/--batches: {batch} x {context} tokens exceed the text ({len(text)})")
            prompts = [text[i * context:(i + 1) * context] for i in range(batch)]
            for name in names:                 # the configurations of one (context, batch) back to back
                bar.set_postfix_str(f"{name} context={context} batch={batch}")
                rows.append(_run(name, model, hf.get(name), prompts, args))
                print(rows[-1], flush=True)
                bar.update(1)
    bar.close()
    machine = f"{_cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}, {args.threads} thread(s)"
    table = ["| config | context | batch | TTFT (s) | decode tok/s | vs runtime dense | vs HF stock | "
             "bytes/step (model) | ideal vs dense |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def ratio(r, config):               # decode tok/s against `config` at the same context and batch
        base = [x for x in rows if (x["context"], x["batch"], x["config"]) == (r["context"], r["batch"], config)]
        return f"{r['decode_tok_s'] / base[0]['decode_tok_s']:.2f}x" if base else "-"

    for r in rows:
        table.append(f"| {r['config']} | {r['context']} | {r['batch']} | {r['ttft_s']} | {r['decode_tok_s']} | "
                     f"{ratio(r, 'runtime dense')} | {ratio(r, 'HF stock')} | {r['bytes_per_step'] / 2**20:.0f} MiB | "
                     f"{r['ideal_vs_dense']:.2f}x |")
    print(f"machine: {machine}; {args.note}\n" + "\n".join(table))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "speed.json").write_text(json.dumps(dict(machine=machine, note=args.note, args=vars(args) | {
            "out": str(args.out)}, rows=rows, table=table), indent=1) + "\n")
    return 0


def _load_hf(folder, name):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, attn_implementation="sdpa" if name == "hf_stock" else "tinyattn").eval()


def _run(name: str, model, hf, prompts: list[list[int]], args) -> dict:
    """TTFT (all rows' prefill) and decode tokens/s (all rows) of one configuration, with the bytes model."""
    from tinyattn import metrics
    from tinyattn.integrations.hf import TinyAttnCache
    from tinyattn.models import LlamaRuntime

    import transformers

    batch, context = len(prompts), len(prompts[0])
    budget = math.ceil(context / args.page_size / args.fraction)
    sparse = name != "hf_stock" and name != "runtime_dense"
    cfg = model.config
    weight_bytes = 4 * sum(t.numel() for t in {id(t): t for t in model.parameters()}.values())   # tied: once
    ctx = context + args.new_tokens // 2                                  # mean context over the decode steps
    kv = batch * cfg.n_layers * cfg.n_kv_heads * (
        metrics.sparse_bytes(ctx, cfg.head_dim, args.page_size, budget, 4, 4) if sparse
        else metrics.dense_bytes(ctx, cfg.head_dim, 4))
    dense_kv = batch * cfg.n_layers * cfg.n_kv_heads * metrics.dense_bytes(ctx, cfg.head_dim, 4)
    if name.startswith("runtime"):
        rt = LlamaRuntime(model, page_size=args.page_size, page_budget=budget if sparse else None)
        rt.generate([p[:64] for p in prompts], max_new_tokens=2, eos_id=None)     # warm-up: weights folded once
        s = rt.generate(prompts, max_new_tokens=args.new_tokens, eos_id=None).stats
        ttft, decode_s, tokens = s.prefill_s, s.decode_s, s.generated_tokens - batch   # the first comes from prefill
    else:
        cache = (transformers.DynamicCache() if name == "hf_stock"
                 else TinyAttnCache(hf.config, page_size=args.page_size, page_budget=budget))
        with torch.no_grad():
            hf(torch.tensor([p[:64] for p in prompts]), use_cache=False)              # warm-up, as the runtime's
            t0 = time.perf_counter()
            logits = hf(torch.tensor(prompts), past_key_values=cache, use_cache=True, logits_to_keep=1).logits
            ttft = time.perf_counter() - t0
            t0 = time.perf_counter()
            for _ in range(args.new_tokens - 1):
                logits = hf(logits[:, -1].argmax(-1, keepdim=True), past_key_values=cache, use_cache=True).logits
            decode_s, tokens = time.perf_counter() - t0, batch * (args.new_tokens - 1)
    label = {"runtime_dense": "runtime dense", "runtime_quest": "runtime", "hf_stock": "HF stock",
             "hf_tinyattn": "HF + tinyattn"}[name] + (f" quest 1/{args.fraction} ({budget} pages)" if sparse else "")
    return dict(config=label, context=context, batch=batch, ttft_s=round(ttft, 2),
                decode_tok_s=round(tokens / decode_s, 2), bytes_per_step=weight_bytes + kv,
                ideal_vs_dense=round((weight_bytes + dense_kv) / (weight_bytes + kv), 3))


if __name__ == "__main__":
    raise SystemExit(main())
