"""End-to-end decode tokens/s of the model runtime, sparse vs dense, as the context grows.

A LLaMA-shaped model with random weights (speed does not depend on them): ``dim 1024``, 8 query heads /
2 KV heads of ``head_dim 128`` (GQA 4, as LLaMA-3), SwiGLU ``hidden 2816``, 4 layers, vocab 4096. For each
context the KV cache of one sequence is filled to ``L`` tokens with random keys/values (a prefill of that
length would dominate the run and is not what is measured), then :meth:`LlamaRuntime.decode` steps run,
**alternating** a dense step (``page_budget=None``) and a sparse step (``--budget`` tokens) on the same
sequence, so that both see the same cache and the same machine state. Reported: median ms per token,
tokens/s, the sparse speedup, and the share of the dense step spent in attention (from the op-level
profiler, :mod:`tinyattn.profiler`), which bounds what sparsity can win (Amdahl).

Examples::

    python bench/e2e_decode.py                          # CPU, fp32, 1K..128K
    python bench/e2e_decode.py --contexts 32K --steps 16
    python bench/e2e_decode.py --device cuda --out out/gpu
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import common as C  # noqa: E402


def parse_args(argv=None):
    p = C.script_parser(__doc__, "e2e_decode", "comma-separated contexts (default: 1K,4K,16K,32K,64K,128K)")
    p.add_argument("--budget", type=int, default=2048, help="sparse token budget (default: 2048)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=8, help="timed decode steps per mode (default: 8)")
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--n-heads", type=int, default=8)
    p.add_argument("--n-kv-heads", type=int, default=2)
    p.add_argument("--hidden-dim", type=int, default=2816)
    p.add_argument("--vocab-size", type=int, default=4096)
    args = p.parse_args(argv)
    if args.quick:
        args.contexts = args.contexts or [512, 2048]
        args.budget = 256
        args.dim, args.n_layers, args.n_heads, args.n_kv_heads = 256, 2, 4, 2
        args.hidden_dim, args.vocab_size = 512, 256
        args.steps = 2
        args.warmup = 1
    args.contexts = args.contexts or [1024, 4096, 16384, 32768, 65536, 131072]
    return args


def build_model(args, device, dtype):
    from tinyattn.models import LlamaConfig, LlamaModel

    cfg = LlamaConfig(dim=args.dim, hidden_dim=args.hidden_dim, n_layers=args.n_layers, n_heads=args.n_heads,
                      n_kv_heads=args.n_kv_heads, vocab_size=args.vocab_size, max_seq_len=max(args.contexts) + 64)
    torch.manual_seed(0)
    model = LlamaModel(cfg)
    with torch.no_grad():
        for prm in model.parameters():
            prm.normal_(0.0, 0.02)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def fill_cache(cache, seq_id: int, context: int, device, dtype, seed: int = 0):
    """Append ``context`` tokens of random K/V to every layer (what a prefill would leave, minus its cost)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    chunk = 8192
    for start in range(0, context, chunk):
        n = min(chunk, context - start)
        slots = cache.extend([seq_id], n)
        for li in range(cache.num_layers):
            k = torch.randn(n, cache.num_kv_heads, cache.head_dim, generator=g).to(device=device, dtype=dtype)
            v = torch.randn(n, cache.num_kv_heads, cache.head_dim, generator=g).to(device=device, dtype=dtype)
            cache.write(li, slots, k, v)


def attention_share(runtime, cache, seq_id, token) -> float:
    """Share of one decode step's op time spent in tinyattn ops (attention + selection), from the profiler."""
    import tinyattn.profiler as tp

    with tp.profile(oracle=False) as prof:
        t0 = time.perf_counter()
        runtime.decode(cache, [seq_id], [token])
        wall = time.perf_counter() - t0
    ops_us = sum(r.duration_us for r in prof.records)
    return ops_us / (wall * 1e6) if wall > 0 else float("nan")


