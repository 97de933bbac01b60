"""Speed on SmolLM2-135M-Instruct (dequantized Q4_1, fp32), batch 1, one run side by side: TTFT (the dense prefill
of a ``--context``-token prompt) and decode tokens/s for

- ``runtime dense``: :class:`tinyattn.models.LlamaRuntime`, no budget;
- ``runtime quest 1/8``: the same with ``page_budget = context / page_size / 8`` (Quest, defaults otherwise);
- ``HF stock``: transformers ``LlamaForCausalLM`` (SDPA, its ``DynamicCache``) from the same folder;
- ``HF + tinyattn quest 1/8``: ``attn_implementation="tinyattn"`` + ``TinyAttnCache`` with the same budget;

beside the bytes-per-step model (DESIGN.md, :mod:`tinyattn.metrics`): weights (fp32 parameters, the tied
embedding counted once) + KV read per step (dense: every key and value; sparse: the budget's pages in sparse
layers + every page's ``k_min``/``k_max``) and the ideal speed-up it implies (dense bytes / sparse bytes).

Prints a markdown table and writes ``OUT/speed.json``; the machine and its load go beside it (``--note``).

    nice -n 5 python bench/smollm2_speed.py --context 8192 --new-tokens 32 --out docs/smollm2 --threads 1
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
    p.add_argument("--context", type=int, default=8192)
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

    import transformers

    import tinyattn.integrations.hf  # noqa: F401
    from tinyattn import metrics
    from tinyattn.assets import data_path
    from tinyattn.integrations.hf import TinyAttnCache
    from tinyattn.models import LlamaRuntime, sources

    folder = sources.hf_checkpoint("smollm2")
    tok = sources.load_tokenizer(folder)
    ids = tok.encode(data_path("book_of_mormon_1nephi.txt").read_text(encoding="utf-8"))[:args.context]
    if len(ids) < args.context:
        raise SystemExit(f"--context: the text has {len(ids)} tokens")
    budget = math.ceil(args.context / args.page_size / args.fraction)
    model = sources.load_model(folder)
    cfg = model.config
    n_params = sum(t.numel() for t in {id(t): t for t in model.parameters()}.values())
    weight_bytes = n_params * 4
    ctx = args.context + args.new_tokens // 2                  # mean context over the decode steps
    dense_kv = cfg.n_layers * cfg.n_kv_heads * metrics.dense_bytes(ctx, cfg.head_dim, 4)
    sparse_kv = cfg.n_layers * cfg.n_kv_heads * metrics.sparse_bytes(ctx, cfg.head_dim, args.page_size, budget, 4, 4)
    rows = []
    skip = set(filter(None, args.skip.split(",")))

    def add(name, ttft, decode_s, steps, kv_bytes):
        rows.append(dict(config=name, context=args.context, batch=1, ttft_s=round(ttft, 2),
                         decode_tok_s=round(steps / decode_s, 2), bytes_per_step=weight_bytes + kv_bytes,
                         ideal_vs_dense=round((weight_bytes + dense_kv) / (weight_bytes + kv_bytes), 3)))
        print(rows[-1], flush=True)

    for name, pb in (("runtime_dense", None), ("runtime_quest", budget)):
        if name in skip:
            continue
        rt = LlamaRuntime(model, page_size=args.page_size, page_budget=pb)
        out = rt.generate([ids], max_new_tokens=args.new_tokens, eos_id=None)
        s = out.stats
        add(f"{name}" + (f" 1/{args.fraction} ({pb} pages)" if pb else ""), s.prefill_s, s.decode_s,
            s.decode_steps, dense_kv if pb is None else sparse_kv)
    del model
    for name in ("hf_stock", "hf_tinyattn"):
        if name in skip:
            continue
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            str(folder), dtype=torch.float32, attn_implementation="sdpa" if name == "hf_stock" else "tinyattn").eval()
        cache = (transformers.DynamicCache() if name == "hf_stock"
                 else TinyAttnCache(hf.config, page_size=args.page_size, page_budget=budget))
        with torch.no_grad():
            t0 = time.perf_counter()
            logits = hf(torch.tensor([ids]), past_key_values=cache, use_cache=True, logits_to_keep=1).logits
            ttft = time.perf_counter() - t0
            t0 = time.perf_counter()
            for _ in range(args.new_tokens - 1):
                nxt = logits[:, -1].argmax(-1, keepdim=True)
                logits = hf(nxt, past_key_values=cache, use_cache=True).logits
            dec = time.perf_counter() - t0
        add(name + ("" if name == "hf_stock" else f" quest 1/{args.fraction} ({budget} pages)"), ttft, dec,
            args.new_tokens - 1, dense_kv if name == "hf_stock" else sparse_kv)
        del hf, cache
    machine = f"{_cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}, {args.threads} thread(s)"
    table = ["| config | context | TTFT (s) | decode tok/s | bytes/step (model) | ideal speed-up vs dense |",
             "|---|---:|---:|---:|---:|---:|"]
    table += [f"| {r['config']} | {r['context']} | {r['ttft_s']} | {r['decode_tok_s']} | "
              f"{r['bytes_per_step'] / 2**20:.0f} MiB | {r['ideal_vs_dense']:.2f}x |" for r in rows]
    print(f"machine: {machine}; {args.note}\n" + "\n".join(table))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "speed.json").write_text(json.dumps(dict(machine=machine, note=args.note, args=vars(args) | {
            "out": str(args.out)}, rows=rows), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
