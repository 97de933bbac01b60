"""CPU thread settings on a shared machine: the README's first snippet under three settings, in one run.

The README's snippet (one row of 4096 tokens in 256 pages of 16, 32 query / 8 KV heads, head_dim 128, budget 64
pages) is timed in a fresh process per setting, because OpenMP reads its environment when torch loads:

- ``default``: torch's default thread count, no environment set (OpenMP workers spin-wait between regions);
- ``1 thread``: ``torch.set_num_threads(1)``;
- ``PASSIVE``: the default thread count with ``OMP_WAIT_POLICY=PASSIVE`` set before torch is imported (workers
  sleep instead of spinning; what ``python -m tinyattn`` sets for itself).

Per setting: median milliseconds of ``sparse_paged_attention`` (budget 64 pages), dense ``paged_attention`` and
SDPA ``enable_gqa`` on the same keys as a contiguous ``[1, 8, 4096, 128]`` cache; settings interleaved over
``--rounds`` rounds (one process per setting per round), the median of the rounds' medians reported. Figures
depend on what else runs on the machine: say so beside them.

    python bench/cpu_threads.py                 # prints a Markdown table; ~1 min
    python bench/cpu_threads.py --csv out/bench/cpu_threads.csv
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

SETTINGS = {"default": ({}, None), "1 thread": ({}, 1), "PASSIVE": ({"OMP_WAIT_POLICY": "PASSIVE"}, None)}

CHILD = r"""
import json, statistics, sys, time
import torch, torch.nn.functional as F
import tinyattn
threads = json.loads(sys.argv[1])
if threads is not None:
    torch.set_num_threads(threads)
torch.manual_seed(0)
k_cache, v_cache = torch.randn(256, 16, 8, 128), torch.randn(256, 16, 8, 128)
block_table = torch.randperm(256, dtype=torch.int32)[None]
seq_lens = torch.tensor([4096], dtype=torch.int32)
k_min, k_max = torch.empty(256, 8, 128), torch.empty(256, 8, 128)
tinyattn.update_page_metadata(k_cache, block_table, seq_lens, k_min, k_max)
q = torch.randn(1, 32, 128)
k = k_cache[block_table[0].long()].reshape(4096, 8, 128).transpose(0, 1)[None].contiguous()
v = v_cache[block_table[0].long()].reshape(4096, 8, 128).transpose(0, 1)[None].contiguous()
calls = {
    "sparse": lambda: tinyattn.sparse_paged_attention(q, k_cache, v_cache, block_table, seq_lens, k_min=k_min,
                                                      k_max=k_max, page_budget=64),
    "dense": lambda: tinyattn.paged_attention(q, k_cache, v_cache, block_table, seq_lens),
    "sdpa": lambda: F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True),
}
out = {"threads": torch.get_num_threads()}
for name, f in calls.items():
    for _ in range(3):
        f()
    times = []
    for _ in range(int(sys.argv[2])):
        t0 = time.perf_counter(); f(); times.append(time.perf_counter() - t0)
    out[name] = statistics.median(times) * 1e3
print(json.dumps(out))
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="processes per setting (interleaved)")
    ap.add_argument("--iters", type=int, default=30, help="timed calls per op and process")
    ap.add_argument("--csv", default=None, help="also write the table as CSV here")
    args = ap.parse_args(argv)
    # the torch backend on CPU tensors, as a user runs it (no TRITON_INTERPRET), and no inherited thread settings
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "TRITON_INTERPRET")}
    runs = {name: [] for name in SETTINGS}
    for _ in range(args.rounds):
        for name, (env, threads) in SETTINGS.items():
            res = subprocess.run([sys.executable, "-c", CHILD, json.dumps(threads), str(args.iters)],
                                 env={**base, **env}, capture_output=True, text=True, check=True)
            runs[name].append(json.loads(res.stdout.strip().splitlines()[-1]))
    rows = []
    for name, rs in runs.items():
        rows.append([name, rs[0]["threads"]] + [statistics.median(r[op] for r in rs) for op in ("sparse", "dense",
                                                                                                 "sdpa")])
    print(f"os.cpu_count()={os.cpu_count()}, load average {os.getloadavg()[0]:.1f} at the end\n")
    print("| setting | threads | sparse_paged_attention (ms) | paged_attention (ms) | SDPA enable_gqa (ms) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]:.2f} | {r[3]:.2f} | {r[4]:.2f} |")
    if args.csv:
        os.makedirs(os.path.dirname(args.csv) or ".", exist_ok=True)
        with open(args.csv, "w", encoding="utf-8") as f:
            f.write("setting,threads,sparse_ms,dense_ms,sdpa_ms\n")
            for r in rows:
                f.write(f"{r[0]},{r[1]},{r[2]:.3f},{r[3]:.3f},{r[4]:.3f}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
