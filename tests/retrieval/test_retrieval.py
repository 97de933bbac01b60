"""tinyattn.retrieval: the character tokenizer, the task generators, the checkpoint format, the training forward
(against LlamaModel's paged forward) and a few training steps."""

import json
import re

import pytest
import torch

from tinyattn.models import LlamaConfig, LlamaModel
from tinyattn.retrieval import TASKS, CharTokenizer, make_sample, normalize_text
from tinyattn.retrieval.forward import full_forward
from tinyattn.retrieval.model import load_retrieval_model, save_retrieval_model
from tinyattn.retrieval.tasks import min_context_tokens

TOK = CharTokenizer()


# ---------------------------------------------------------------------------- tokenizer
def test_tokenizer_round_trip_and_ids():
    text = "The pass key is 48213.\nWhat is it? ~{}|"
    ids = TOK.encode(text, bos=True, eos=True)
    assert ids[0] == TOK.bos_id == 1 and ids[-1] == TOK.eos_id == 2 and len(ids) == len(text) + 2
    assert TOK.decode(ids) == text
    assert TOK.decode(ids, skip_special=False) == "<s>" + text + "</s>"
    assert TOK.vocab_size == len(TOK) == 99                       # 3 specials + newline + 95 printable ASCII
    assert sorted(TOK.encode(TOK.CHARS, bos=False)) == list(range(3, 99))


def test_tokenizer_rejects_unknown_characters_or_maps_them_to_unk():
    with pytest.raises(ValueError, match=r"text: character 'é' \(U\+00E9\) at position 2"):
        TOK.encode("caé")
    assert CharTokenizer(unknown="unk").encode("caé", bos=False)[-1] == TOK.unk_id
    with pytest.raises(ValueError, match="unknown: expected 'error' or 'unk', got 'skip'"):
        CharTokenizer(unknown="skip")
    with pytest.raises(ValueError, match=r"ids: expected token ids in \[0, 99\), got 99"):
        TOK.decode([5, 99])
    with pytest.raises(TypeError, match="text: expected a str"):
        TOK.encode([1, 2])


def test_normalize_text_maps_typography_to_ascii():
    # "â€™" is the UTF-8 of a right single quote read as cp1252, as in the TinyStories files
    assert normalize_text("Lilyâ€™s “cat” – ok… é") == "Lily's \"cat\" - ok... "


# ---------------------------------------------------------------------------- tasks
def _expected_answer(task: str, text: str) -> str:
    """The answer, read back from the prompt text with regular expressions (independently of the generator)."""
    if task == "passkey":
        (value,) = set(re.findall(r"The pass key is <(\d{5})>\. Remember it\. <\1> is the pass key\.", text))
        return value
    name = re.search(r"What is the pass key of (\w+)\?", text).group(1)
    if task == "multihop":
        (via,) = re.findall(rf"\b{name} has the same pass key as <(\w+)>\.", text)
        (value,) = re.findall(rf"The pass key of {via} is <(\d{{5}})>\.", text)
        return f"{via}>. The pass key of {via} is <{value}"
    (value,) = re.findall(rf"The pass key of {name} is <(\d{{5}})>\.", text)
    return value


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("context_tokens", [None, 1000, 4096])
@pytest.mark.parametrize("depth", [0.0, 0.37, 1.0])
def test_sample_length_needle_depth_and_answer(task, context_tokens, depth):
    n = context_tokens or min_context_tokens(task)
    s = make_sample(task, context_tokens=n, depth=depth, seed=7)
    assert s.task == task and s.context_tokens == len(s.prompt) == n and s.prompt[0] == TOK.bos_id
    text = TOK.decode(s.prompt)
    assert text == s.text and TOK.decode(s.answer) == _expected_answer(task, text)
    # the needles the answer needs: inside the prompt, disjoint, holding the answer's pieces
    starts = [a for a, _ in s.needle_positions]
    assert all(1 <= a < b <= n for a, b in s.needle_positions) and len(set(starts)) == len(starts)
    first = TOK.decode(s.prompt[slice(*s.needle_positions[0])])
    if task == "multihop":
        assert len(s.needle_positions) == 2 and "has the same pass key as" in first
        assert TOK.decode(s.answer)[-5:] in TOK.decode(s.prompt[slice(*s.needle_positions[1])])
    else:
        assert len(s.needle_positions) == 1 and TOK.decode(s.answer) in first
    # the asked needle at the requested depth of the filler
    assert 0.0 <= s.depth <= 1.0 and depth - 1 / n <= s.depth <= depth + 20 / n      # rounding, then the next word
    if depth == 0.0:
        assert s.needle_positions[0][0] == 1                            # right after BOS
    if depth == 1.0:                                                    # right before the question
        assert text.endswith(first + " \n" + text.split("\n")[-1])


