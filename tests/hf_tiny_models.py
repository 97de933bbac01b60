"""Tiny random Hugging Face models of four families (Llama with GQA, Qwen2 with MQA, Mistral with a sliding window,
GPT-2), their padded prompts and TinyAttnCaches: shared by tests/integrations/test_hf_generation.py and
test_hf_enable.py (with ``--import-mode=importlib`` a test module cannot import another)."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("tinyattn.integrations.hf")

VOCAB = 96
PAD = 0
PAGE = 4              # tokens per page in every cache here
BUDGETS = {"dense": None, "covering": 64, "sparse": 2}
FAMILIES = ["llama", "qwen2", "mistral", "gpt2"]
LENGTHS = (7, 13, 10)  # real tokens per row
WIDTH = 17             # columns: every left-padded row starts with >= 4 padding columns (a whole prefill chunk)


def _config(family, seed_offset=0):
    common = dict(vocab_size=VOCAB, pad_token_id=PAD, bos_token_id=1, eos_token_id=2)
    if family == "llama":
        return transformers.LlamaConfig(hidden_size=36, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=6, num_key_value_heads=2,
                                        max_position_embeddings=256, initializer_range=0.3, **common)
    if family == "qwen2":
        return transformers.Qwen2Config(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=256,
                                        initializer_range=0.3, **common)
    if family == "mistral":
        return transformers.MistralConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                          sliding_window=12, initializer_range=0.3, **common)
    if family == "gpt2":
        return transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=256, initializer_range=0.3,
                                       **common)
    raise ValueError(family)


_MODELS: dict = {}


def models(family, seed=0):
    """(tinyattn model, stock sdpa model) with identical weights, cached per (family, seed)."""
    if (family, seed) not in _MODELS:
        torch.manual_seed(seed)
        stock = transformers.AutoModelForCausalLM.from_config(_config(family), attn_implementation="sdpa").eval()
        tiny = copy.deepcopy(stock)
        tiny.set_attn_implementation("tinyattn")
        _MODELS[family, seed] = tiny, stock
    return _MODELS[family, seed]


def cache(model, budget="dense"):
    return hf.TinyAttnCache(model.config, page_size=PAGE, page_budget=BUDGETS[budget], backend="torch")


def prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g)


def inputs(padding, rows=(0, 1, 2)):
    """(input_ids, attention_mask) [len(rows), WIDTH] of the prompts LENGTHS[rows], padded as asked:
    ``left``: >= 4 leading padding columns in every row; ``right``: real tokens first (transformers' testers' masks);
    ``holes``: pad tokens inside the rows as well as before them, and the mask is ``input_ids.ne(pad)``."""
    ids = torch.full((len(rows), WIDTH), PAD, dtype=torch.long)
    for i, r in enumerate(rows):
        p, n = prompt(LENGTHS[r], seed=10 + r), LENGTHS[r]
        if padding == "left":
            ids[i, WIDTH - n:] = p
        elif padding == "right":
            ids[i, :n] = p
        elif padding == "holes":
            cols = [c for c in range(WIDTH) if (c + r) % 4 != 1 or c == WIDTH - 1][-n:]   # a hole every 4th column
            ids[i, cols] = p
        else:
            raise ValueError(padding)
    return ids, ids.ne(PAD).long()



def sparse_calls(prof) -> int:
    """Attention calls that read fewer pages than their rows hold (tinyattn's profiler, issue 6)."""
    return sum(1 for r in prof.records if r.op == "attention" and r.sparse)
