"""Passkey retrieval on SmolLM2-135M-Instruct (dequantized Q4_1): depth x context x budget grids per policy and
per recipe (sink pages + dense first layers), one dense prefill per (context, depth, sample) shared by every
configuration.

For each context (largest first, so the 8K table lands first) and each batch of samples: the whole prompt,
question included, is prefilled densely once (:func:`tinyattn.retrieval.evaluate.prefill`; Quest's protocol:
prefill is dense, sparsity applies to the decoded tokens), then every (recipe, policy, budget) decodes the answer
greedily from that cache (:func:`tinyattn.retrieval.evaluate.greedy_decode`; the first answer token comes from the
dense prefill's last logits, as in Quest) and the cache is truncated back to the prompt. H2O's statistics come
from the question's tokens, prefilled with an observer attached (``--h2o-prefill question``: observing the whole
8K prefill costs ~3x the prefill on the CPU). ``--question decode`` is the toy harness's protocol instead (the
question is decoded through the sparse path too). The
samples are the harness's (:func:`tinyattn.retrieval.subword_tasks.make_subword_sample`, seeds
:func:`~tinyattn.retrieval.evaluate.sample_seed`), so ``eval --model smollm2 --task passkey`` gives the same
prompts.

Writes, after each context, ``OUT/passkey_<recipe>.json`` / ``.csv`` (the harness's :class:`TaskResult` rows, plus
``pages_attended`` / ``tokens_attended``: the mean pages and tokens attended per (KV head, sparse layer, decode step),
forced pages included, as bench/smollm2_ruler.py counts them: analytically for dense and Quest's fused fixed budget,
from the selections for top-p and other policies) and the harness's heat maps and accuracy-vs-budget curves
(``OUT/<recipe>_*.png``), plus ``OUT/passkey_summary.md``. A ``quest:...:rerank=int4`` label makes the caches keep
4-bit key codes.

    nice -n 5 python bench/smollm2_passkey.py --out docs/smollm2 --contexts 8192,4096,2048,1024 --depths 10
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from common import (RECIPES, AttendedCounter, attended_means, needs_key_codes,  # recipes: sink / dense / recent pages
                    policy_from_label, selection_from_label)
from tinyattn.retrieval.evaluate import TASK_FIELDS, TaskResult, TaskRow

#: the CSV columns: the harness's, then the attended means (older result files lack them: read back as None)
PASSKEY_FIELDS = TASK_FIELDS + ("pages_attended", "tokens_attended")


@dataclass(frozen=True)
class PasskeyRow(TaskRow):
    """A :class:`TaskRow` with the mean pages and tokens attended per (KV head, sparse layer, decode step) over its
    samples (``None`` in files written before they were recorded)."""

    pages_attended: float | None = None
    tokens_attended: float | None = None

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in PASSKEY_FIELDS}


class PasskeyResult(TaskResult):
    """:class:`TaskResult` of :class:`PasskeyRow` rows: the CSV and JSON carry :data:`PASSKEY_FIELDS`; reads back
    files with or without the attended columns."""

    csv_fields = PASSKEY_FIELDS

    @classmethod
    def load_json(cls, path) -> "PasskeyResult":
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        return cls(rows=[PasskeyRow(**r) for r in data["rows"]], options=data.get("meta", {}))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("docs/smollm2"))
    p.add_argument("--contexts", default="8192,4096,2048,1024")
    p.add_argument("--depths", type=int, default=10, help="depths evenly spaced in [0, 1] (default 10)")
    p.add_argument("--samples", type=int, default=1, help="samples per (context, depth)")
    p.add_argument("--budgets", default="1/8,1/16,1/32,1/64")
    p.add_argument("--policies", default="dense,quest,questmass,oracle,streaming,h2o",
                   help="comma-separated labels name or name:key=value:... (e.g. quest:gamma=0.25 or "
                        "quest:gamma=0.25:top_p=0.9: the quest selection's box estimate and top-p budget, "
                        "SparsityConfig's gamma / top_p; quest:gamma=0.25:top_p=0.8:rerank=int4 or "
                        "quest:gamma=0.25:rerank=int4:candidates=2: the re-rank of the candidates by 4-bit key codes, "
                        "SparsityConfig's rerank / candidates, the caches then keep the codes; questmass:gamma=0.5: "
                        "questmass's own argument)")
    p.add_argument("--recipes", default="default,sink1_dense2", help=f"any of {', '.join(RECIPES)}")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--batch", type=int, default=5, help="samples decoded together (KV memory: batch x context)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--backend", choices=["torch", "triton"], default=None,
                   help="tinyattn's attention backend (default: by device: torch on the CPU, triton on CUDA; "
                        "TRITON_INTERPRET=1 makes it the slow Triton interpreter on the CPU)")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--question", choices=["prefill", "decode"], default="prefill",
                   help="prefill: the question is part of the dense prefill, only the answer is decoded (Quest's "
                        "protocol, default); decode: the question is decoded through each configuration (the toy "
                        "harness's protocol)")
    p.add_argument("--h2o-prefill", choices=["observe", "question", "skip"], default="question",
                   help="what H2O observes of the dense prefill: observe = all of it (the harness's way; ~3x the "
                        "prefill's cost on the CPU); question = the question's tokens only (default); skip = "
                        "nothing (its statistics then come from decoded tokens only)")
    p.add_argument("--depth-part", default="1/1", metavar="I/N",
                   help="run only the I-th of N interleaved slices of the depths (to split a run over processes; "
                        "merge with --merge)")
    p.add_argument("--merge", default=None, metavar="DIR1,DIR2,...",
                   help="merge the passkey_<recipe>.json of these output folders into --out (tables, plots) and exit")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from tqdm.auto import tqdm

    from tinyattn.layer import PagedAttention, SparsityConfig
    from tinyattn.models import sources
    from tinyattn.retrieval.evaluate import (greedy_decode, page_budget_for, parse_fraction, prefill, sample_seed,
                                             _prefill_length)
    from tinyattn.retrieval.report import format_task_table, plot_task_results
    from tinyattn.retrieval.subword_tasks import make_subword_sample
    from tinyattn.selection import H2OPolicy

    if args.merge:
        return _merge(args)
    model, tok = sources.load_model(args.model), sources.load_tokenizer(args.model)
    newline = tok.encode("\n", bos=False)[0]
    contexts = [int(c) for c in args.contexts.split(",")]
    depths = [i / (args.depths - 1) for i in range(args.depths)] if args.depths > 1 else [0.5]
    part, parts = (int(x) for x in args.depth_part.split("/"))
    depths = depths[part - 1::parts]
    fractions = [parse_fraction(b) for b in args.budgets.split(",")]
    policies = args.policies.split(",")
    recipes = {r: RECIPES[r] for r in args.recipes.split(",")}
    ps = args.page_size
    key_codes = needs_key_codes(policies)               # 4-bit key codes beside the pool only for a re-rank
    args.out.mkdir(parents=True, exist_ok=True)
    rows: dict[str, list] = {r: [] for r in recipes}
    t_start = time.perf_counter()
    log = []
    for context in contexts:
        items = []
        for depth in depths:
            for i in range(args.samples):
                s = make_subword_sample("passkey", context_tokens=context, depth=depth, tokenizer=tok,
                                        seed=sample_seed(0, "passkey", context, depth, i))
                n_q = _prefill_length(s, "passkey", "question", newline)         # where the question starts
                items.append((depth, s, n_q, len(s.prompt) if args.question == "prefill" else n_q))
        configs = []
        for rname, recipe in recipes.items():
            for pol in policies:
                if pol == "dense":
                    continue
                for f in fractions:
                    budget = page_budget_for(context, ps, f, num_sink_pages=recipe["num_sink_pages"],
                                             num_recent_pages=recipe["num_recent_pages"])
                    configs.append((pol, f, budget, rname))
        configs.insert(0, ("dense", None, None, None))
        tally: dict[tuple, list] = {}
        bar = tqdm(total=len(items) * (1 + len(configs)), desc=f"passkey {context}", unit="sample-config")
        t_ctx = time.perf_counter()
        for start in range(0, len(items), args.batch):
            batch = items[start:start + args.batch]
            prompts = [list(s.prompt) for _, s, _, _ in batch]
            answers = [list(s.answer) for _, s, _, _ in batch]
            n_pre = [n for _, _, _, n in batch]
            cache = model.new_cache(page_size=ps, num_pages=sum(-(-(len(q) + len(a)) // ps)
                                                                for q, a in zip(prompts, answers)),
                                    key_codes=key_codes)
            sids = [cache.add_sequence() for _ in batch]
            observer = H2OPolicy()
            watch = PagedAttention(SparsityConfig(page_budget=1, num_recent_pages=1, policy=observer),
                                   backend=args.backend)
            plain = PagedAttention(None, backend=args.backend)
            observe = "h2o" in policies and args.h2o_prefill != "skip"
            first = []
            for sid, q, (_, _, n_q, n) in zip(sids, prompts, batch):
                # plainly up to `split`, then with H2O's observer attached: all, the question only, or nothing
                split = min({"observe": 0, "question": n_q, "skip": n}[args.h2o_prefill] if observe else n, n)
                for start, end, att in ((0, split, plain), (split, n, watch)):
                    if end > start:
                        logits = prefill(model, cache, sid, q[start:end], attention=att)
                first.append(logits)
                bar.update(1)
            first = torch.stack(first)
            for c in configs:
                pol, frac, budget, rname = c
                if pol == "dense":
                    att = PagedAttention(None, backend=args.backend)
                else:
                    policy = copy.deepcopy(observer) if pol == "h2o" else policy_from_label(pol)
                    att = PagedAttention(SparsityConfig(page_budget=budget, policy=policy, **recipes[rname],
                                                        **selection_from_label(pol)), backend=args.backend)
                counter = AttendedCounter(ps)               # pages / tokens attended, as the RULER bench counts
                counted = counter.hook(att)
                feeds = [q[n:] for q, n in zip(prompts, n_pre)]
                got = greedy_decode(model, cache, sids, feeds, [len(a) for a in answers], attention=att,
                                    first_logits=first)
                for sid, n in zip(sids, n_pre):
                    cache.truncate(sid, n)
                for (depth, *_), g, a, sid, n, feed in zip(batch, got, answers, sids, n_pre, feeds):
                    # decode steps: each fed token, then each answer token but the last (the first comes from the
                    # prefill's logits when nothing is fed)
                    pages, ntok = attended_means(counter, counted, sid, prompt_len=n, steps=len(feed) + len(g) - 1,
                                                 page_budget=budget)
                    t = tally.setdefault((c, depth), [0, 0.0, 0, 0.0, 0.0, 0])
                    t[0] += g == a
                    t[1] += sum(x == y for x, y in zip(g, a)) / len(a)
                    t[2] += 1
                    if pages is not None:
                        t[3] += pages
                        t[4] += ntok
                        t[5] += 1
                bar.update(len(batch))
            del cache
        bar.close()
        log.append({"context": context, "seconds": round(time.perf_counter() - t_ctx, 1)})
        for rname in recipes:
            for c in configs:
                if c[0] != "dense" and c[3] != rname:
                    continue
                pol, frac, budget = c[:3]
                for depth in depths:
                    e, share, n, pages, ntok, n_att = tally[(c, depth)]
                    rows[rname].append(PasskeyRow(task="passkey", policy=pol, context=context, depth=depth,
                                                  page_size=ps, page_budget=budget,
                                                  budget_fraction=None if frac is None else float(frac),
                                                  token_budget=None if budget is None else budget * ps,
                                                  accuracy=e / n, token_accuracy=share / n, samples=n,
                                                  pages_attended=pages / n_att if n_att else None,
                                                  tokens_attended=ntok / n_att if n_att else None))
        _write(args, recipes, rows, contexts, depths, log, t_start, PasskeyResult, format_task_table,
               plot_task_results)
    return 0


def _write(args, recipes, rows, contexts, depths, log, t_start, TaskResult, format_task_table, plot_task_results):
    summary = ["# Passkey on SmolLM2-135M-Instruct (dequantized Q4_1)\n",
               f"command: `python bench/smollm2_passkey.py {' '.join(f'--{k.replace(chr(95), chr(45))} {v}' for k, v in vars(args).items())}`",
               f"timings: {json.dumps(log)}; total {time.perf_counter() - t_start:.0f} s\n"]
    for rname, recipe in recipes.items():
        result = TaskResult(rows=sorted(rows[rname], key=lambda r: (-r.context, r.depth)),
                            options=dict(model="SmolLM2-135M-Instruct (dequantized Q4_1)", recipe=rname, **recipe,
                                         question=args.question, h2o_prefill=args.h2o_prefill,
                                         page_size=args.page_size, samples=args.samples, depths=depths,
                                         contexts=contexts, seconds=round(time.perf_counter() - t_start, 1)))
        _save(result, args.out / f"passkey_{rname}")
        try:
            _plot(plot_task_results, result, args.out, prefix=f"{rname}_")
        except Exception as exc:                    # a plot failure must not lose the numbers
            print(f"plot failed: {exc}")
        summary += [f"## recipe {rname}: {_fields(recipe)}\n", format_task_table(result), ""]
        summary += attended_table(result)
    (args.out / "passkey_summary.md").write_text("\n".join(summary) + "\n")


def _plot(plot_task_results, result, out: Path, prefix: str) -> None:
    """The heat maps and budget curves; without matplotlib (the plots extra) a note instead."""
    from tinyattn.results_io import have_matplotlib, no_plots_note

    if not have_matplotlib():
        print(no_plots_note("the JSON and the summary are written"))
        return
    plot_task_results(result, out, prefix=prefix)


def _merge(args) -> int:
    from tinyattn.retrieval.report import format_task_table, plot_task_results

    dirs = [Path(d) for d in args.merge.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    summary = ["# Passkey on SmolLM2-135M-Instruct (dequantized Q4_1)\n", f"merged from {', '.join(map(str, dirs))}\n"]
    for rname in args.recipes.split(","):
        parts = [PasskeyResult.load_json(d / f"passkey_{rname}.json") for d in dirs
                 if (d / f"passkey_{rname}.json").is_file()]
        if not parts:
            continue
        rows = sorted((r for p in parts for r in p.rows), key=lambda r: (-r.context, r.depth))
        options = dict(parts[0].options, depths=sorted({r.depth for r in rows}))
        result = PasskeyResult(rows=rows, options=options)
        _save(result, args.out / f"passkey_{rname}")
        _plot(plot_task_results, result, args.out, prefix=f"{rname}_")
        summary += [f"## recipe {rname}: {_fields(RECIPES[rname])}\n",
                    format_task_table(result), "", format_task_table(result, "token_accuracy"), ""]
        summary += attended_table(result)
    (args.out / "passkey_summary.md").write_text("\n".join(summary) + "\n")
    return 0


def attended_table(result) -> list[str]:
    """Markdown lines: per (page size, context, policy, budget), over the depths (sample-weighted), the mean pages and
    tokens attended per (KV head, sparse layer, decode step) and the accuracy: the budget axis of a top-p cell
    (whose page budget is its capacity). Nothing when no row records them (an older result file)."""
    groups: dict[tuple, list] = {}
    for r in result.rows:
        if getattr(r, "tokens_attended", None) is not None:
            groups.setdefault((r.page_size, r.context, r.policy, r.budget_fraction), []).append(r)
    if not groups:
        return []
    lines = ["Mean pages and tokens attended per (KV head, sparse layer, decode step), forced pages included (a "
             "top-p cell's budget is its capacity), and accuracy over the depths:", "",
             "| page size | context | policy | budget | pages | tokens attended | accuracy |",
             "|---:|---:|---|---|---:|---:|---:|"]
    for (ps, context, pol, f), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], -kv[0][1], kv[0][2] != "dense",
                                                                            -(kv[0][3] or 2.0), kv[0][2])):
        n = sum(r.samples for r in rs)
        mean = lambda name: sum(getattr(r, name) * r.samples for r in rs) / n          # noqa: E731
        budget = "-" if f is None else f"1/{round(1 / f)}" if round(1 / f) == 1 / f else f"{f:g}"
        lines.append(f"| {ps} | {context} | {pol} | {budget} | {mean('pages_attended'):.1f} | "
                     f"{mean('tokens_attended'):.0f} | {100 * mean('accuracy'):.0f}% |")
    return lines + [""]


def _fields(recipe: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in recipe.items())


def _save(result, stem: Path) -> None:
    from tinyattn.results_io import write_result_files

    write_result_files(result, json_path=stem.with_suffix(".json"), csv_path=stem.with_suffix(".csv"))


if __name__ == "__main__":
    raise SystemExit(main())
