"""RULER on SmolLM2-135M-Instruct (dequantized Q4_1): every selection policy x budget on the same lm-eval samples,
one dense prefill per sample (Quest's protocol, as bench/smollm2_passkey.py), scored by RULER's metric.

Samples, prompts and scores are lm-eval's (:mod:`tinyattn.retrieval.ruler`: the registered RULER tasks of
lm-evaluation-harness 0.4.13, sized by the model's own tokenizer, drawn after ``random.seed(--seed)``; essay tasks
with the shipped public-domain Book of Mormon excerpt as the haystack). Per (task, context) the first ``--samples``
samples are stored in ``OUT/samples/<task>_<context>.jsonl.xz`` on first use and read back by every later run.

Per batch of samples: each prompt is prefilled densely once (:func:`tinyattn.retrieval.evaluate.prefill`; H2O's
observer watches the whole prompt, as in H2O, ``--h2o-prefill``), then every policy x budget missing from the results
decodes greedily from that cache (:func:`tinyattn.retrieval.evaluate.greedy_decode`; the first answer token comes
from the dense prefill, as in Quest) through ``tinyattn.layer.PagedAttention(SparsityConfig(page_budget=...,
policy=...))`` with the library's default recipe (one sink page from 16 pages, one recent page, no dense layer),
and the cache is truncated back to the prompt. ``--stock`` also runs stock transformers' greedy ``generate`` on
the same token ids (one more prefill per sample): the reference the dense cell must equal.

Results are JSON lines, one per (sample, cell), appended to ``OUT/results/<task>_<context>.jsonl`` as each cell
finishes; a rerun skips the cells already there (so new policies, budgets or samples add cells to the same
samples). ``--report`` only rebuilds ``OUT/summary.md``, ``OUT/cells.csv``, ``OUT/ruler.png`` (accuracy vs page budget)
and ``OUT/pareto.png`` (accuracy vs mean tokens attended, the top-p budget's axis) from the results.
``--diagnose`` replays quest's misses (and as many of its hits) with the needle's pages ranked by Quest's bound and
by the oracle's true attention mass per layer and KV head (``OUT/diagnosis/``). ``--lm-eval N`` runs lm-eval's own
``simple_evaluate`` (its Hugging Face model, stock transformers) on the first N stored samples (``OUT/lm_eval/``).

    nice -n 10 python bench/smollm2_ruler.py --tasks niah_single_1 --contexts 2048 --samples 50 --stock all
    python bench/smollm2_ruler.py --report
"""

from __future__ import annotations

import argparse
import copy
import fcntl
import json
import time
from collections import defaultdict
from fractions import Fraction
from pathlib import Path

import torch

from common import (ROOT, AttendedCounter, analytic_attended, attended_means, needs_key_codes,  # noqa: F401
                    policy_from_label, pyplot, selection_from_label, write_csv)
from tinyattn.selection import SelectionPolicy

