"""lm-evaluation-harness drives a tinyattn model (issue 33 point 3): the registered model ``"tinyattn"``
(:mod:`tinyattn.integrations.lm_eval`) through ``lm_eval.simple_evaluate`` on RULER's ``niah_single_1`` (generated
offline, sized by the model's tokenizer), against lm-eval's own ``"hf"`` model on the same checkpoint.

The checkpoint is the shipped stories260K converted to a Hugging Face folder (a real model and tokenizer; 512-token
context; RULER sized at 480 tokens gives prompts of ~290): with a dense TinyAttnCache every response equals stock transformers'
through lm-eval; with 2 pages of 16 tokens the decode is sparse (tinyattn's profiler) and lm-eval scores it. The
SmolLM2 run at 2K documented in docs/lm_eval.md is the full-size version of this test. Skipped without lm-eval
(``pip install -e ".[eval]"``).
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("wonderwords", reason="RULER's generators need wonderwords, of the eval extra: "
                                          "pip install -e '.[eval]'")
lm_eval = pytest.importorskip("lm_eval", reason="lm-evaluation-harness, of the eval extra: pip install -e '.[eval]'")

import tinyattn.integrations.lm_eval as lme  # noqa: E402  (lm-eval is there: a failure to import is a bug)
import tinyattn.profiler as tp  # noqa: E402
from tinyattn.layer import DEFAULT_GAMMA  # noqa: E402

LENGTH = 480          # RULER's target length: the prompt plus the task's 128 generated tokens fit stories260K's 512
LIMIT = 3


@pytest.fixture(scope="module")
def stories_hf(tmp_path_factory):
    from tinyattn.assets import default_model_path, default_tokenizer_path
    from tinyattn.integrations.convert import convert

    return convert(default_model_path(), tmp_path_factory.mktemp("stories260K-hf"), default_tokenizer_path())


def evaluate(model, model_args):
    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["niah_single_1"], limit=LIMIT,
                                  metadata={"max_seq_lengths": [LENGTH]}, device="cpu", batch_size=1,
                                  log_samples=True, gen_kwargs="max_gen_toks=24")
    samples = out["samples"]["niah_single_1"]
    return out["results"]["niah_single_1"], [s["resps"] for s in samples], [s["doc"]["input"] for s in samples]


@pytest.mark.slow
def test_dense_tinyattn_equals_stock_through_lm_eval_and_sparse_runs(stories_hf, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    stock, stock_resps, docs = evaluate("hf", f"pretrained={stories_hf},dtype=float32")
    dense, dense_resps, dense_docs = evaluate("tinyattn", f"pretrained={stories_hf},dtype=float32,page_size=16,"
                                                          f"page_budget=none,attn_backend=torch")
    assert dense_docs == docs                          # lm-eval seeds its generators: the same haystacks
    assert len(docs) == LIMIT and all(len(d) > 300 for d in docs)       # ~290 tokens: 18 pages of 16
    assert dense_resps == stock_resps and dense[f"{LENGTH},none"] == stock[f"{LENGTH},none"]
    with tp.profile(oracle=False) as prof:
        sparse, sparse_resps, sparse_docs = evaluate("tinyattn", f"pretrained={stories_hf},dtype=float32,"
                                                                 f"page_size=16,page_budget=2,attn_backend=torch")
    assert sparse_docs == docs and len(sparse_resps) == LIMIT and 0 <= sparse[f"{LENGTH},none"] <= 1
    assert any(r.op == "attention" and r.sparse for r in prof.records)


def test_the_registered_model_checks_its_settings(stories_hf):
    from lm_eval.api.registry import get_model

    assert get_model("tinyattn") is lme.TinyAttnLM
    with pytest.raises(ValueError, match="page_budget"):
        lme.TinyAttnLM(pretrained=str(stories_hf), device="cpu", page_budget=0)
    with pytest.raises(ValueError, match="attn_implementation"):
        lme.TinyAttnLM(pretrained=str(stories_hf), device="cpu", attn_implementation="sdpa")
    lm = lme.TinyAttnLM(pretrained=str(stories_hf), device="cpu", page_size=8, page_budget=4, policy="streaming")
    assert lm.model.config.tinyattn["page_budget"] == 4 and lm.model.config._attn_implementation == "tinyattn"


def test_model_args_take_gamma_and_top_p(stories_hf):
    """``--model_args ...,gamma=0.5,top_p=0.9`` as lm-eval parses them (its own ``create_from_arg_string``) reach
    the TinyAttnCache settings; ``top_p=none`` is the fixed budget; bad values are refused naming the argument."""
    lm = lme.TinyAttnLM.create_from_arg_string(f"pretrained={stories_hf},page_size=8,page_budget=4,gamma=0.5,"
                                               f"top_p=0.9,attn_backend=torch", {"device": "cpu"})
    saved = lm.model.config.tinyattn
    assert (saved["gamma"], saved["top_p"]) == (0.5, 0.9) and isinstance(saved["top_p"], float)   # not the default
    lm = lme.TinyAttnLM.create_from_arg_string(f"pretrained={stories_hf},page_budget=4,top_p=none",
                                               {"device": "cpu"})
    assert lm.model.config.tinyattn["top_p"] is None and lm.model.config.tinyattn["gamma"] == DEFAULT_GAMMA
    for args, name in (("gamma=2", "gamma"), ("top_p=1.5", "top_p"), ("policy=h2o,top_p=0.9", "policy")):
        with pytest.raises(ValueError, match=name):
            lme.TinyAttnLM.create_from_arg_string(f"pretrained={stories_hf},page_budget=4,{args}", {"device": "cpu"})