def test_decoy_repeats_a_similar_needle_and_multikey_has_similar_keys():
    s = make_sample("decoy", context_tokens=2048, depth=0.5, seed=3)
    name = re.search(r"What is the pass key of (\w+)\?", s.text).group(1)
    decoys = re.findall(r"The pass key of (\w+) is <(\d{5})>\.", s.text)
    others = [d for d in decoys if d[0] != name]
    assert len(others) == 6 and len(set(others)) == 1                    # one needle, six times
    assert sum(a != b for a, b in zip(others[0][0], name)) == 1          # one letter apart
    m = make_sample("multikey", context_tokens=2048, depth=0.5, seed=3)
    keys = re.findall(r"The pass key of (\w+) is <\d{5}>\.", m.text)
    assert len(keys) == len(set(keys)) == 4
    assert len(re.findall(r"counted <\d{5}> stars", m.text)) == 2


@pytest.mark.parametrize("task", TASKS)
def test_seeds_reproduce_and_differ(task):
    a = make_sample(task, context_tokens=1500, depth=0.3, seed=11)
    assert a == make_sample(task, context_tokens=1500, depth=0.3, seed=11)
    b = make_sample(task, context_tokens=1500, depth=0.3, seed=12)
    assert a.prompt != b.prompt and a.answer != b.answer
    # the same seed keeps its needles at another length and depth
    assert make_sample(task, context_tokens=3000, depth=0.9, seed=11).answer == a.answer


def test_sample_errors_name_the_argument():
    with pytest.raises(ValueError, match="task: expected one of .*'passkey'.*got 'needle'"):
        make_sample("needle", context_tokens=1000, depth=0.5, seed=0)
    for depth in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="depth: expected a number in \\[0, 1\\]"):
            make_sample("passkey", context_tokens=1000, depth=depth, seed=0)
    need = min_context_tokens("decoy")
    with pytest.raises(ValueError, match=f"context_tokens: the decoy task needs at least {need} tokens.*got {need - 1}"):
        make_sample("decoy", context_tokens=need - 1, depth=0.5, seed=0)
    with pytest.raises(ValueError, match="seed: expected an int"):
        make_sample("passkey", context_tokens=1000, depth=0.5, seed="0")


def test_a_non_character_tokenizer_is_refused():
    class Pairs(CharTokenizer):
        def encode(self, text, bos=True, eos=False):
            return super().encode(text[::2], bos=bos, eos=eos)

    with pytest.raises(ValueError, match="tokenizer: expected a character-level tokenizer"):
        make_sample("passkey", context_tokens=500, depth=0.5, seed=0, tokenizer=Pairs())


# ---------------------------------------------------------------------------- forward and checkpoint
def _random_model(cfg: LlamaConfig, seed: int = 0) -> LlamaModel:
    torch.manual_seed(seed)
    model = LlamaModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.15 + (1.0 if p.dim() == 1 else 0.0))
    return model.eval()


PLAIN = LlamaConfig(dim=64, hidden_dim=96, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=99, max_seq_len=128)
HYBRID = LlamaConfig(dim=64, hidden_dim=96, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=99, max_seq_len=128,
                     layer_types=("sliding_attention", "full_attention", "sliding_attention"), sliding_window=7,
                     nope_layers=(1,))


