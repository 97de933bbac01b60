"""The engine's forward pass: :class:`tinyattn.models.LlamaModel`'s, with the plug-ins' hooks.

:meth:`ModelRunner.forward` hands every layer the :class:`tinyattn.PagedAttention` the plug-ins chose for it
this step (:class:`LayerwiseAttention`: one attention layer per distinct :class:`tinyattn.SparsityConfig`, each
planned once per step). Without an early-exit hook it calls ``LlamaModel.forward`` itself. With one (decode
steps), it runs the model's forward from the same building blocks (``start_step``, ``embed``, ``layer_forward``,
``write_kv``, ``head``: the same math and calls, so bitwise the model's logits when no row exits) and asks the
hooks after each layer which rows stop. An exited row's hidden state stays frozen; the later layers still write its K/V, computed from that
frozen state (CALM's state propagation), so later tokens attend to a full cache. When every row has exited,
the later layers only compute and write K/V (no attention, no FFN): that is where early exit saves time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tinyattn.layer import PagedAttention, SparsityConfig
from tinyattn.ops.spans import layer as profile_layer

__all__ = ["ModelRunner", "LayerwiseAttention", "StepContext"]


@dataclass
class StepContext:
    """What a plug-in's per-layer hook sees: the model, the step's requests (row order), whether it is a
    decode step, and the rows that exited so far (``[B]`` bool)."""

    model: object
    requests: list
    decode: bool
    exited: torch.Tensor


class LayerwiseAttention:
    """A :class:`tinyattn.PagedAttention` per layer, chosen per step; the model's forward sees one object.

    ``begin`` plans each distinct attention layer once; calling it with layer ``li`` runs ``li``'s.
    """

    def __init__(self, layers: list[PagedAttention]):
        self.layers = layers
        self.unique = list({id(a): a for a in layers}.values())

    def begin(self, *args, **kwargs) -> "LayerwiseAttention":
        for a in self.unique:
            a.begin(*args, **kwargs)
        return self

    def __call__(self, layer: int, *args, **kwargs):
        return self.layers[layer](layer, *args, **kwargs)


class ModelRunner:
    """Runs :class:`LlamaModel` steps over the engine's cache with per-layer attention and hooks.

    Args:
        model: a :class:`tinyattn.models.LlamaModel`. cache: its :class:`tinyattn.PagedKVCache`.
        sparsity: the engine's :class:`SparsityConfig`, before plug-ins. backend: ``None``, ``"torch"``, ``"triton"``.
        plugins: :class:`tinyattn.engine.Plugin` instances, applied in order.
    """

    def __init__(self, model, cache, sparsity: SparsityConfig, *, backend=None, plugins=()):
        self.model, self.cache, self.sparsity, self.backend = model, cache, sparsity, backend
        self.plugins = list(plugins)
        self._attention: dict[SparsityConfig, PagedAttention] = {}
        self._exit_hooks = [p for p in self.plugins if _overrides(p, "after_layer")]
        self.graphs = None     # a tinyattn.models.graphs.DecodeGraphs over the cache (Engine(cuda_graphs=True))
        self.attended = None   # a tinyattn.metrics.PagesAttended every attention layer counts its sparse pages into

    def attention_for(self, config: SparsityConfig) -> PagedAttention:
        """The one attention layer of ``config`` (built once, its plan's buffers reused every step)."""
        attn = self._attention.get(config)
        if attn is None:
            attn = self._attention[config] = PagedAttention(config, backend=self.backend)
            attn.attended = self.attended
        return attn

    @property
    def policies(self) -> list:
        """Every selection policy in use (the engine clears a released request's state in each)."""
        return list({id(a.sparsity.policy): a.sparsity.policy for a in self._attention.values()}.values())

    def layer_configs(self, decode: bool) -> list[SparsityConfig]:
        configs = []
        n = self.model.config.n_layers
        for li in range(n):
            config = self.sparsity
            for p in self.plugins:
                config = p.layer_sparsity(li, config, num_layers=n, decode=decode)
            configs.append(config)
        return configs

    def step_attention(self, decode: bool):
        configs = self.layer_configs(decode)
        if all(c is configs[0] for c in configs):
            return self.attention_for(configs[0])
        return LayerwiseAttention([self.attention_for(c) for c in configs])

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, seq_ids: list[int], *, decode: bool, requests=()
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append ``tokens`` ``[B, T]`` to ``seq_ids``; return the last position's logits ``[B, V]`` fp32 and,
        when an early-exit hook ran, the layer each row exited after (``[B]`` int64; ``n_layers - 1`` = none)."""
        model, cache = self.model, self.cache
        attention = self.step_attention(decode)
        hooks = self._exit_hooks if decode else []
        if (decode and not hooks and self.graphs is not None and getattr(attention, "sparsity", None) is self.sparsity
                and tokens.shape[1] == 1 and self.graphs.can_replay(len(seq_ids))):
            # the model's decode step, replayed from a CUDA graph (one per batch bucket; host bookkeeping outside)
            return self.graphs.step(list(seq_ids), tokens[:, 0].tolist()), None
        if not hooks:                  # the model's own forward, through the step's attention layer(s)
            return model(tokens, cache, list(seq_ids), sparse=decode, attention=attention, last_only=True), None
        cfg = model.config
        B, T = tokens.shape
        attention.metrics = None
        step = model.start_step(tokens, cache, list(seq_ids), attention=attention, decode=decode)
        exited = torch.zeros(B, dtype=torch.bool, device=model.device)
        exit_layer = torch.full((B,), cfg.n_layers - 1, dtype=torch.long)
        all_exited = False
        ctx = StepContext(model=model, requests=list(requests), decode=decode, exited=exited)
        x = model.embed(step)                                                        # [B*T, dim]
        for li in range(cfg.n_layers):
            with profile_layer(li):
                if all_exited:                 # K/V from the exit state only: no attention, no FFN
                    model.write_kv(li, x, step)
                    continue
                y = model.layer_forward(li, x, step)            # the model's own block: same math, same calls
                if bool(exited.any()):
                    y = torch.where(exited.repeat_interleave(T)[:, None], x, y)   # exited rows keep their state
                x = y
            if li < cfg.n_layers - 1:
                for hook in hooks:
                    stop = hook.after_layer(li, x.view(B, T, -1), ctx)
                    if stop is not None:
                        new = stop.to(exited.device) & ~exited
                        exit_layer[new.cpu()] = li
                        exited |= new
                all_exited = bool(exited.all())
        return model.head(x, step, last_only=True), exit_layer


def _overrides(plugin, name: str) -> bool:
    from .plugins import Plugin

    return getattr(type(plugin), name) is not getattr(Plugin, name)
