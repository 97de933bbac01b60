"""The benches' policy labels with the re-ranked selection (``quest:...:rerank=int4``, ``...:candidates=2``) and the
tokens attended that bench/smollm2_passkey.py and bench/smollm2_long_text.py record per result row, on a tiny real
model (stories260K as a Hugging Face folder).

Expected counts come from the page arithmetic, not from the code under test: a decode step at length ``n`` under a
budget of ``k`` pages (16-token pages, fewer than the row's) reads ``k - 1`` full pages and the partial last page
(the forced recent page), ``n - 16 * (ceil(n / 16) - 1)`` tokens of it; dense reads all ``n``.
"""

import csv
import json

import pytest

from paths import REPO, load_bench

BENCH = REPO / "bench"
FIXED = "quest:gamma=0.25:rerank=int4"
TOP_P = "quest:gamma=0.25:top_p=0.8:rerank=int4"




# ---------------------------------------------------------------------------------------------- labels
def test_labels_take_rerank_and_candidates():
    """rerank and candidates are settings of the quest selection (SparsityConfig's), beside gamma and top_p; every
    older label keeps its meaning; candidates without rerank would name a re-rank that does not run."""
    from tinyattn.layer import SparsityConfig

    common = load_bench("common")
    sel = common.selection_from_label
    assert sel(TOP_P) == {"gamma": 0.25, "top_p": 0.8, "rerank": "int4"}
    assert sel("quest:gamma=0.25:rerank=int4:candidates=2") == {"gamma": 0.25, "rerank": "int4", "candidates": 2}
    assert sel("quest:rerank=int4:candidates=1.5") == {"gamma": 1.0, "rerank": "int4", "candidates": 1.5}
    # the labels of the committed results: unchanged
    assert sel("quest") == {"gamma": 1.0}
    assert sel("quest:gamma=0.25:top_p=0.9") == {"gamma": 0.25, "top_p": 0.9}
    assert sel("questmass:gamma=1.0") == {} and sel("oracle") == {}
    assert common.policy_from_label("questmass:gamma=0.5").gamma == 0.5
    assert common.policy_from_label(TOP_P).name == "quest"
    config = SparsityConfig(page_budget=8, policy=common.policy_from_label("quest:gamma=0.25:rerank=int4:candidates=2"),
                            **sel("quest:gamma=0.25:rerank=int4:candidates=2"))
    assert (config.rerank, config.candidates, config.gamma, config.top_p) == ("int4", 2.0, 0.25, None)
    with pytest.raises(ValueError, match="rerank=int4"):
        sel("quest:gamma=0.25:candidates=2")
    with pytest.raises(ValueError, match="rerank"):          # the library names a bad value
        SparsityConfig(page_budget=8, **sel("quest:rerank=int8"))
    with pytest.raises(TypeError):                           # another policy's constructor has no rerank
        common.policy_from_label("questmass:rerank=int4")


def test_needs_key_codes_only_for_a_rerank():
    common = load_bench("common")
    assert common.needs_key_codes(["dense", "quest", TOP_P])
    assert common.needs_key_codes(iter(["quest:gamma=0.25:rerank=int4:candidates=2"]))
    assert not common.needs_key_codes(["dense", "hf_stock", "quest", "quest:gamma=0.25:top_p=0.9", "questmass:gamma=1",
                                       "oracle", "streaming", "h2o"])
    assert not common.needs_key_codes([])


def test_ruler_uses_the_one_attended_counter():
    """AttendedCounter lives in bench/common.py; the RULER bench imports it (one copy)."""
    assert "class AttendedCounter" in (BENCH / "common.py").read_text()
    assert "class AttendedCounter" not in (BENCH / "smollm2_ruler.py").read_text()
    assert load_bench("smollm2_ruler").AttendedCounter.__module__ == "common"


# ---------------------------------------------------------------------------------------------- tiny model runs
@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    from tinyattn.assets import default_model_path, default_tokenizer_path
    from tinyattn.integrations.convert import convert

    return convert(default_model_path(), tmp_path_factory.mktemp("tiny") / "stories260K_hf",
                   tokenizer_path=default_tokenizer_path())