def _paged_logits(model: LlamaModel, tokens: torch.Tensor, split: int) -> torch.Tensor:
    """Logits of every position through the paged forward: a prefill of ``split`` tokens, then one at a time."""
    cache = model.new_cache(page_size=4, num_pages=tokens.shape[0] * (-(-tokens.shape[1] // 4)))
    ids = [cache.add_sequence() for _ in range(tokens.shape[0])]
    out = [model(tokens[:, :split], cache, ids, backend="torch")]
    out += [model(tokens[:, t:t + 1], cache, ids, backend="torch") for t in range(split, tokens.shape[1])]
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("cfg", [PLAIN, HYBRID], ids=["plain", "hybrid"])
def test_training_forward_matches_the_paged_forward(cfg):
    model = _random_model(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, 29), generator=torch.Generator().manual_seed(1))
    ref = full_forward(model, tokens, chunk=8)                     # chunks of queries: the same math
    torch.testing.assert_close(full_forward(model, tokens), ref, atol=1e-4, rtol=1e-4)
    try:
        got = _paged_logits(model, tokens, split=17)
    except NotImplementedError as exc:                              # until the paged forward honours the options
        pytest.skip(f"LlamaModel's paged forward: {exc}")
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


def _loop_attention(q, k, v, window):
    """Causal (sliding-window) attention one query and one head at a time: the definition, ``[T, H, D]``."""
    T, H, D = q.shape
    out = torch.zeros_like(q)
    for i in range(T):
        lo = 0 if window is None else max(0, i - window + 1)
        for h in range(H):
            w = torch.softmax(k[lo:i + 1, h] @ q[i, h] / D ** 0.5, dim=0)
            out[i, h] = w @ v[lo:i + 1, h]
    return out


@pytest.mark.parametrize("window", [None, 1, 3, 40])
def test_attention_is_causal_with_the_sliding_window(window):
    from tinyattn.retrieval.forward import attention

    q, k, v = (torch.randn(1, 11, 2, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    got = attention(q, k, v, window=window, chunk=4)
    torch.testing.assert_close(got[0], _loop_attention(q[0], k[0], v[0], window))


@pytest.mark.parametrize("nope", [True, False])
def test_a_nope_layer_ignores_the_order_of_earlier_tokens(nope):
    """One full-attention layer without RoPE: the last position's logits depend on the set of earlier tokens,
    not on their order; with RoPE they do."""
    cfg = LlamaConfig(dim=32, hidden_dim=48, n_layers=1, n_heads=2, n_kv_heads=2, vocab_size=99,
                      nope_layers=(0,) if nope else ())
    model = _random_model(cfg)
    tokens = torch.arange(10, 30)[None]
    shuffled = torch.cat([tokens[:, :-1].flip(1), tokens[:, -1:]], dim=1)
    a, b = full_forward(model, tokens)[0, -1], full_forward(model, shuffled)[0, -1]
    assert torch.allclose(a, b, atol=1e-5) == nope


def test_checkpoint_round_trip(tmp_path):
    model = _random_model(HYBRID, seed=3)
    save_retrieval_model(model, TOK, tmp_path, training={"note": "test"})
    meta = json.loads((tmp_path / "config.json").read_text())
    assert meta["format"] == "tinyattn-retrieval" and meta["llama_config"]["nope_layers"] == [1]
    assert meta["training"] == {"note": "test"} and meta["tokenizer"]["chars"] == TOK.CHARS
    loaded, tok = load_retrieval_model(tmp_path)
    assert loaded.config == HYBRID and tok == TOK and not any(p.requires_grad for p in loaded.parameters())
    assert loaded.output.weight is loaded.tok_embeddings.weight                 # the tie survives
    for name, p in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], p), name
    tokens = torch.randint(0, 99, (1, 20), generator=torch.Generator().manual_seed(0))
    assert torch.equal(full_forward(loaded, tokens), full_forward(model, tokens))


def test_load_errors_name_the_missing_file_or_bad_format(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load_retrieval_model(tmp_path)
    save_retrieval_model(_random_model(PLAIN), TOK, tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="has no model.safetensors"):
        load_retrieval_model(tmp_path)
    save_retrieval_model(_random_model(PLAIN), TOK, tmp_path)
    meta = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**meta, "format": "llama2c"}))
    with pytest.raises(ValueError, match="has format 'llama2c', expected 'tinyattn-retrieval'"):
        load_retrieval_model(tmp_path)


