"""Recall fine-tuning (tinyattn/retrieval/recall.py): generated sequences with keys early and questions late, a loss mask
on the answer digits, and the ``finetune --task recall`` command.

Expected values come from the sequences' text (the answers are read back from the decoded prompt with a regular
expression, independently of how the generator placed them).
"""

import json
import re

import pytest
import torch

from tinyattn.models import LlamaConfig, LlamaModel
from tinyattn.retrieval import CharTokenizer, save_retrieval_model
from tinyattn.retrieval.recall import recall_batch, recall_sequence

TOK = CharTokenizer()


@pytest.mark.parametrize("seed", [0, 1, 7])
@pytest.mark.parametrize("seq_len,keys,questions", [(1024, 4, 4), (600, 2, 5), (2048, 6, 3)])
def test_recall_sequence_layout_and_mask(seed, seq_len, keys, questions):
    tokens, mask = recall_sequence(seq_len=seq_len, seed=seed, num_keys=keys, num_questions=questions)
    assert len(tokens) == seq_len + 1 and len(mask) == seq_len and tokens[0] == TOK.bos_id
    text = TOK.decode(tokens)
    offset = len(tokens) - 1 - len(text)                 # decode drops BOS: text index i = token i + 1 + offset
    assert offset == 0
    key_re = r"(?<!\? )The pass key of (\w+) is <(\d{5})>\. "     # a key sentence, not a question's answer
    found_keys = dict(re.findall(key_re, text))
    assert len(found_keys) == keys
    asked = list(re.finditer(r"What is the pass key of (\w+)\? The pass key of \1 is <(\d{5})>\.", text))
    assert len(asked) == questions
    want_mask = [False] * seq_len
    for m in asked:
        assert found_keys[m.group(1)] == m.group(2)      # every answer is a key given earlier
        start = m.start(2) + 1                           # token position of the first answer digit
        for t in range(start, start + 5):
            want_mask[t - 1] = True                      # target t - 1 predicts token t
    assert mask == want_mask
    last_key = max(m.end() for m in re.finditer(key_re, text))
    assert last_key < asked[0].start()                   # keys early, questions late
    assert recall_sequence(seq_len=seq_len, seed=seed, num_keys=keys, num_questions=questions) == (tokens, mask)


def test_recall_sequence_errors():
    with pytest.raises(ValueError, match="seq_len: 4 keys and 4 questions need at least"):
        recall_sequence(seq_len=100, seed=0)
    with pytest.raises(ValueError, match="keys_end .* must not exceed first_question"):
        recall_sequence(seq_len=1024, seed=0, keys_end=0.5, first_question=0.2)
    with pytest.raises(ValueError, match="num_keys: expected an int >= 1"):
        recall_sequence(seq_len=1024, seed=0, num_keys=0)
    with pytest.raises(ValueError, match="first_question: expected a number in"):
        recall_sequence(seq_len=1024, seed=0, first_question=1.5)


def test_recall_batch_shapes_and_distinct_seeds():
    tokens, mask = recall_batch(3, seq_len=700, first_seed=5)
    assert tokens.shape == (3, 701) and mask.shape == (3, 700) and mask.dtype == torch.bool
    assert not torch.equal(tokens[0], tokens[1])
    assert torch.equal(tokens[2], torch.tensor(recall_sequence(seq_len=700, seed=7)[0]))


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    cfg = LlamaConfig(dim=16, hidden_dim=32, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=TOK.vocab_size,
                      max_seq_len=1024, layer_types=("sliding_attention", "full_attention"), sliding_window=32,
                      nope_layers=(1,))
    out = tmp_path_factory.mktemp("ckpt")
    save_retrieval_model(LlamaModel(cfg), TOK, out)
    return out


@pytest.mark.parametrize("retention", ["full", "recency", "gradient"])
def test_finetune_recall_command(tiny_checkpoint, tmp_path, retention):
    from tinyattn.cli import main

    out = tmp_path / "r.json"
    budget = [] if retention == "full" else ["--kv-budget-pages", "12"]
    rc = main(["finetune", "--task", "recall", "--model", str(tiny_checkpoint), "--seq-len", "320",
               "--num-keys", "2", "--num-questions", "2", "--chunk-size", "32", "--page-size", "16",
               "--retention", retention, *budget, "--steps", "2", "--batch-size", "2", "--eval-sequences", "2",
               "--backend", "torch", "--no-progress", "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["task"] == "recall" and r["retention"] == retention
    assert r["eval_tokens"] == 2 * 2 * 5                   # 2 sequences x 2 questions x 5 answer digits
    assert 0.0 <= r["eval_accuracy"] <= 1.0 and r["eval_nll"] > 0


def test_finetune_recall_rejects_text_options(tiny_checkpoint, capsys):
    from tinyattn.cli import main

    rc = main(["finetune", "--task", "recall", "--model", str(tiny_checkpoint), "--data", "x.txt",
               "--chunk-size", "32", "--retention", "full", "--steps", "1"])
    assert rc == 2
    assert "--data and --tokenizer do not apply to --task recall" in capsys.readouterr().err


@pytest.mark.parametrize("retention", ["recency", "gradient"])
@pytest.mark.parametrize("train", [True, False])
def test_run_sequences_frees_its_graphs(retention, train):
    """A chunk without counted targets builds a graph but runs no backward; that graph (it saves the attention's
    own outputs) and the weights it reaches must be freed with the model. They were not when the activation meter's
    pack hook returned the saved tensor itself: node -> saved output -> grad_fn = node, a cycle through C++ that
    Python's gc cannot collect, which grew bench/retention_recall.py to 23 GB over repeated fine-tuning runs."""
    import gc
    import weakref

    from tinyattn.training.chunked import run_sequences
    from tinyattn.training.retention import make_policy

    torch.manual_seed(0)
    cfg = LlamaConfig(dim=16, hidden_dim=32, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=TOK.vocab_size,
                      max_seq_len=1024, layer_types=("sliding_attention", "full_attention"), sliding_window=32,
                      nope_layers=(1,))
    model = LlamaModel(cfg).requires_grad_(train)
    tokens, mask = recall_batch(2, seq_len=320, num_keys=2, num_questions=2)
    assert not bool(mask[:, :32].any())                  # the first chunk counts nothing: forward only
    st = run_sequences(model, tokens, make_policy(retention), chunk_size=32, page_size=16, capacity=12,
                       train=train, backend="torch", loss_mask=mask)
    assert st.num_tokens == 2 * 2 * 5
    refs = [weakref.ref(p) for p in model.parameters()]
    del model
    gc.collect()
    assert all(r() is None for r in refs), "run_sequences left an autograd graph holding the weights"