@pytest.fixture
def key_codes_asked(monkeypatch):
    """The ``key_codes`` of every cache the model makes."""
    from tinyattn.models.llama import LlamaModel

    asked, new_cache = [], LlamaModel.new_cache

    def spy(self, **kw):
        asked.append(kw.get("key_codes", False))
        return new_cache(self, **kw)

    monkeypatch.setattr(LlamaModel, "new_cache", spy)
    return asked


def _partial(n: int, page_size: int = 16) -> int:
    """Tokens of the last (partial or full) page of a row of ``n`` tokens."""
    return n - page_size * (-(-n // page_size) - 1)


@pytest.mark.slow
def test_rerank_with_a_fixed_budget_keeps_the_budget(folder):
    """The analytic count the benches use for Quest's fused fixed budget holds with the re-rank: counted from the
    plan's own selections, every sparse step attends min(budget, pages) pages, the partial last page among them."""
    from tinyattn.layer import PagedAttention, SparsityConfig
    from tinyattn.models import sources
    from tinyattn.retrieval.evaluate import greedy_decode, prefill

    common = load_bench("common")
    model = sources.load_model(folder)
    cache = model.new_cache(page_size=16, num_pages=24, key_codes=True)
    sid = cache.add_sequence()
    logits = prefill(model, cache, sid, list(range(3, 203)), attention=PagedAttention(None, backend="torch"))
    for candidates in (1.0, 2.0):
        att = PagedAttention(SparsityConfig(page_budget=4, gamma=0.25, rerank="int4", candidates=candidates),
                             backend="torch")
        counter = common.AttendedCounter(16)
        att.attended = counter.plan_counter(att)
        got = greedy_decode(model, cache, [sid], [[]], [20], attention=att, first_logits=logits[None])
        cache.truncate(sid, 200)
        steps = len(got[0]) - 1
        assert counter.mean(sid) == pytest.approx((4.0, sum(48 + _partial(200 + t) for t in range(1, steps + 1))
                                                   / steps))
        assert counter.mean(sid) == pytest.approx(common.analytic_attended(200, steps, 16, 4))


@pytest.mark.slow
def test_passkey_records_tokens_attended_with_rerank(folder, tmp_path, key_codes_asked):
    """A tiny passkey run with re-ranked labels: the caches keep key codes, every row records pages / tokens attended
    (dense: every token; the fixed budget: 4 pages, 13 fewer full pages than dense at 257.. tokens; top-p: never more
    than the fixed budget); --merge reads an older file without the columns."""
    passkey = load_bench("smollm2_passkey")
    out = tmp_path / "pk"
    argv = ["--model", str(folder), "--out", str(out), "--contexts", "256", "--depths", "2", "--samples", "2",
            "--budgets", "1/4", "--policies", f"dense,{FIXED},{TOP_P}", "--recipes", "default", "--batch", "2",
            "--backend", "torch"]                      # (the tests' TRITON_INTERPRET=1 would pick the interpreter)
    assert passkey.main(argv) == 0
    assert key_codes_asked and all(key_codes_asked)
    rows = list(csv.DictReader(open(out / "passkey_default.csv")))
    assert [r["policy"] for r in rows] == ["dense", FIXED, TOP_P] * 2
    for depth in ("0.0", "1.0"):
        by = {r["policy"]: r for r in rows if r["depth"] == depth}
        dense, fixed, top = (by[p] for p in ("dense", FIXED, TOP_P))
        assert float(dense["pages_attended"]) == 17.0 and float(fixed["pages_attended"]) == 4.0
        assert float(dense["tokens_attended"]) - float(fixed["tokens_attended"]) == pytest.approx(13 * 16)
        assert 256 < float(dense["tokens_attended"]) < 256 + 16
        assert 1.0 <= float(top["pages_attended"]) <= 4.0
        assert 0 < float(top["tokens_attended"]) <= float(fixed["tokens_attended"])
    saved = json.loads((out / "passkey_default.json").read_text())
    assert all(r["tokens_attended"] is not None for r in saved["rows"])
    assert "| 16 | 256 | " + TOP_P + " | 1/4 |" in (out / "passkey_summary.md").read_text()

    # an older result file (the harness's columns only) still merges: the attended cells come back empty
    old = tmp_path / "old"
    old.mkdir()
    saved["rows"] = [{k: v for k, v in r.items() if k not in ("pages_attended", "tokens_attended")}
                     for r in saved["rows"]]
    (old / "passkey_default.json").write_text(json.dumps(saved))
    merged = tmp_path / "merged"
    assert passkey.main(["--out", str(merged), "--recipes", "default", "--merge", f"{old},{out}"]) == 0
    rows = list(csv.DictReader(open(merged / "passkey_default.csv")))
    assert len(rows) == 12 and sum(r["tokens_attended"] == "" for r in rows) == 6
    assert passkey.PasskeyResult.load_json(old / "passkey_default.json").rows[0].tokens_attended is None


@pytest.mark.slow
def test_long_text_records_tokens_attended_with_rerank(folder, tmp_path, key_codes_asked):
    """A tiny long-text run with re-ranked labels: the cache keeps key codes, every row records pages / tokens
    attended over the bucket's 15 decode steps (dense at 128: 128 + 8 tokens; the fixed budget of 1/4 of 128 tokens,
    2 pages: 16 + 8); top-p never attends more than the fixed budget; a run without a re-rank makes no codes; rows of
    an older run without the columns still merge."""
    long_text = load_bench("smollm2_long_text")
    out = tmp_path / "lt"
    argv = ["--model", str(folder), "--out", str(out), "--context", "256", "--buckets", "128,192", "--tokens", "16",
            "--budgets", "1/4", "--policies", f"{FIXED},{TOP_P}", "--recipes", "default", "--backend", "torch"]
    assert long_text.main(argv) == 0
    assert key_codes_asked and all(key_codes_asked)
    rows = json.loads((out / "long_text.json").read_text())["rows"]
    by = {(r["position"], r["policy"]): r for r in rows}
    for b, budget in ((128, 2), (192, 3)):
        dense, fixed, top = by[(b, "dense")], by[(b, FIXED)], by[(b, TOP_P)]
        assert (dense["pages_attended"], dense["tokens_attended"]) == pytest.approx(
            (sum(-(-(b + t) // 16) for t in range(1, 16)) / 15, b + 8))
        assert fixed["page_budget"] == budget
        assert (fixed["pages_attended"], fixed["tokens_attended"]) == pytest.approx((budget, (budget - 1) * 16 + 8))
        assert 1 <= top["pages_attended"] <= fixed["pages_attended"]
        assert 0 < top["tokens_attended"] <= fixed["tokens_attended"]
    header = next(csv.reader(open(out / "long_text.csv")))
    assert header[-2:] == ["pages_attended", "tokens_attended"]

    key_codes_asked.clear()
    plain = tmp_path / "plain"
    assert long_text.main(argv[:2] + ["--out", str(plain), "--context", "256", "--buckets", "128", "--tokens", "4",
                                      "--budgets", "1/4", "--policies", "quest:gamma=0.25", "--recipes", "default",
                                      "--backend", "torch"]) == 0
    assert key_codes_asked == [False]

    old = json.loads((plain / "long_text.json").read_text())
    for r in old["rows"]:
        del r["pages_attended"], r["tokens_attended"]
    (plain / "long_text.json").write_text(json.dumps(old))
    merged = tmp_path / "merged"
    assert long_text.main(["--out", str(merged), "--merge", f"{plain},{out}"]) == 0
    rows = list(csv.DictReader(open(merged / "long_text.csv")))
    # the dense row at 128 is in both runs: kept once, the first run's
    assert len(rows) == 2 + 6 - 1 and sum(r["tokens_attended"] == "" for r in rows) == 2
    summary = (merged / "long_text_summary.md").read_text()
    assert "| 16 | default | quest:gamma=0.25 | 1/4 |" in summary and "| - |" in summary