# ---------------------------------------------------------------------------- training
def test_a_few_training_steps_lower_the_loss_on_a_fixed_batch():
    import random

    import torch.nn.functional as F

    from tinyattn.retrieval.recipe import TrainConfig
    from tinyattn.retrieval.train import make_batch, train

    batch = make_batch(TASKS, 300, 4, 123, random.Random(0))
    tokens, valid = batch.tokens, batch.valid
    assert batch.tasks == [TASKS[(123 + b) % 4] for b in range(4)] and batch.is_answer.sum(-1).tolist() == [
        len(make_sample(t, context_tokens=300, depth=0.5, seed=123 + b).answer) for b, t in enumerate(batch.tasks)]

    def loss(model):
        with torch.no_grad():
            logits = full_forward(model, tokens[:, :-1])
        return F.cross_entropy(logits[valid], tokens[:, 1:][valid]).item()

    small = dict(dim=64, n_layers=2, n_heads=4, hidden_dim=64, sliding_window=16, nope_layer=1)
    cfg = TrainConfig(curriculum=((300, 1),), batch_tokens=1200, lr=1e-2, warmup_steps=1, eval_samples=0,
                      model=small, circuit="previous")
    before = loss(train(cfg, progress=False)[0])                    # one step from the seeded initialisation
    cfg.curriculum = ((300, 12),)
    model, log = train(cfg, progress=False)
    again, _ = train(cfg, progress=False)                           # same seed: the same weights
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    assert len(log["steps"]) == 12 and log["steps"][0]["loss"] > log["steps"][-1]["loss"]
    assert loss(model) < before - 0.5                               # from ~ln(99) = 4.6


def test_the_written_induction_circuit_copies_before_any_training():
    """The constructed start (tinyattn.retrieval.induction_init): a random token sequence whose last 24 tokens
    repeat an earlier stretch, far beyond the sliding window, is copied well above chance with no training."""
    from tinyattn.retrieval.induction_init import write_induction_circuit
    from tinyattn.retrieval.train import _init, default_model_config

    torch.manual_seed(0)
    model = LlamaModel(default_model_config(dim=128, n_heads=4)).eval()     # the first model's shape
    _init(model)                                                     # the training's random start
    write_induction_circuit(model, nope_layer=2)
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(3, 99, (4, 300), generator=g)
    seq[:, -24:] = seq[:, 100:124]                                   # 176+ tokens back; the window is 64
    with torch.no_grad():
        pred = full_forward(model, seq[:, :-1])[:, -23:].argmax(-1)
    assert (pred == seq[:, -23:]).float().mean() > 0.1                # chance: 1/96


def test_the_context_circuit_picks_the_asked_name_before_any_training():
    """The context induction circuit (write_context_induction_circuit): at the ``<`` of the multikey question,
    with no training, the matching head's attention lands on the first digit of the asked name's value, not on
    the needles of names one letter apart or on the distractors, and the model's first answer digit is right:
    at least 15 of 16 prompts of 1024 tokens (the previous-token circuit: 0 of 16)."""
    import math

    from tinyattn.retrieval.forward import _rms_norm, attention
    from tinyattn.retrieval.induction_init import write_context_induction_circuit
    from tinyattn.retrieval.train import _init, default_model_config
    from tinyattn.models.llama import apply_rope, rope_tables

    torch.manual_seed(0)
    model = LlamaModel(default_model_config()).eval()
    _init(model)
    write_context_induction_circuit(model, nope_layer=2)
    cfg, L = model.config, 1024
    right = landed = 0
    for i in range(16):
        s = make_sample("multikey", context_tokens=L, depth=(i + 0.5) / 16, seed=i)
        digit = s.needle_positions[0][0] + s.text[s.needle_positions[0][0] - 1:].index("<") + 1  # first value digit
        x = model.tok_embeddings(torch.tensor([s.prompt])).float()
        cos, sin = (t[None] for t in rope_tables(cfg.head_dim, L, cfg.rope_theta))
        with torch.no_grad():
            for li, layer in enumerate(model.layers):
                h = _rms_norm(x, layer.attention_norm)
                q, k, v = (w(h).view(1, L, cfg.n_heads, cfg.head_dim) for w in (layer.wq, layer.wk, layer.wv))
                if cfg.uses_rope(li):
                    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
                if li == 2:
                    p = (q[0, -1, 1] @ k[0, :, 1].T / math.sqrt(cfg.head_dim)).softmax(-1)   # head 1, last query
                    landed += int(p.argmax()) == digit
                window = cfg.sliding_window if cfg.is_sliding(li) else None
                x = x + layer.wo(attention(q, k, v, window=window).reshape(1, L, -1))
                x = x + layer.ffn(_rms_norm(x, layer.ffn_norm))
            right += int(model.output(_rms_norm(x, model.norm))[0, -1].argmax()) == s.answer[0]
    assert landed >= 15 and right >= 15, (landed, right)