DEFAULT_OUT = ROOT / "docs" / "ruler"
STOCK = "hf_stock"          # the cell of stock transformers' generate
DENSE = "dense"
#: new tokens per task when --max-new-tokens is 0: a 7-digit needle is 8 SmolLM2 tokens after the answer's leading
#: space, a UUID 36; vt / cwe / fwe keep lm-eval's max_gen_toks (30 / 120 / 50)
NEW_TOKENS = {"niah_single_3": 48, "niah_multikey_3": 48, "vt": 30, "cwe": 120, "fwe": 50}
NEW_TOKENS_DEFAULT = 16


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: docs/ruler of the checkout)")
    p.add_argument("--model", default="smollm2",
                   help="a tinyattn model source: 'smollm2', a llama GGUF or a Hugging Face folder (default: smollm2); "
                        "its Hugging Face folder's tokenizer sizes and encodes the samples")
    p.add_argument("--tasks", default="niah_single_1",
                   help="comma-separated RULER tasks (tinyattn.retrieval.ruler.TASKS; default: niah_single_1)")
    p.add_argument("--contexts", default="2048", help="comma-separated RULER lengths in tokens (default: 2048)")
    p.add_argument("--samples", type=int, default=50, help="samples per (task, context): the first N (default: 50)")
    p.add_argument("--policies", default="dense,quest,questmass,oracle,streaming,h2o",
                   help="comma-separated: 'dense' and names of tinyattn.selection.POLICIES, each optionally with "
                        "constructor arguments as name:key=value:key=value (e.g. questmass:gamma=1.0); quest takes "
                        "the selection settings gamma, top_p, rerank and candidates (tinyattn.SparsityConfig's, e.g. "
                        "quest:gamma=0.25, quest:gamma=0.25:top_p=0.9 (the pages top_p kept are counted), "
                        "quest:gamma=0.25:top_p=0.8:rerank=int4 (top_p over the mass re-ranked from 4-bit key codes, "
                        "which the cache then keeps) or quest:gamma=0.25:rerank=int4:candidates=2 (the re-rank's "
                        "candidates: 2 x the budget)); default: dense,quest,questmass,oracle,streaming,h2o")
    p.add_argument("--budgets", default="1/8,1/16,1/32,1/64",
                   help="page budgets as fractions of the context's pages (of --contexts, the RULER length; "
                        "default: 1/8,1/16,1/32,1/64)")
    p.add_argument("--dense-only-tasks", default="niah_multikey_1,niah_multikey_2,niah_multikey_3,niah_multivalue,"
                   "niah_multiquery,vt,cwe,fwe",
                   help="tasks run with the dense policy (and --stock) only: the model's ceiling (default: all but the "
                        "single-needle tasks)")
    p.add_argument("--stock", default="all", metavar="all|none|N",
                   help="run stock transformers' greedy generate on all samples, none, or the first N of each "
                        "(task, context) (default: all)")
    p.add_argument("--max-new-tokens", type=int, default=0,
                   help=f"greedy tokens per answer; 0 (default): {NEW_TOKENS_DEFAULT}, or per task {NEW_TOKENS}")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV-cache page (default: 16, Quest's)")
    p.add_argument("--batch", type=int, default=4, help="samples prefilled and decoded together (default: 4)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    p.add_argument("--backend", choices=["torch", "triton"], default="torch",
                   help="tinyattn's attention backend (default: torch; triton needs CUDA tensors or TRITON_INTERPRET=1, "
                        "where a 30-layer model is very slow)")
    p.add_argument("--seed", type=int, default=0,
                   help="random.seed before lm-eval generates a task's samples (default: 0, simple_evaluate's)")
    p.add_argument("--h2o-prefill", choices=["observe", "question", "skip"], default="observe",
                   help="what the statistics of stateful policies (H2O) observe of the dense prefill: the whole prompt "
                        "(default; H2O's accumulated attention; ~3-4x the prefill's cost on the CPU), the question "
                        "only (the tokens after the prompt's last newline: a query-aware window, not H2O's rule), or "
                        "nothing")
    p.add_argument("--stateful-samples", type=int, default=0, metavar="N",
                   help="run the stateful policies' cells (H2O) on the first N samples of each (task, context) only "
                        "(their observed prefill is the costly part); 0 (default): all")
    p.add_argument("--report", action="store_true", help="only rebuild summary.md, cells.csv, ruler.png and pareto.png from OUT")
    p.add_argument("--diagnose", type=int, default=0, metavar="N",
                   help="replay up to N of quest's misses (and N hits) per (task, context, budget) of the results "
                        "with the needle's page ranks per layer / KV head (OUT/diagnosis/); 0: off")
    p.add_argument("--lm-eval", type=int, default=0, metavar="N", dest="lm_eval",
                   help="run lm-eval's simple_evaluate (its HF model, stock transformers, lm-eval's own generation "
                        "settings) on the first N stored samples of each (task, context) and compare (OUT/lm_eval/)")
    args = p.parse_args(argv)
    args.task_list = [t for t in args.tasks.split(",") if t]
    args.context_list = [int(c) for c in args.contexts.split(",") if c]
    args.policy_list = [x for x in args.policies.split(",") if x]
    from tinyattn.retrieval.evaluate import parse_fraction          # names the bad value

    args.budget_list = [parse_fraction(b) for b in args.budgets.split(",") if b]
    args.dense_only = set(args.dense_only_tasks.split(","))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.report:
        return report(args.out)
    if args.lm_eval:
        return lm_eval_reference(args)
    if args.diagnose:
        return diagnose(args)
    run(args)
    return report(args.out)


# ---------------------------------------------------------------------------------------------- samples
def hf_folder(model: str) -> Path:
    from tinyattn.models import sources

    return sources.hf_checkpoint(model)


def get_samples(out: Path, task: str, context: int, n: int, folder: Path, seed: int) -> tuple[list[dict], dict]:
    """The first ``n`` samples of (task, context): from ``OUT/samples/`` when stored there (at least ``n``), else
    generated by lm-eval (:func:`tinyattn.retrieval.ruler.load_task`) and stored; a regenerated file must start
    with the samples already stored (same lm-eval, tokenizer and seed)."""
    from tinyattn.retrieval import ruler

    path = out / "samples" / f"{task}_{context}.jsonl.xz"
    old, info = ruler.load_samples(path) if path.is_file() else ([], None)
    if len(old) >= n:
        return old[:n], info
    print(f"generating {task} at {context} tokens with lm-eval (seed {seed})", flush=True)
    lm_task, info = ruler.load_task(task, context, folder, seed=seed)
    new = ruler.task_samples(lm_task, n)
    if [s["prompt"] for s in new[:len(old)]] != [s["prompt"] for s in old]:
        raise RuntimeError(f"{path}: lm-eval generated other samples than the stored ones (another lm-eval, "
                           f"wonderwords or tokenizer?); move the file away to start over")
    ruler.save_samples(path, new, info)
    return new, info


def new_tokens(args, task: str) -> int:
    return args.max_new_tokens or NEW_TOKENS.get(task, NEW_TOKENS_DEFAULT)


# ---------------------------------------------------------------------------------------------- cells
def budget_label(f: Fraction | None) -> str | None:
    return None if f is None else str(f)            # "1/8", "3/16", "1"


def cells_for(args, task: str, context: int) -> list[dict]:
    """The cells of (task, context): ``{"policy", "budget", "page_budget"}`` (dense and stock: no budget)."""
    from tinyattn.retrieval.evaluate import page_budget_for

    cells = []
    if args.stock != "none":
        cells.append({"policy": STOCK, "budget": None, "page_budget": None})
    for label in args.policy_list:
        if label == DENSE:
            cells.append({"policy": DENSE, "budget": None, "page_budget": None})
        elif task not in args.dense_only:
            from tinyattn.layer import SparsityConfig

            # fail early on a bad name, argument or selection setting (SparsityConfig names it; any budget will do:
            # the cells' own are checked when they run)
            SparsityConfig(page_budget=64, policy=policy_from_label(label), **selection_from_label(label))
            for f in args.budget_list:
                cells.append({"policy": label, "budget": budget_label(f),
                              "page_budget": page_budget_for(context, args.page_size, f)})
    return cells


def cell_key(index: int, policy: str, budget, page_size: int, max_new: int) -> tuple:
    return (int(index), policy, budget, int(page_size), int(max_new))


def read_results(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError:              # a line cut by a killed process: that cell is redone
                continue
    return rows


def append_rows(path: Path, rows: list[dict]) -> None:
    """Append result lines under an exclusive lock (two processes may share a results file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write("".join(json.dumps(r) + "\n" for r in rows))
        f.flush()
        fcntl.flock(f, fcntl.LOCK_UN)


# ---------------------------------------------------------------------------------------------- run
def run(args) -> None:
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer

    from tinyattn.models import sources
    from tinyattn.retrieval import ruler

    folder = hf_folder(args.model)
    tok = AutoTokenizer.from_pretrained(str(folder))
    model = hf = None
    for task in args.task_list:
        for context in args.context_list:
            samples, _ = get_samples(args.out, task, context, args.samples, folder, args.seed)
            max_new = new_tokens(args, task)
            path = args.out / "results" / f"{task}_{context}.jsonl"
            done = {cell_key(r["index"], r["policy"], r["budget"], r["page_size"], r["max_new_tokens"])
                    for r in read_results(path)}
            cells = cells_for(args, task, context)
            todo = pending(args, samples, cells, done, max_new)
            total = sum(len(m) for _, m in todo)
            print(f"{task} {context}: {len(samples)} samples, {len(cells)} cells, {total} (sample, cell) to run"
                  f"{'' if total else ' (all done)'}", flush=True)
            if not todo:
                continue
            if model is None:
                model = sources.load_model(args.model)
            if hf is None and any(c["policy"] == STOCK for _, m in todo for c in m):
                hf = load_stock(folder)
            bar = tqdm(total=total, desc=f"{task} {context}", unit="cell")
            for start in range(0, len(todo), args.batch):
                batch = todo[start:start + args.batch]
                log = run_batch(args, model, hf, tok, ruler, task, context, max_new, batch, bar,
                                emit=lambda rows, path=path: append_rows(path, rows))
                append_rows(args.out / "results" / "log.jsonl", [log])
            bar.close()


def pending(args, samples: list[dict], cells: list[dict], done: set, max_new: int) -> list[tuple[dict, list]]:
    """``(sample, its missing cells)`` for the samples with a cell not in ``done``; stock transformers only on the
    first ``--stock`` samples, stateful policies on the first ``--stateful-samples``."""
    n_stock = len(samples) if args.stock == "all" else (0 if args.stock == "none" else int(args.stock))
    n_stateful = args.stateful_samples or len(samples)
    stateful = {c["policy"] for c in cells if c["policy"] not in (DENSE, STOCK)
                and policy_from_label(c["policy"]).stateful}
    todo = []
    for i, s in enumerate(samples):
        missing = [c for c in cells if cell_key(s["index"], c["policy"], c["budget"], args.page_size, max_new)
                   not in done and (c["policy"] != STOCK or i < n_stock)
                   and (c["policy"] not in stateful or i < n_stateful)]
        if missing:
            todo.append((s, missing))
    return todo


def load_stock(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


class Tee(SelectionPolicy):
    """A stateful policy that hands what it observes to each of ``policies`` (one observed prefill feeds them all);
    it never selects (the prefill is dense)."""

    name = "tee"
    stateful = True

    def __init__(self, policies: list):
        self.policies = policies

    def observe(self, ctx, page_indices, page_mass):
        for p in self.policies:
            p.observe(ctx, page_indices, page_mass)

    def select(self, ctx):
        raise RuntimeError("Tee only observes a dense prefill")


def question_start(tok, prompt: str, ids: list[int]) -> int:
    """Index of the first token after the prompt's last newline (RULER's question), from character offsets."""
    cut = prompt.rfind("\n")
    if cut < 0:
        return len(ids)
    offsets = tok(prompt, return_offsets_mapping=True)["offset_mapping"]
    return next((i for i, (a, b) in enumerate(offsets) if a > cut and b > a), len(ids))


def run_batch(args, model, hf, tok, ruler, task, context, max_new, batch, bar, emit):
    """Prefill the batch's prompts once, run each missing cell from that cache; ``emit(rows)`` gets the result rows
    of each stock sample and each cell as soon as they are done (a killed run loses at most one cell). Returns the
    batch's timing log."""
    t0 = time.perf_counter()
    log = {"task": task, "context": context, "samples": [s["index"] for s, _ in batch], "time": time.time()}
    ids = [ruler.prompt_ids(tok, s["prompt"]) for s, _ in batch]

    def row(s, cell, prompt_len, tokens, pages=None, tokens_attended=None, sink=None) -> dict:
        kept, text = ruler.decode_generation(tok, tokens, s["gen_kwargs"])
        return {"task": task, "context": context, "index": s["index"], "policy": cell["policy"],
                "budget": cell["budget"], "page_budget": cell["page_budget"], "num_sink_pages": sink,
                "page_size": args.page_size, "max_new_tokens": max_new, "prompt_tokens": prompt_len,
                "tokens": kept, "text": text, "score": ruler.score(s, text), "pages": pages,
                "tokens_attended": tokens_attended}

    for (s, missing), q in zip(batch, ids):             # stock transformers: its own prefill and decode of the ids
        for cell in missing:
            if cell["policy"] == STOCK:
                emit([row(s, cell, len(q), stock_generate(hf, q, max_new))])
                bar.update(1)
    log["stock_s"] = round(time.perf_counter() - t0, 1)
    sparse_cells = {}                                   # (policy, budget) -> (cell, rows of the batch that miss it)
    for j, (s, missing) in enumerate(batch):
        for cell in missing:
            if cell["policy"] != STOCK:
                sparse_cells.setdefault((cell["policy"], cell["budget"]), (cell, []))[1].append(j)
    if not sparse_cells:
        return log
    t1 = time.perf_counter()
    # 4-bit key codes beside the pool only when a cell of the batch re-ranks (quest:...:rerank=int4): the prefill
    # writes them as pages fill
    cache = model.new_cache(page_size=args.page_size, num_pages=sum(-(-(len(q) + max_new) // args.page_size) + 1
                                                                     for q in ids),
                            key_codes=needs_key_codes(label for label, _ in sparse_cells))
    sids = [cache.add_sequence() for _ in batch]
    observers = {label: policy_from_label(label) for label, _ in sparse_cells
                 if label != DENSE and policy_from_label(label).stateful}
    first = prefill_batch(args, model, tok, cache, sids, [s for s, _ in batch], ids, observers)
    log["prefill_s"] = round(time.perf_counter() - t1, 1)
    log["cells_s"] = {}
    for (label, budget), (cell, rows_j) in sparse_cells.items():
        t2 = time.perf_counter()
        got = decode_cell(args, model, cache, [sids[j] for j in rows_j], [ids[j] for j in rows_j], cell, observers,
                          first[rows_j], max_new)
        emit([row(batch[j][0], cell, len(ids[j]), *g) for j, g in zip(rows_j, got)])
        bar.update(len(rows_j))
        log["cells_s"][f"{label} {budget}"] = round(time.perf_counter() - t2, 1)
    log["total_s"] = round(time.perf_counter() - t0, 1)
    return log


def stock_generate(hf, ids: list[int], max_new: int) -> list[int]:
    """Stock transformers' greedy continuation of ``ids`` (its own prefill and cache; stops at EOS)."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=max_new, do_sample=False, num_beams=1)
    return out[0, len(ids):].tolist()


def prefill_batch(args, model, tok, cache, sids, samples, ids, observers) -> torch.Tensor:
    """Dense prefill of each prompt into ``cache``; the stateful policies in ``observers`` (H2O: one fresh instance
    per label, all fed by one pass through :class:`Tee`) watch the part ``--h2o-prefill`` says. Returns the last
    position's logits ``[B, V]``."""
    from tinyattn.layer import PagedAttention, SparsityConfig
    from tinyattn.retrieval.evaluate import prefill

    observe = bool(observers) and args.h2o_prefill != "skip"
    watch = PagedAttention(SparsityConfig(page_budget=1, num_recent_pages=1, policy=Tee(list(observers.values()))),
                           backend=args.backend)
    plain = PagedAttention(None, backend=args.backend)
    first = []
    for s, sid, q in zip(samples, sids, ids):
        n_q = question_start(tok, s["prompt"], q)
        split = {"observe": 0, "question": n_q, "skip": len(q)}[args.h2o_prefill] if observe else len(q)
        for a, b, att in ((0, split, plain), (split, len(q), watch)):
            if b > a:
                logits = prefill(model, cache, sid, q[a:b], attention=att)
        first.append(logits)
    return torch.stack(first)


def decode_cell(args, model, cache, sids, ids, cell, observers, first_logits, max_new) -> list[tuple]:
    """Greedy answers of the rows ``sids`` under ``cell``'s policy and budget (default recipe), the cache truncated
    back to each prompt after. Returns per row ``(tokens, mean pages, mean tokens attended, num_sink_pages)``."""
    from tinyattn.layer import PagedAttention, SparsityConfig
    from tinyattn.retrieval.evaluate import greedy_decode

    label = cell["policy"]
    counter = AttendedCounter(args.page_size)
    if label == DENSE:
        att = PagedAttention(None, backend=args.backend)
    else:
        policy = copy.deepcopy(observers[label]) if label in observers else policy_from_label(label)
        att = PagedAttention(SparsityConfig(page_budget=cell["page_budget"], policy=policy,
                                            **selection_from_label(label)), backend=args.backend)
    # other policies' selections and top_p's plan are counted; dense and Quest's fused path with a fixed budget
    # (re-ranked or not) keep min(budget, valid pages) at every step: the analytic count
    counted = counter.hook(att)
    got = greedy_decode(model, cache, sids, [[] for _ in sids], [max_new] * len(sids), attention=att,
                        first_logits=first_logits)
    out = []
    for sid, q, g in zip(sids, ids, got):
        pages, ntok = attended_means(counter, counted, sid, prompt_len=len(q), steps=len(g) - 1,
                                     page_budget=cell["page_budget"])
        out.append((g, pages, ntok, None if label == DENSE else att.sparsity.num_sink_pages))
        cache.truncate(sid, len(q))
    return out


# ---------------------------------------------------------------------------------------------- report
ORDER = (DENSE, "quest", "questmass", "oracle", "streaming", "h2o")


def _policy_order(p: str) -> tuple:
    return (ORDER.index(p) if p in ORDER else len(ORDER), p)


def _budget_value(b) -> float:
    return 1.0 if b is None else float(Fraction(b))


def load_all(out: Path) -> list[dict]:
    rows = []
    for path in sorted((out / "results").glob("*.jsonl")):
        if path.name != "log.jsonl":
            rows += read_results(path)
    return rows


def aggregate(rows: list[dict]) -> list[dict]:
    """One row per cell (task, context, policy, budget, page size, new tokens): samples, mean score, 95% interval
    (Wilson for 0/1 scores, Student's t otherwise), mean pages / tokens attended per (KV head, layer, step)."""
    from tinyattn.retrieval.ruler import mean_interval

    groups = defaultdict(dict)
    for r in rows:
        key = (r["task"], r["context"], r["policy"], r["budget"], r["page_size"], r["max_new_tokens"])
        groups[key][r["index"]] = r                   # a cell redone (cut line) counts once
    cells = []
    for key, by_index in groups.items():
        task, context, policy, budget, ps, max_new = key
        rs = list(by_index.values())
        scores = [r["score"] for r in rs]
        lo, hi, method = mean_interval(scores)
        cells.append({"task": task, "context": context, "policy": policy, "budget": budget,
                      "page_budget": rs[0]["page_budget"], "num_sink_pages": rs[0].get("num_sink_pages"),
                      "page_size": ps, "max_new_tokens": max_new, "samples": len(rs),
                      "score": sum(scores) / len(scores), "ci_low": lo, "ci_high": hi, "ci": method,
                      "pages": _mean_of(rs, "pages"), "tokens_attended": _mean_of(rs, "tokens_attended"),
                      "prompt_tokens": sum(r["prompt_tokens"] for r in rs) / len(rs)})
    cells.sort(key=lambda c: (c["task"], c["context"], _policy_order(c["policy"]), -_budget_value(c["budget"])))
    return cells


def _mean_of(rows: list[dict], name: str) -> float | None:
    values = [r[name] for r in rows if r.get(name) is not None]
    return sum(values) / len(values) if values else None


def _pct(c: dict | None) -> str:
    if c is None:
        return ""
    return f"{100 * c['score']:.0f}% [{100 * c['ci_low']:.0f}, {100 * c['ci_high']:.0f}]"


def _by_sample(rows, task, context, policy, budget) -> dict:
    return {r["index"]: r for r in rows if (r["task"], r["context"], r["policy"], r["budget"]) ==
            (task, context, policy, budget)}


def paired(rows, task, context, a: tuple, b: tuple) -> tuple[int, int, int, float]:
    """Samples both cells ran: (n, a right & b wrong, a wrong & b right, exact McNemar two-sided p)."""
    from scipy.stats import binomtest

    ra, rb = _by_sample(rows, task, context, *a), _by_sample(rows, task, context, *b)
    common = sorted(set(ra) & set(rb))
    x = sum(ra[i]["score"] == 1 and rb[i]["score"] < 1 for i in common)
    y = sum(ra[i]["score"] < 1 and rb[i]["score"] == 1 for i in common)
    p = binomtest(x, x + y, 0.5).pvalue if x + y else 1.0
    return len(common), x, y, p


def report(out: Path) -> int:
    rows = load_all(out)
    if not rows:
        print(f"no results under {out / 'results'}")
        return 0
    cells = aggregate(rows)
    write_csv(out / "cells.csv", cells)
    lines = ["# RULER on SmolLM2-135M-Instruct (dequantized Q4_1): results",
             "",
             "Made by `python bench/smollm2_ruler.py --report` from `results/*.jsonl` (one line per sample and cell; "
             "the commands that made them are in docs/accuracy.md). Score: RULER's string match (lm-eval's "
             "`common_utils.process_results`), mean over samples, 95% interval in brackets (Wilson for 0/1 scores, "
             "Student's t for partial scores). Budgets are fractions of the RULER length's pages (page size 16); "
             "default recipe (`SparsityConfig(page_budget, policy)`: one sink page from 16 pages, one recent page).",
             ""]
    lines += _stock_section(rows)
    lines += _gap_section(cells)
    tasks = sorted({c["task"] for c in cells})
    for task in tasks:
        for context in sorted({c["context"] for c in cells if c["task"] == task}):
            lines += _cell_tables(rows, [c for c in cells if c["task"] == task and c["context"] == context],
                                  task, context)
    lines += _pareto_section(rows, cells)
    lines += _timing_section(out)
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / 'summary.md'}")
    plot([c for c in cells if _top_p(c["policy"]) is None], out / "ruler.png")
    plot_pareto(cells, out / "pareto.png")
    return 0


def _top_p(label: str) -> float | None:
    """The top-p of a policy label (``quest:gamma=0.25:top_p=0.9`` -> 0.9), None for a fixed budget."""
    if label in (DENSE, STOCK):
        return None
    return selection_from_label(label).get("top_p")


def _family(label: str) -> str:
    """The estimate a label selects by, top-p or not: ``quest:gamma=0.25:top_p=0.9`` -> ``quest:gamma=0.25 top-p``
    (a series of the Pareto plot: one point per p, or per budget for a fixed budget)."""
    if _top_p(label) is None:
        return label
    return ":".join(part for part in label.split(":") if not part.startswith("top_p=")) + " top-p"


def _pareto_section(rows, cells) -> list[str]:
    """Each top-p cell beside the two fixed-budget cells of the same estimate that bracket its tokens attended (the
    most that attend fewer tokens, the fewest that attend as many or more), paired on the same samples."""
    keys = sorted({(c["task"], c["context"]) for c in cells if _top_p(c["policy"]) is not None})
    if not keys:
        return []
    lines = ["## Top-p against fixed budgets of the same estimate, by tokens attended", "",
             "Tokens attended: mean per (KV head, layer, decode step), sink and recent pages included; a top-p cell's "
             "page budget is its capacity. Beside each top-p cell, the fixed-budget cells of the same estimate just "
             "below and just above its tokens attended; paired on the same samples: (top-p right & fixed wrong) / "
             "(top-p wrong & fixed right), exact McNemar p.", "",
             "| task | context | top-p cell (capacity) | tokens | score | fixed below: budget, tokens, score, paired "
             "| fixed above: budget, tokens, score, paired |",
             "|---|---:|---|---:|---:|---|---|"]
    for task, context in keys:
        mine = [c for c in cells if (c["task"], c["context"]) == (task, context) and c["tokens_attended"] is not None]
        for c in sorted((c for c in mine if _top_p(c["policy"]) is not None), key=lambda c: c["policy"]):
            base = _family(c["policy"]).removesuffix(" top-p")
            fixed = [f for f in mine if f["policy"] == base]
            below = max((f for f in fixed if f["tokens_attended"] < c["tokens_attended"]),
                        key=lambda f: f["tokens_attended"], default=None)
            above = min((f for f in fixed if f["tokens_attended"] >= c["tokens_attended"]),
                        key=lambda f: f["tokens_attended"], default=None)
            parts = []
            for f in (below, above):
                if f is None:
                    parts.append("")
                    continue
                n, x, y, pv = paired(rows, task, context, (c["policy"], c["budget"]), (f["policy"], f["budget"]))
                parts.append(f"{f['budget']}, {f['tokens_attended']:.0f}, {_pct(f)}, {x}/{y} p={pv:.2g} (n={n})")
            lines.append(f"| {task} | {context} | {c['policy']} ({c['budget']}) | {c['tokens_attended']:.0f} | "
                         f"{_pct(c)} | " + " | ".join(parts) + " |")
    return lines + [""]


def _stock_section(rows) -> list[str]:
    lines = ["## Dense through the runner vs stock transformers (same token ids, greedy)", "",
             "| task | context | samples with both | same tokens | same score | dense score | stock score |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    keys = sorted({(r["task"], r["context"]) for r in rows})
    for task, context in keys:
        d = _by_sample(rows, task, context, DENSE, None)
        s = _by_sample(rows, task, context, STOCK, None)
        common = sorted(set(d) & set(s))
        if not common:
            continue
        same = sum(d[i]["tokens"] == s[i]["tokens"] for i in common)
        same_score = sum(d[i]["score"] == s[i]["score"] for i in common)
        lines.append(f"| {task} | {context} | {len(common)} | {same} | {same_score} | "
                     f"{sum(d[i]['score'] for i in common) / len(common):.3f} | "
                     f"{sum(s[i]['score'] for i in common) / len(common):.3f} |")
    return lines + [""]


def _gap_section(cells) -> list[str]:
    """Oracle minus quest, per task, context and budget: the room a better selection (or the adaptive budget)
    has at the same number of pages."""
    get = {(c["task"], c["context"], c["policy"], c["budget"]): c for c in cells}
    keys = sorted({(c["task"], c["context"]) for c in cells if c["policy"] == "quest"})
    budgets = sorted({c["budget"] for c in cells if c["policy"] == "quest"}, key=lambda b: -_budget_value(b))
    if not keys:
        return []
    lines = ["## Oracle minus quest (points; the room at the same page budget)", "",
             "| task | context | " + " | ".join(budgets) + " |", "|---|---:|" + "---:|" * len(budgets)]
    for task, context in keys:
        parts = []
        for b in budgets:
            q, o = get.get((task, context, "quest", b)), get.get((task, context, "oracle", b))
            parts.append(f"{100 * (o['score'] - q['score']):+.0f} (n={min(o['samples'], q['samples'])})"
                         if q and o else "")
        lines.append(f"| {task} | {context} | " + " | ".join(parts) + " |")
    return lines + [""]


def _cell_tables(rows, cells, task, context) -> list[str]:
    policies = sorted({c["policy"] for c in cells if c["policy"] not in (DENSE, STOCK)}, key=_policy_order)
    get = {(c["policy"], c["budget"]): c for c in cells}
    dense, stock = get.get((DENSE, None)), get.get((STOCK, None))
    any_cell = dense or stock or cells[0]
    from tinyattn.retrieval.ruler import ESSAY_TASKS, HAYSTACK_NAME

    label = task + (f" ({HAYSTACK_NAME} haystack)" if task in ESSAY_TASKS else "")
    lines = [f"## {label}, {context} tokens", "",
             f"{any_cell['samples']} samples (prompts of {any_cell['prompt_tokens']:.0f} tokens on average), "
             f"{any_cell['max_new_tokens']} new tokens; dense {_pct(dense)}, stock transformers {_pct(stock)}.", ""]
    if not policies:
        return lines
    budgets = sorted({c["budget"] for c in cells if c["budget"] is not None}, key=lambda b: -_budget_value(b))
    lines += ["| budget (pages) | " + " | ".join(policies) + " |", "|---|" + "---:|" * len(policies)]
    for b in budgets:
        pb = next(c["page_budget"] for c in cells if c["budget"] == b)
        lines.append(f"| {b} ({pb}) | " + " | ".join(_pct(get.get((p, b))) for p in policies) + " |")
    lines += ["", "Samples per cell: " + ", ".join(sorted({f"{c['policy']} {c['budget'] or ''}: {c['samples']}".strip()
                                                           for c in cells if c["policy"] in policies[:1]})), ""]
    lines += ["Mean tokens attended per (KV head, layer, decode step): " + "; ".join(
        f"{b}: " + ", ".join(f"{p} {get[(p, b)]['tokens_attended']:.0f}" for p in policies
                             if (p, b) in get and get[(p, b)]["tokens_attended"] is not None)
        for b in budgets), ""]
    if "quest" in policies:
        lines += ["Paired on the same samples (exact McNemar): quest vs each, per budget: (quest right & other "
                  "wrong) / (quest wrong & other right), p.", "",
                  "| budget | " + " | ".join(p for p in policies if p != "quest") + " |",
                  "|---|" + "---|" * (len(policies) - 1)]
        for b in budgets:
            parts = []
            for p in policies:
                if p == "quest":
                    continue
                n, x, y, pv = paired(rows, task, context, ("quest", b), (p, b))
                parts.append(f"{x}/{y}, p={pv:.2g}" if n else "")
            lines.append(f"| {b} | " + " | ".join(parts) + " |")
        lines.append("")
    return lines


def _timing_section(out: Path) -> list[str]:
    logs = read_results(out / "results" / "log.jsonl")
    if not logs:
        return []
    lines = ["## Run time (this machine: 2 shared cores, 1 torch thread per process)", "",
             "| task | context | batches | samples | stock s | prefill s | cells s | total s | s / sample |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    groups = defaultdict(list)
    for g in logs:
        groups[(g["task"], g["context"])].append(g)
    for (task, context), gs in sorted(groups.items()):
        n = sum(len(g["samples"]) for g in gs)
        tot = sum(g.get("total_s", g.get("stock_s", 0)) for g in gs)
        lines.append(f"| {task} | {context} | {len(gs)} | {n} | {sum(g.get('stock_s', 0) for g in gs):.0f} | "
                     f"{sum(g.get('prefill_s', 0) for g in gs):.0f} | "
                     f"{sum(sum(g.get('cells_s', {}).values()) for g in gs):.0f} | {tot:.0f} | {tot / max(n, 1):.0f} |")
    return lines + [""]


def plot(cells: list[dict], path: Path) -> None:
    """Accuracy vs budget per policy (95% intervals), one panel per task and context; dense as a band."""
    plt = pyplot()
    panels = sorted({(c["task"], c["context"]) for c in cells if c["budget"] is not None})
    if plt is None or not panels:
        return
    tasks = sorted({t for t, _ in panels})
    contexts = sorted({x for _, x in panels})
    fig, axes = plt.subplots(len(tasks), len(contexts), figsize=(4.2 * len(contexts), 3.4 * len(tasks)),
                             squeeze=False, sharey=True)
    colors = {"quest": "C0", "questmass": "C1", "oracle": "C2", "streaming": "C3", "h2o": "C4"}
    others = sorted({c["policy"] for c in cells if c["budget"] is not None} - set(colors) - {DENSE}, key=_policy_order)
    colors.update({policy: f"C{5 + k}" for k, policy in enumerate(others)})   # one color per label in every panel
    for i, task in enumerate(tasks):
        for j, context in enumerate(contexts):
            ax = axes[i][j]
            mine = [c for c in cells if c["task"] == task and c["context"] == context]
            dense = next((c for c in mine if c["policy"] == DENSE), None)
            if dense:
                ax.axhspan(100 * dense["ci_low"], 100 * dense["ci_high"], color="0.85")
                ax.axhline(100 * dense["score"], color="k", ls="--", lw=1, label="dense")
            for k, policy in enumerate(sorted({c["policy"] for c in mine if c["budget"] is not None},
                                              key=_policy_order)):
                pts = sorted((c for c in mine if c["policy"] == policy), key=lambda c: _budget_value(c["budget"]))
                x = [_budget_value(c["budget"]) * (1 + 0.03 * (k - 2)) for c in pts]     # dodge the error bars
                y = [100 * c["score"] for c in pts]
                err = [[100 * (c["score"] - c["ci_low"]) for c in pts], [100 * (c["ci_high"] - c["score"]) for c in pts]]
                ax.errorbar(x, y, yerr=err, marker="o", ms=3, capsize=2, lw=1.2, label=policy,
                            color=colors.get(policy))
            ax.set_xscale("log", base=2)
            budgets = sorted({_budget_value(c["budget"]) for c in mine if c["budget"] is not None})
            ax.set_xticks(budgets)
            ax.set_xticklabels([f"1/{round(1 / b)}" for b in budgets])
            n = max((c["samples"] for c in mine), default=0)
            ax.set_title(f"{task}, {context} tokens (n={n})", fontsize=9)
            ax.set_ylim(-3, 103)
            if j == 0:
                ax.set_ylabel("RULER score (%)")
            if i == len(tasks) - 1:
                ax.set_xlabel("page budget (fraction of the context)")
    handles = {}
    for ax in axes.flat:                       # one legend for every panel's policies, below the panels
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=len(handles), fontsize=8,
               frameon=False)
    fig.suptitle("RULER on SmolLM2-135M-Instruct: accuracy vs page budget (95% intervals; dense: dashed, band)",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def plot_pareto(cells: list[dict], path: Path) -> None:
    """Accuracy vs mean tokens attended per (KV head, layer, step), one panel per task and context: a line per
    estimate through its fixed budgets (dashed) and through its top-p values (solid, same colour, labelled p),
    95% intervals."""
    plt = pyplot()
    cells = [c for c in cells if c["tokens_attended"] is not None and c["budget"] is not None]
    panels = sorted({(c["task"], c["context"]) for c in cells if _top_p(c["policy"]) is not None})
    if plt is None or not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(max(7.0, 5.2 * len(panels)), 4.6), squeeze=False,
                             sharey=True)
    bases = sorted({_family(c["policy"]).removesuffix(" top-p") for c in cells}, key=_policy_order)
    color = {b: f"C{k}" for k, b in enumerate(bases)}
    for ax, (task, context) in zip(axes[0], panels):
        mine = [c for c in cells if (c["task"], c["context"]) == (task, context)]
        for fam in sorted({_family(c["policy"]) for c in mine}, key=lambda f: (_policy_order(f), f)):
            top_p = fam.endswith(" top-p")
            pts = sorted((c for c in mine if _family(c["policy"]) == fam), key=lambda c: c["tokens_attended"])
            x = [c["tokens_attended"] for c in pts]
            y = [100 * c["score"] for c in pts]
            err = [[100 * (c["score"] - c["ci_low"]) for c in pts], [100 * (c["ci_high"] - c["score"]) for c in pts]]
            ax.errorbar(x, y, yerr=err, marker="s" if top_p else "o", ms=5 if top_p else 3, capsize=2,
                        lw=1.6 if top_p else 1.0, ls="-" if top_p else "--", label=fam,
                        color=color[fam.removesuffix(" top-p")])
            for c, xi, yi in zip(pts, x, y):
                p = _top_p(c["policy"])
                ax.annotate(f"p={p:g}" if p is not None else c["budget"], (xi, yi), fontsize=6,
                            textcoords="offset points", xytext=(3, 3))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("mean tokens attended per (KV head, layer, decode step)")
        n = max((c["samples"] for c in mine), default=0)
        ax.set_title(f"{task}, {context} tokens (up to {n} samples per point)", fontsize=9)
        ax.set_ylim(-3, 103)
    axes[0][0].set_ylabel("RULER score (%)")
    handles = {}
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=min(4, len(handles)), fontsize=7,
               frameon=False)
    fig.suptitle("RULER on SmolLM2-135M-Instruct: accuracy vs tokens attended\n(fixed page budgets dashed, "
                 "top-p solid at its capacity; 95% intervals)", fontsize=9)
    fig.tight_layout(rect=(0, 0.14, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


# ---------------------------------------------------------------------------------------------- diagnosis
class NeedleRanks(SelectionPolicy):
    """Quest's selection (the same pages as ``quest``), recording per sparse layer and KV head where the needle's
    value page(s) rank among the valid pages (rank 1 = first; the best of the value pages) under:

    - ``quest_rank``: Quest's bound, max over the GQA group (``tinyattn.page_scores``: what quest selects by);
    - ``head_ranks``: Quest's bound of each query head of the group alone (is the group max hiding the head that
      retrieves?);
    - ``exact_rank``: the page's true largest logit ``max_j q·k_j`` (max over the group): what the bound bounds
      (is the box loose?);
    - ``questmass_rank``: questmass's estimate; ``oracle_rank``: the true attention mass (the oracle's ranking);
    - ``gamma_ranks``: the box estimate ``q·c + gamma·|q|·r`` (centre ``c``, half-width ``r``; max over the group)
      for gamma = 0, 0.25, 0.5, 0.75 (gamma = 1 is Quest's bound): how much of the bound's slack costs the needle;

    and ``mass`` (the needle page's share of the group's true attention), ``quest_captured`` /
    ``oracle_captured`` (share of the true attention on quest's / the oracle's selected pages). ``step`` is set by
    the caller. Batch of one row."""

    name = "quest"

    def __init__(self, value_pages: list[int]):
        from tinyattn.selection import QuestMassPolicy

        self.value_pages = sorted(set(value_pages))
        self.mass_policy = QuestMassPolicy()
        self.step = 0
        self.records = []

    def select(self, ctx):
        import tinyattn

        scores = tinyattn.page_scores(ctx.q, ctx.k_min, ctx.k_max, ctx.block_table, ctx.seq_lens,
                                      page_size=ctx.page_size, backend=ctx.backend)          # [1, Hkv, P]
        idx = ctx.select_top(scores)
        mass = ctx.true_page_mass()
        oracle = ctx.select_top(mass)
        qm = self.mass_policy.scores(ctx)
        Hkv = scores.shape[1]
        G = ctx.q.shape[-2] // Hkv
        q = ctx.q.reshape(1, Hkv, G, -1)
        heads = [tinyattn.page_scores(q[:, :, g].contiguous(), ctx.k_min, ctx.k_max, ctx.block_table, ctx.seq_lens,
                                      page_size=ctx.page_size, backend=ctx.backend) for g in range(G)]
        exact = self._exact_max_logit(ctx, q)                                                    # [Hkv, P]
        gammas = self._gamma_estimates(ctx, q)                                                   # [4, Hkv, P]
        valid = int(ctx.valid_pages()[0])
        pages = torch.tensor(self.value_pages)

        def rank(v):
            v = v[:valid]
            return int((v > v[pages].max()).sum()) + 1

        def captured(sel, h):
            sel = sel[0, h].long()
            return round(float(mass[0, h, sel[sel >= 0]].sum()), 4)

        for h in range(Hkv):
            self.records.append({
                "step": self.step, "layer": ctx.layer, "head": h,
                "quest_rank": rank(scores[0, h]), "head_ranks": [rank(x[0, h]) for x in heads],
                "exact_rank": rank(exact[h]), "questmass_rank": rank(qm[0, h]), "oracle_rank": rank(mass[0, h]),
                "gamma_ranks": [rank(g[h]) for g in gammas],
                "mass": round(float(mass[0, h, pages].sum()), 5),
                "quest_selected": bool(torch.isin(pages, idx[0, h].long()).any()),
                "oracle_selected": bool(torch.isin(pages, oracle[0, h].long()).any()),
                "quest_captured": captured(idx, h), "oracle_captured": captured(oracle, h), "valid_pages": valid})
        return idx

    GAMMAS = (0.0, 0.25, 0.5, 0.75)

    @classmethod
    def _gamma_estimates(cls, ctx, q) -> torch.Tensor:
        """``[len(GAMMAS), Hkv, valid pages]``: ``max over the group of q·c + gamma·|q|·r`` per page."""
        n = int(ctx.seq_lens[0])
        valid = -(-n // ctx.page_size)
        pages = ctx.block_table[0, :valid].long()
        lo, hi = ctx.k_min[pages].float(), ctx.k_max[pages].float()                     # [valid, Hkv, D]
        c, r = (hi + lo) / 2, (hi - lo) / 2
        qf = q[0].float()                                                               # [Hkv, G, D]
        centre = torch.einsum("hgd,phd->hgp", qf, c)
        spread = torch.einsum("hgd,phd->hgp", qf.abs(), r)
        return torch.stack([(centre + g * spread).amax(1) for g in cls.GAMMAS])

    @staticmethod
    def _exact_max_logit(ctx, q) -> torch.Tensor:
        """``[Hkv, valid pages]``: each page's largest ``q·k`` over its valid keys and the group's query heads."""
        n = int(ctx.seq_lens[0])
        ps = ctx.page_size
        valid = -(-n // ps)
        keys = ctx.k_cache[ctx.block_table[0, :valid].long()].float()                 # [valid, S, Hkv, D]
        logits = torch.einsum("hgd,pshd->hgps", q[0].float(), keys)                   # [Hkv, G, valid, S]
        pos = torch.arange(valid * ps).view(valid, ps)
        logits = logits.masked_fill(pos >= n, float("-inf"))
        return logits.amax(dim=(1, 3))


def diagnose(args) -> int:
    """For each (task, context, budget) of the results: up to ``--diagnose`` samples dense answered and quest
    missed, and as many quest answered; teacher-forced along dense's answer, quest's selection at that budget with
    the needle's page ranks recorded (:class:`NeedleRanks`)."""
    import lzma

    from transformers import AutoTokenizer

    from tinyattn.layer import PagedAttention, SparsityConfig
    from tinyattn.models import sources
    from tinyattn.retrieval import ruler
    from tinyattn.retrieval.evaluate import page_budget_for, prefill

    folder = hf_folder(args.model)
    tok = AutoTokenizer.from_pretrained(str(folder))
    model = sources.load_model(args.model)
    ps = args.page_size
    (args.out / "diagnosis").mkdir(parents=True, exist_ok=True)
    for task in args.task_list:
        for context in args.context_list:
            rows = read_results(args.out / "results" / f"{task}_{context}.jsonl")
            samples = {s["index"]: s for s in get_samples(args.out, task, context, args.samples, folder,
                                                          args.seed)[0]}
            dense = _by_sample(rows, task, context, DENSE, None)
            jobs = defaultdict(list)                    # sample index -> [(budget, outcome)]
            for f in args.budget_list:
                b = budget_label(f)
                quest = _by_sample(rows, task, context, "quest", b)
                ok = [i for i in sorted(quest) if i in dense and dense[i]["score"] == 1 and i in samples]
                for outcome, pick in (("miss", [i for i in ok if quest[i]["score"] < 1]),
                                      ("hit", [i for i in ok if quest[i]["score"] == 1])):
                    for i in pick[:args.diagnose]:
                        jobs[i].append((b, outcome, quest[i]))
            out = []
            for i, todo in sorted(jobs.items()):
                s = samples[i]
                q = ruler.prompt_ids(tok, s["prompt"])
                spans = ruler.needle_spans(tok, s)
                value_pages = sorted({t // ps for sp in spans for t in range(*sp["value"])})
                cache = model.new_cache(page_size=ps, num_pages=-(-(len(q) + 64) // ps) + 1)
                sid = cache.add_sequence()
                prefill(model, cache, sid, q, attention=PagedAttention(None, backend=args.backend))
                target = dense[i]["tokens"]
                for b, outcome, quest_row in todo:
                    pol = NeedleRanks(value_pages)
                    att = PagedAttention(SparsityConfig(page_budget=page_budget_for(context, ps, Fraction(b)),
                                                        policy=pol), backend=args.backend)
                    agree = []
                    for t, token in enumerate(target[:-1]):
                        pol.step = t + 1
                        logits = model(torch.tensor([[token]]), cache, [sid], sparse=True, attention=att,
                                       last_only=True)[0]
                        agree.append(int(logits.argmax()) == target[t + 1])
                    cache.truncate(sid, len(q))
                    out.append({"task": task, "context": context, "index": i, "budget": b, "outcome": outcome,
                                "page_budget": att.sparsity.page_budget, "num_sink_pages": att.sparsity.num_sink_pages,
                                "prompt_tokens": len(q), "needle": spans, "value_pages": value_pages,
                                "depth": spans[0]["value"][0] / len(q) if spans else None,
                                "dense_text": dense[i]["text"], "quest_text": quest_row["text"],
                                "teacher_forced_agree": agree, "records": pol.records})
                    print(f"{task} {context} #{i} {b} {outcome}: needle pages {value_pages} of "
                          f"{-(-len(q) // ps)}, agree {sum(agree)}/{len(agree)}", flush=True)
                del cache
            path = args.out / "diagnosis" / f"{task}_{context}.json.xz"
            with lzma.open(path, "wt") as f:
                json.dump(out, f)
            print(f"wrote {path}")
    return diagnosis_report(args.out)


def _dropped_heads(items, first_bad) -> tuple[list[float], dict]:
    """Per item, the largest needle mass of a (layer, KV head) whose quest selection drops the needle page, over
    the steps up to the first wrong token; and how often each head drops a page holding >= 30% of its attention."""
    from collections import Counter

    worst, heads = [], Counter()
    for it, bad in zip(items, first_bad):
        top = 0.0
        for r in it["records"]:
            if (bad is None or r["step"] <= bad) and not r["quest_selected"]:
                top = max(top, r["mass"])
                if r["mass"] >= 0.3:
                    heads[(r["layer"], r["head"])] += 1
        worst.append(top)
    return worst, heads


def diagnosis_report(out: Path) -> int:
    """``OUT/diagnosis/summary.md`` from the ``.json.xz`` files: per (task, context, budget, outcome), at the first
    sparse step (the answer's second token) and over all steps, the share of (layer, KV head) pairs that keep the
    needle's page (quest, oracle) and its median ranks; the layers where the oracle ranks it first."""
    import lzma
    import statistics

    lines = ["# Where quest loses the needle: page ranks per layer and KV head", "",
             "Made by `python bench/smollm2_ruler.py --diagnose N` (teacher-forced along dense's answer; quest's "
             "selection at the budget; ranks among the valid pages, 1 = first; `mass` = the needle value page's "
             "share of the true attention of that KV head's group; `c`, `r`: the page box's centre and "
             "half-width, γ = 1 being Quest's bound).", ""]
    for path in sorted((out / "diagnosis").glob("*.json.xz")):
        with lzma.open(path, "rt") as f:
            items = json.load(f)
        groups = defaultdict(list)
        for it in items:
            groups[(it["task"], it["context"], it["budget"], it["outcome"])].append(it)
        for (task, context, budget, outcome), its in sorted(groups.items(), key=lambda kv: (
                kv[0][0], kv[0][1], -_budget_value(kv[0][2]), kv[0][3])):
            lines.append(f"## {task} {context} {budget} ({its[0]['page_budget']} pages): quest {outcome}, "
                         f"{len(its)} samples")
            lines.append("")
            lines += ["Over the (layer, KV head) pairs that put at least 10% of their true attention on the needle's "
                      "page (the heads that read it): how many, the share whose selection keeps the page (quest, "
                      "oracle), the median rank of the page (1 = first) under each estimate, and the mean share of "
                      "the true attention the selections capture (all pairs).", "",
                      "| step | pairs | quest keeps | oracle keeps | quest bound | questmass | exact max logit | "
                      "q·c + γ·abs(q)·r, γ = 0 / 0.25 / 0.5 / 0.75 | oracle | captured, quest / oracle |",
                      "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
            for label, pick in (("1 (first sparse)", lambda r: r["step"] == 1), ("all", lambda r: True)):
                every = [r for it in its for r in it["records"] if pick(r)]
                rs = [r for r in every if r["mass"] >= 0.1]
                if not rs:
                    continue
                med = lambda key: statistics.median(r[key] for r in rs)                  # noqa: E731
                lines.append(
                    f"| {label} | {len(rs)} | {sum(r['quest_selected'] for r in rs) / len(rs):.0%} | "
                    f"{sum(r['oracle_selected'] for r in rs) / len(rs):.0%} | {med('quest_rank'):.0f} | "
                    f"{med('questmass_rank'):.0f} | {med('exact_rank'):.0f} | "
                    + " / ".join(f"{statistics.median(r['gamma_ranks'][k] for r in rs):.0f}"
                                 for k in range(len(rs[0]["gamma_ranks"])))
                    + f" | {med('oracle_rank'):.0f} | {statistics.mean(r['quest_captured'] for r in every):.3f} / "
                      f"{statistics.mean(r['oracle_captured'] for r in every):.3f} |")
            first_bad = [next((t + 1 for t, a in enumerate(it["teacher_forced_agree"]) if not a), None) for it in its]
            depths = [f"{it['depth']:.2f}" for it in its if it["depth"] is not None]
            lines += ["", f"needle depths: {', '.join(depths)}; first teacher-forced step where quest's argmax "
                          f"leaves dense's answer: {first_bad}", ""]
            worst, heads = _dropped_heads(its, first_bad)
            lines += [f"Per sample, the largest share of a head's attention on the needle page among the heads whose "
                      f"quest selection drops that page (steps up to the first wrong token): "
                      f"{[round(w, 2) for w in worst]}; heads dropping a needle page that holds >= 30% of their "
                      f"attention (layer.head: steps): "
                      + (", ".join(f"{l_}.{h}: {n}" for (l_, h), n in heads.most_common(6)) or "none"), ""]
            # retrieval heads: (layer, head) where the oracle ranks the needle first at step 1 in most samples
            heads = defaultdict(list)
            for it in its:
                for r in it["records"]:
                    if r["step"] == 1:
                        heads[(r["layer"], r["head"])].append(r)
            strong = sorted(((k, v) for k, v in heads.items() if statistics.mean(x["mass"] for x in v) >= 0.2),
                            key=lambda kv: -statistics.mean(x["mass"] for x in kv[1]))
            if strong:
                lines.append("KV heads holding >= 20% of their attention on the needle at step 1 (layer.head: mean "
                             "mass, then the needle page's ranks per sample: quest, exact max logit, q·c (γ = 0), "
                             "oracle):")
                lines.append("")
                for (layer, head), v in strong[:12]:
                    lines.append(f"- {layer}.{head}: {statistics.mean(x['mass'] for x in v):.2f}, quest "
                                 f"{[x['quest_rank'] for x in v]}, exact {[x['exact_rank'] for x in v]}, γ=0 "
                                 f"{[x['gamma_ranks'][0] for x in v]}, oracle {[x['oracle_rank'] for x in v]}")
                lines.append("")
    (out / "diagnosis" / "summary.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / 'diagnosis' / 'summary.md'}")
    return 0


# ---------------------------------------------------------------------------------------------- lm-eval itself
def _lm_eval_samples(args, task, context, folder, stored) -> tuple[list[dict], float]:
    """lm-eval's per-sample responses and scores on the first ``--lm-eval`` samples: read back from
    ``OUT/lm_eval/<task>_<context>.jsonl`` when a run already made them, else from ``simple_evaluate``."""
    import lm_eval

    from tinyattn.retrieval import ruler

    path = args.out / "lm_eval" / f"{task}_{context}.jsonl"
    meta = path.with_suffix(".meta.json")
    if path.is_file() and meta.is_file():
        per = read_results(path)
        if len(per) >= args.lm_eval:
            return per[:args.lm_eval], json.loads(meta.read_text())["seconds"]
    lm_task, _ = ruler.load_task(task, context, folder, seed=args.seed)
    t0 = time.perf_counter()
    res = lm_eval.simple_evaluate(model="hf", model_args={"pretrained": str(folder), "dtype": "float32",
                                                          "device": "cpu"},
                                  tasks=[lm_task], limit=args.lm_eval, batch_size=1, log_samples=True)
    seconds = time.perf_counter() - t0
    prompts = {s["index"]: s["prompt"] for s in stored}
    per = [{"index": x["doc_id"], "same_prompt": prompts.get(x["doc_id"]) == x["arguments"][0][0],
            "response": x["filtered_resps"][0], "score": float(x[str(context)])}
           for x in sorted(res["samples"][ruler.TASKS[task]], key=lambda x: x["doc_id"])]
    path.write_text("".join(json.dumps(p) + "\n" for p in per))
    meta.write_text(json.dumps({"seconds": round(seconds, 1), "lm_eval": lm_eval.__version__,
                                "model_args": {"pretrained": str(folder), "dtype": "float32"},
                                "results": res["results"][ruler.TASKS[task]]}, default=str, indent=1) + "\n")
    return per, seconds


def lm_eval_reference(args) -> int:
    """lm-eval's ``simple_evaluate`` with its Hugging Face model (stock transformers, lm-eval's own generation
    settings: greedy, up to the task's ``max_gen_toks``) on the first ``--lm-eval`` stored samples; per sample its
    response and score beside the runner's dense and stock cells (``OUT/lm_eval/``)."""
    folder = hf_folder(args.model)
    (args.out / "lm_eval").mkdir(parents=True, exist_ok=True)
    lines = ["# lm-eval's own evaluation beside the runner", "",
             "`lm_eval.simple_evaluate(model='hf', ...)` (stock transformers through lm-eval's Hugging Face model, "
             "fp32, batch 1, lm-eval's generation settings) on the task object whose samples the runner stored "
             "(same seed). `same prompts` = lm-eval's request context equals the runner's stored prompt; "
             "`prefix` = the runner's dense text is the start of lm-eval's response (the runner generates fewer "
             "tokens).", "",
             "| task | context | samples | same prompts | lm-eval score | runner dense score | same score per sample | "
             "dense text a prefix of lm-eval's | stock score | seconds |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for task in args.task_list:
        for context in args.context_list:
            stored, _ = get_samples(args.out, task, context, args.lm_eval, folder, args.seed)
            per, seconds = _lm_eval_samples(args, task, context, folder, stored)
            rows = read_results(args.out / "results" / f"{task}_{context}.jsonl")
            dense = _by_sample(rows, task, context, DENSE, None)
            stock = _by_sample(rows, task, context, STOCK, None)
            both = [p for p in per if p["index"] in dense]
            same = sum(dense[p["index"]]["score"] == p["score"] for p in both)
            prefix = sum(p["response"].strip().startswith(dense[p["index"]]["text"].strip()) for p in both)
            st = [stock[p["index"]]["score"] for p in per if p["index"] in stock]
            lines.append(f"| {task} | {context} | {len(per)} | {sum(p['same_prompt'] for p in per)} | "
                         f"{sum(p['score'] for p in per) / len(per):.3f} | "
                         f"{sum(dense[p['index']]['score'] for p in both) / max(1, len(both)):.3f} ({len(both)}) | "
                         f"{same}/{len(both)} | {prefix}/{len(both)} | "
                         f"{(sum(st) / len(st)) if st else float('nan'):.3f} ({len(st)}) | {seconds:.0f} |")
    (args.out / "lm_eval" / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
