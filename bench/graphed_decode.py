"""Model decode step, eager vs replayed as a CUDA graph (``LlamaRuntime(cuda_graphs=True)``).

The LLaMA-shaped model of ``bench/e2e_decode.py`` (random weights; ``dim 1024``, 4 layers, GQA 8/2, ``head_dim``
128), ``B`` sequences whose caches are filled to ``L`` tokens with random K/V, Quest at ``--budget`` tokens. For each
``(B, L)``: ``--steps`` eager steps (:meth:`LlamaRuntime.decode`), then the same number of steps through
:class:`tinyattn.models.graphs.DecodeGraphs` (the first one captures, untimed; the others replay, host bookkeeping
included). Each step is timed from its call to ``torch.cuda.synchronize()``; medians in ms, and the speed-up.

    python bench/graphed_decode.py --out out/gpu                      # CUDA only
    python bench/graphed_decode.py --contexts 4K,32K --batches 1,8 --steps 20

Written in a session without a GPU: never run yet (figures: none).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import common as C  # noqa: E402


def time_steps(step, n: int) -> list[float]:
    """``n`` calls of ``step()``, each timed to a device synchronize (ms)."""
    out = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        out.append(1e3 * (time.perf_counter() - t0))
    return out


def run_point(model, B: int, L: int, args, dtype) -> dict:
    import e2e_decode as E

    from tinyattn.models import LlamaRuntime
    from tinyattn.models.graphs import DecodeGraphs

    S = args.page_size
    most = L + 2 * args.steps + 4                                # tokens per row at the end (eager + graphed steps)
    max_pages = -(-most // S)
    cache = model.new_cache(page_size=S, num_pages=B * max_pages + 1)
    ids = [cache.add_sequence() for _ in range(B)]
    for b, sid in enumerate(ids):
        E.fill_cache(cache, sid, L, model.device, dtype, seed=b)
    rt = LlamaRuntime(model, page_size=S, page_budget=args.budget // S)
    tokens = [1] * B
    rt.decode(cache, ids, tokens)                                # warm-up: compiles the eager kernels
    eager = time_steps(lambda: rt.decode(cache, ids, tokens), args.steps)
    graphs = DecodeGraphs(model, cache, rt.sparsity, max_batch=B, max_pages_per_seq=max_pages)
    graphs.step(ids, tokens)                                     # eager on a side stream + capture
    graphed = time_steps(lambda: graphs.step(ids, tokens), args.steps)
    e, g = statistics.median(eager), statistics.median(graphed)
    return dict(batch=B, context=L, budget_tokens=args.budget, eager_ms=round(e, 4), graphed_ms=round(g, 4),
                speedup=round(e / g, 2), replays=graphs.replays)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="4K,32K", help="context lengths L (default 4K,32K)")
    ap.add_argument("--batches", default="1,8", help="batch sizes B (default 1,8)")
    ap.add_argument("--budget", type=int, default=2048, help="Quest token budget (default 2048)")
    ap.add_argument("--page-size", type=int, default=16, help="tokens per page (default 16)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per mode (default 20)")
    ap.add_argument("--dtype", choices=sorted(C.DTYPES), default="bf16", help="model and cache dtype (default bf16)")
    ap.add_argument("--out", type=Path, default=None, help="folder for graphed_decode.csv (default: print only)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("graphed_decode: needs a CUDA GPU (CUDA graphs); nothing run", file=sys.stderr)
        return 1
    import e2e_decode as E

    dtype = C.DTYPES[args.dtype]
    contexts, batches = C.parse_sizes(args.contexts), C.parse_sizes(args.batches)
    margs = E.parse_args([])
    margs.contexts = [max(contexts) + 2 * args.steps + 8]
    model = E.build_model(margs, torch.device("cuda"), dtype)
    rows = [run_point(model, B, L, args, dtype) for B in batches for L in contexts]
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype}, decode step of the "
          f"e2e_decode model, Quest {args.budget} tokens")
    print("| B | context | eager ms | graphed ms | speed-up |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['context']} | {r['eager_ms']:.3f} | {r['graphed_ms']:.3f} | {r['speedup']:.2f}x |")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        C.write_csv(args.out / "graphed_decode.csv", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
