"""Old vs new package in one process: a decode step of each, interleaved with SDPA, on the CPU.

On a shared machine two runs minutes apart differ by 2x; two packages timed in the same process, call after call,
see the same machine. This script copies the package at a git revision (``--old``, default ``HEAD~1``) into a
temporary folder as ``tinyattn_old`` (its ``tinyattn`` imports renamed), and times, interleaved: SDPA in its
fastest CPU form (query heads folded into the rows of their KV head, contiguous cache), then dense
``paged_attention`` and sparse ``sparse_paged_attention`` of both packages, with value checks on (as users call
them). Prints medians and the new / old speedups.

Example::

    python bench/ab_revisions.py --old ac35184 --contexts 32K --threads 1 --repeats 15
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import common as C  # noqa: E402


def parse_args(argv=None):
    p = C.script_parser(__doc__, "ab_revisions", "comma-separated contexts, K = 1024 (default: 32K)")
    p.add_argument("--old", default="HEAD~1", help="git revision of the old package (default: HEAD~1)")
    p.add_argument("--budget", type=int, default=2048, help="sparse budget in tokens (default: 2048)")
    C.add_head_args(p)
    args = p.parse_args(argv)
    if args.quick:
        args.contexts = args.contexts or [512]
        args.budget = 128
        C.quick_heads(args)
    args.contexts = args.contexts or [32768]
    C.default_repeats(args)
    return args


def import_old(revision: str, folder: Path):
    """The package at ``revision`` imported as ``tinyattn_old`` from ``folder``."""
    archive = subprocess.run(["git", "-C", str(C.ROOT), "archive", revision, "tinyattn"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    (folder / "tinyattn").rename(folder / "tinyattn_old")
    for path in (folder / "tinyattn_old").rglob("*.py"):
        path.write_text(re.sub(r"\btinyattn\b", "tinyattn_old", path.read_text()))
    sys.path.insert(0, str(folder))
    import tinyattn_old
    return tinyattn_old


def run(args) -> list[dict]:
    import tinyattn

    device = C.setup(args)
    tmp = tempfile.TemporaryDirectory()
    old = import_old(args.old, Path(tmp.name))
    B, Hq, Hkv, D, S = args.batch, args.num_q_heads, args.num_kv_heads, args.head_dim, args.page_size
    print(f"# old ({args.old}) vs new package on {C.machine_name('cpu')}; B={B} Hq={Hq} Hkv={Hkv} D={D} page {S}")
    rows = []
    for L in args.contexts:
        p = C.make_decode_problem(batch=B, context=L, num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D, page_size=S,
                                  dtype=torch.float32, device=device)
        q_fold = p.q.view(B, Hkv, Hq // Hkv, D)
        args_ = (p.q, p.k_cache, p.v_cache, p.block_table, p.seq_lens)
        sparse = dict(k_min=p.k_min, k_max=p.k_max, page_budget=max(args.budget // S, 1))
        methods = {"sdpa": lambda: F.scaled_dot_product_attention(q_fold, p.k_dense, p.v_dense)}
        for tag, pkg in (("old", old), ("new", tinyattn)):
            methods[f"dense_{tag}"] = lambda pkg=pkg: pkg.paged_attention(*args_)
            methods[f"sparse_{tag}"] = lambda pkg=pkg: pkg.sparse_paged_attention(*args_, **sparse)
        with torch.no_grad():
            for kind in ("dense", "sparse"):         # both packages give the same answer
                torch.testing.assert_close(methods[f"{kind}_new"](), methods[f"{kind}_old"](), atol=1e-4, rtol=1e-4)
            res = C.time_methods(methods, device=device, repeats=args.repeats, warmup=args.warmup)
        base = res["sdpa"]["median_us"]
        for name, r in res.items():
            kind = name.split("_")[0]
            vs_old = res[f"{kind}_old"]["median_us"] / r["median_us"] if kind != "sdpa" else float("nan")
            rows.append(dict(context=L, method=name, time_us=r["median_us"], x_sdpa=base / r["median_us"],
                             new_over_old=vs_old if name.endswith("_new") else float("nan"),
                             threads=args.threads, revision_old=args.old))
    tmp.cleanup()
    return rows


def main(argv=None) -> int:
    return C.run_main(argv, parse_args, run, lambda *a: None,
                      [("context", "context", "d"), ("method", "method", ""), ("time_us", "time (us)", ".1f"),
                       ("x_sdpa", "x SDPA folded", ".2f"), ("new_over_old", "new / old speedup", ".2f")])


if __name__ == "__main__":
    sys.exit(main())