def run(args) -> list[dict]:
    from tinyattn.models import LlamaRuntime

    device = C.setup(args)
    dtype = C.DTYPES[args.dtype]
    model = build_model(args, device, dtype)
    cfg = model.config
    n_params = sum(p.numel() for p in model.parameters())
    K = args.budget // args.page_size
    print(f"# end-to-end decode on {C.machine_name(args.device)}; LLaMA dim={cfg.dim} layers={cfg.n_layers} "
          f"heads={cfg.n_heads}/{cfg.n_kv_heads} head_dim={cfg.head_dim} hidden={cfg.hidden_dim} "
          f"vocab={cfg.vocab_size} ({n_params / 1e6:.0f}M params, random) {args.dtype}; "
          f"sparse budget {args.budget} tokens, page {args.page_size}")
    dense_rt = LlamaRuntime(model, page_size=args.page_size, page_budget=None, backend=args.backend)
    sparse_rt = LlamaRuntime(model, page_size=args.page_size, page_budget=K, backend=args.backend)
    rows = []
    for L in args.contexts:
        total_steps = 2 * (args.steps + args.warmup) + 2
        cache = dense_rt.new_cache([L + total_steps])
        sid = cache.add_sequence()
        fill_cache(cache, sid, L, device, dtype)
        idle = C.wait_quiet(args.wait_quiet) if device.type == "cpu" else 1.0
        times = {"dense": [], "sparse": []}
        token = 1
        for i in range(args.steps + args.warmup):
            for mode, rt in (("dense", dense_rt), ("sparse", sparse_rt)):
                C.synchronize(device)
                t0 = time.perf_counter()
                logits = rt.decode(cache, [sid], [token])
                token = int(logits[0].argmax())                     # a host sync, as in generation
                dt = time.perf_counter() - t0
                if i >= args.warmup:
                    times[mode].append(dt)
        shares = {mode: attention_share(rt, cache, sid, token) for mode, rt in
                  (("dense", dense_rt), ("sparse", sparse_rt))}
        dense_ms = statistics.median(times["dense"]) * 1e3
        sparse_ms = statistics.median(times["sparse"]) * 1e3
        from tinyattn import metrics

        elem = torch.empty((), dtype=dtype).element_size()
        kv_bytes = metrics.dense_bytes(L, cfg.head_dim, elem) * cfg.n_kv_heads * cfg.n_layers   # a dense step's K/V
        row = dict(context=L, budget_tokens=args.budget, dense_ms=dense_ms, sparse_ms=sparse_ms,
                   dense_tok_s=1e3 / dense_ms, sparse_tok_s=1e3 / sparse_ms, speedup=dense_ms / sparse_ms,
                   dense_attn_share=shares["dense"], sparse_attn_share=shares["sparse"], kv_bytes=kv_bytes,
                   params=n_params, idle_before=idle, device=args.device, dtype=args.dtype)
        rows.append(row)
        print(f"  L={C.fmt_tokens(L):>5}: dense {dense_ms:8.2f} ms/token ({row['dense_tok_s']:6.1f} tok/s), "
              f"sparse {sparse_ms:8.2f} ms/token ({row['sparse_tok_s']:6.1f} tok/s), x{row['speedup']:.2f}; "
              f"attention ops {shares['dense']:.0%} of the dense step, {shares['sparse']:.0%} of the sparse one")
        del cache
    return rows


def plot(rows, args, path: Path) -> None:
    if (made := C.new_figure(rows, figsize=(7.5, 4.5))) is None:
        return
    plt, fig, ax = made
    xs = [r["context"] for r in rows]
    ax.plot(xs, [r["dense_tok_s"] for r in rows], "o-", label="dense decode")
    ax.plot(xs, [r["sparse_tok_s"] for r in rows], "o-", label=f"sparse decode ({args.budget} tokens)")
    for r in rows:
        ax.annotate(f"x{r['speedup']:.2f}", (r["context"], r["sparse_tok_s"]), textcoords="offset points",
                    xytext=(0, 6), ha="center", fontsize=7)
    C.context_axis(ax, xs)
    ax.set_ylabel("decode tokens/s (batch 1)")
    ax.set_title(f"end-to-end decode, LLaMA {args.n_layers} layers, dim {args.dim}, head_dim "
                 f"{args.dim // args.n_heads}, {args.dtype}", fontsize=10)
    ax.legend(fontsize=8)
    C.save_figure(plt, fig, path, C.machine_name(args.device), 8)


def main(argv=None) -> int:
    return C.run_main(argv, parse_args, run, plot, [("context", "context", "d"), ("dense_ms", "dense ms/token", ".2f"),
                         ("sparse_ms", "sparse ms/token", ".2f"), ("dense_tok_s", "dense tok/s", ".1f"),
                         ("sparse_tok_s", "sparse tok/s", ".1f"), ("speedup", "speedup", ".2f"),
                         ("dense_attn_share", "attention share (dense)", ".0%")])


if __name__ == "__main__":
    sys.exit(main())