def test_train_retrieval_command_writes_a_loadable_checkpoint(tmp_path, capsys):
    from tinyattn.cli import main

    out = tmp_path / "m"
    rc = main(["train-retrieval", "--out", str(out), "--curriculum", "300:2", "--batch-tokens", "600", "--dim", "64",
               "--layers", "2", "--heads", "4", "--hidden-dim", "64", "--nope-layer", "1", "--circuit", "previous",
               "--eval-lengths", "300",
               "--eval-samples", "1", "--tasks", "passkey", "--no-progress"])
    assert rc == 0
    assert "passkey" in capsys.readouterr().out
    log = json.loads((out / "train_log.json").read_text())
    assert len(log["steps"]) == 2 and set(log["eval"]) == {"passkey"}
    model, _ = load_retrieval_model(out)
    assert model.config.n_layers == 2 and model.config.nope_layers == (1,)


def test_curriculum_parsing():
    from tinyattn.retrieval.command import parse_curriculum

    assert parse_curriculum("256:150:passkey,1024:300") == ((256, 150, ("passkey",)), (1024, 300))
    assert parse_curriculum("512:2:passkey+decoy") == ((512, 2, ("passkey", "decoy")),)


@pytest.mark.parametrize("columns", ["80", "120"])
def test_train_retrieval_help_shows_a_default_curriculum_that_parses_back(columns, capsys, monkeypatch):
    """argparse wraps help only at spaces (else mid-word): the printed default, its lines joined, must be the
    default itself, not "512:30 0:copy+p asskey..." (a new user copies it into --curriculum)."""
    from tinyattn.cli import main
    from tinyattn.retrieval.command import parse_curriculum
    from tinyattn.retrieval.recipe import TrainConfig

    monkeypatch.setenv("COLUMNS", columns)
    with pytest.raises(SystemExit) as exc:
        main(["train-retrieval", "--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    shown = re.search(r"--curriculum LEN:STEPS,\.\.\. .*?\(default: (.*?)\)", text).group(1)
    assert parse_curriculum(shown) == TrainConfig().curriculum, shown


@pytest.mark.parametrize("bad", ["512", "512:0", "1024:5,512:5", "a:b", "512:5:needle", "512:5:passkey:x"])
def test_train_retrieval_rejects_a_bad_curriculum(bad, capsys):
    from tinyattn.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["train-retrieval", "--out", "x", "--curriculum", bad])
    assert exc.value.code == 2 and "--curriculum" in capsys.readouterr().err


# ---------------------------------------------------------------------------- the shipped model
def test_the_shipped_model_loads_and_retrieves_passkeys():
    from tinyattn.retrieval.model import default_retrieval_dir
    from tinyattn.retrieval.train import answer_accuracy

    model, tok = load_retrieval_model()
    assert tok == TOK and model.config.nope_layers == (2,) and model.config.sliding_window == 64
    assert model.config.layer_types == ("sliding_attention", "sliding_attention", "full_attention", "sliding_attention")
    log = json.loads((default_retrieval_dir() / "train_log.json").read_text())
    assert log["parameters"] == sum(p.numel() for p in model.parameters())
    # beyond its longest training prompt (1024 tokens), needles at depths 1/8 .. 7/8
    assert answer_accuracy(model, "passkey", 1536, 4, seed=0) == 1.0              # docs/retrieval.md: 100%


def test_the_shipped_model_gives_the_same_logits_through_the_paged_forward():
    model, _ = load_retrieval_model()
    s = make_sample("multikey", context_tokens=300, depth=0.5, seed=1)
    tokens = torch.tensor([s.prompt])
    ref = full_forward(model, tokens)
    try:
        got = _paged_logits(model, tokens, split=290)              # a prefill, then 10 decode steps
    except NotImplementedError as exc:                              # until the paged forward honours the options
        pytest.skip(f"LlamaModel's paged forward: {exc}")
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
