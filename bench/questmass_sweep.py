r"""The ``questmass`` policy's ``gamma`` against ``quest`` on real text: hit rate, captured mass, NLL, KL.

Runs :func:`tinyattn.models.evaluate` (teacher-forced sparse decode of the stories260K model shipped with
tinyattn, hit rate and captured mass against the oracle, the long-range and repeat probes) for ``quest`` and
for :class:`tinyattn.selection.QuestMassPolicy` at each ``--gammas`` value, and prints one line per
configuration. ``gamma = 1`` isolates the GQA aggregation (Quest's bound, per-head softmaxes summed over the
group); smaller values also move the estimate from the bound towards the box centre. docs/accuracy.md
reports its output::

    python bench/questmass_sweep.py --gammas 0,0.25,0.5,0.75,1 --page-sizes 8,16 --token-budgets 128
    python bench/questmass_sweep.py --gammas 0.75 --data tinyattn/data/tinystories_sample.txt \
        --min-tokens 250 --max-stories 7 --token-budgets 64,128

The text defaults to the 7 TinyStories validation stories of ``python -m tinyattn eval``; the second command
is the held-out check (other stories than those ``gamma`` was picked on).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:           # run as `python bench/questmass_sweep.py` from a checkout
    sys.path.insert(0, str(ROOT))

from tinyattn.argtypes import positive_int, positive_int_list  # noqa: E402


def _gammas(text: str) -> list[float]:
    try:
        values = [float(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers in [0, 1], got {text!r}") from None
    if not values or not all(0 <= v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers in [0, 1], got {text!r}")
    return values


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gammas", type=_gammas, default=[0.0, 0.25, 0.5, 0.75, 1.0], help="comma-separated, in [0, 1]")
    p.add_argument("--page-sizes", type=positive_int_list, default=[8, 16])
    p.add_argument("--token-budgets", type=positive_int_list, default=[128])
    p.add_argument("--data", type=Path, default=None, help="stories (default: the eval command's 7 stories)")
    p.add_argument("--min-tokens", type=positive_int, default=1,
                   help="keep only the stories of at least this many tokens (BOS included), before --max-stories")
    p.add_argument("--max-stories", type=positive_int, default=None)
    p.add_argument("--max-context", type=positive_int, default=None, help="tokens per story (default: 512)")
    p.add_argument("--no-quest", action="store_true", help="skip the quest rows")
    p.add_argument("--json", type=Path, default=None, help="write the rows as JSON")
    args = p.parse_args(argv)

    import torch

    from tinyattn import assets
    from tinyattn.models import LlamaModel, Tokenizer, load_stories
    from tinyattn.models.evaluate import evaluate
    from tinyattn.selection import QuestMassPolicy

    torch.set_num_threads(1)                 # stories260K's ops are too small to split
    model = LlamaModel.from_llama2c(assets.default_model_path())
    tok = Tokenizer(assets.default_tokenizer_path())
    stories = [s for s in load_stories(args.data or assets.default_text_path())
               if len(tok.encode(s, bos=True)) >= args.min_tokens][:args.max_stories]
    if not stories:
        raise SystemExit(f"no story of at least --min-tokens={args.min_tokens} tokens")
    rows = []
    for gamma in ([None] if not args.no_quest else []) + args.gammas:
        policy = "quest" if gamma is None else QuestMassPolicy(gamma=gamma)
        result = evaluate(model, tok, stories, page_sizes=args.page_sizes, token_budgets=args.token_budgets,
                          policies=[policy], backend="torch", max_context=args.max_context,
                          progress=False)
        for r in result.rows[1:]:
            row = dict(policy=r.policy, gamma=gamma, page_size=r.page_size, token_budget=r.token_budget,
                       nll=r.nll, dense_nll=result.dense.nll, kl=r.kl, top1_agreement=r.top1_agreement,
                       hit_rate=r.hit_rate, captured_mass=r.captured_mass, long_range_nll=r.long_range_nll,
                       repeat_nll=r.repeat_nll)
            rows.append(row)
            label = "quest" if gamma is None else f"questmass gamma={gamma:g}"
            print(f"{label:24s} page_size={r.page_size:<3d} tokens={r.token_budget:<4d} NLL {r.nll:.4f} "
                  f"(dense {result.dense.nll:.4f})  KL {r.kl:.5f}  top-1 agreement {r.top1_agreement:.2%}  "
                  f"hit rate {r.hit_rate:.2%}  captured mass {r.captured_mass:.1%}  "
                  f"long-range NLL {r.long_range_nll:.4f}  repeat NLL {r.repeat_nll:.4f}", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
