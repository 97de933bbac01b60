"""Plug-ins: one small interface whose hooks the engine calls, and the three shipped plug-ins.

=====================  ===========================  ===============================================================
hook                   when                         what it may do
=====================  ===========================  ===============================================================
``layer_sparsity``     every step, every layer      choose the layer's attention: a :class:`tinyattn.SparsityConfig`
                                                    (dense, or a policy and a page budget)
``after_layer``        decode steps, after layer l  return a ``[B]`` bool mask of rows that stop at layer l
``after_logits``       every new token              change a request's logits ``[V]`` before sampling
``release``            a request leaves the cache   drop per-request state (finished, aborted, preempted)
=====================  ===========================  ===============================================================

Plug-ins apply in order; each ``layer_sparsity`` receives the previous one's choice. Shipped:

- :class:`LayerPolicies`: a selection policy (and budget) per layer, from the existing policies.
- :class:`EarlyExit`: CALM-style entropy early exit (Schuster et al., "Confident Adaptive Language Modeling",
  NeurIPS 2022).
- :class:`ApproximateAttention`: dense first / last layers and a per-layer page-budget schedule in between.

Measured effect of each on NLL and speed: docs/engine.md.
"""

from __future__ import annotations

import torch

from tinyattn.layer import SparsityConfig

__all__ = ["Plugin", "LayerPolicies", "EarlyExit", "ApproximateAttention"]


class Plugin:
    """Base class: every hook is a no-op; override the ones you need (the engine skips ``after_layer``
    entirely unless a plug-in overrides it)."""

    name = "plugin"

    def layer_sparsity(self, layer: int, sparsity: SparsityConfig, *, num_layers: int, decode: bool
                       ) -> SparsityConfig:
        """The attention of ``layer`` this step (``sparsity``: the choice so far). Return the *same object*
        for the same choice every step: the engine keeps one planned attention layer per config."""
        return sparsity

    def after_layer(self, layer: int, hidden: torch.Tensor, step) -> torch.Tensor | None:
        """Decode steps: ``hidden`` ``[B, 1, dim]`` after ``layer``; return ``[B]`` bool, True = stop this row
        here (its logits come from this state), or ``None``. ``step``: a :class:`tinyattn.engine.runner.StepContext`."""
        return None

    def after_logits(self, request, logits: torch.Tensor) -> torch.Tensor:
        """The logits ``[V]`` fp32 a new token of ``request`` is drawn from; return them, changed or not."""
        return logits

    def release(self, request) -> None:
        """``request`` gives its pages back (finished, aborted or preempted): forget its state."""

    def describe(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return self.describe()


def _check_layer_keys(name: str, mapping: dict, num_layers: int) -> None:
    bad = [k for k in mapping if not isinstance(k, int) or not -num_layers <= k < num_layers]
    if bad:
        raise ValueError(f"{name}: expected layer indices in [0, {num_layers}), got {bad[0]!r}")


class LayerPolicies(Plugin):
    """A selection policy, and optionally a page budget, per layer.

    Args:
        policies: ``{layer: policy}`` (a name of :data:`tinyattn.selection.POLICIES` or an instance); layers not
            listed keep the engine's choice. Negative layers count from the end.
        page_budgets: ``{layer: pages}``; ``None`` for a layer = dense there. Layers not listed keep the budget
            of the choice so far (the engine's ``page_budget``).

    Example: Quest everywhere but H2O in the last layer, with a larger budget there::

        LayerPolicies({-1: "h2o"}, page_budgets={-1: 6})
    """

    name = "layer-policies"

    def __init__(self, policies: dict | None = None, page_budgets: dict | None = None):
        self.policies = dict(policies or {})
        self.page_budgets = dict(page_budgets or {})
        self._built: dict[int, SparsityConfig] = {}
        self._base = None

    def describe(self) -> str:
        return f"LayerPolicies({self.policies}, page_budgets={self.page_budgets})"

    def layer_sparsity(self, layer, sparsity, *, num_layers, decode):
        if self._base is not sparsity:
            self._build(sparsity, num_layers)
        return self._built.get(layer, sparsity)

    def _build(self, base: SparsityConfig, num_layers: int) -> None:
        _check_layer_keys("policies", self.policies, num_layers)
        _check_layer_keys("page_budgets", self.page_budgets, num_layers)
        pol = {k % num_layers: v for k, v in self.policies.items()}
        bud = {k % num_layers: v for k, v in self.page_budgets.items()}
        self._base = base
        self._built = {}
        for li in set(pol) | set(bud):
            budget = bud[li] if li in bud else (base.page_budget if base.layer_is_sparse(li) else None)
            self._built[li] = SparsityConfig(page_budget=budget, num_sink_pages=base.num_sink_pages,
                                             num_recent_pages=base.num_recent_pages, dense_layers=0,
                                             policy=pol.get(li, base.policy))


class ApproximateAttention(Plugin):
    """Approximate attention by depth: dense first and last layers, a page-budget schedule in between.

    Args:
        dense_first, dense_last: leading / trailing layers kept dense at decode.
        page_budgets: budget of each middle layer, a list (one per middle layer) or ``"taper"``: from the
            engine's ``page_budget`` in the first middle layer down to ``min_budget`` in the last, linearly.
        min_budget: the taper's last budget (>= the forced pages: sinks + recent).
    """

    name = "approx-attention"

    def __init__(self, *, dense_first: int = 1, dense_last: int = 1, page_budgets="taper", min_budget: int = 2):
        for n, v in (("dense_first", dense_first), ("dense_last", dense_last), ("min_budget", min_budget)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{n}: expected an int >= 0, got {v!r}")
        if page_budgets != "taper" and (not isinstance(page_budgets, (list, tuple))
                                         or any(b is not None and (not isinstance(b, int) or b < 1)
                                                for b in page_budgets)):
            raise ValueError(f"page_budgets: expected 'taper' or a list of ints >= 1 (None = dense), "
                             f"got {page_budgets!r}")
        self.dense_first, self.dense_last = dense_first, dense_last
        self.page_budgets, self.min_budget = page_budgets, min_budget
        self._base = None
        self._configs: list[SparsityConfig] = []

    def describe(self) -> str:
        return (f"ApproximateAttention(dense_first={self.dense_first}, dense_last={self.dense_last}, "
                f"page_budgets={self.page_budgets!r})")

    def budgets(self, base_budget: int | None, num_layers: int) -> list[int | None]:
        """The page budget of every layer (``None`` = dense)."""
        middle = list(range(self.dense_first, num_layers - self.dense_last))
        out: list[int | None] = [None] * num_layers
        if base_budget is None or not middle:
            return out
        if self.page_budgets == "taper":
            lo = min(self.min_budget, base_budget)
            n = len(middle)
            sched = [round(base_budget - (base_budget - lo) * i / max(n - 1, 1)) for i in range(n)]
        else:
            if len(self.page_budgets) != len(middle):
                raise ValueError(f"page_budgets: expected {len(middle)} budgets (layers {middle[0]}..{middle[-1]}), "
                                 f"got {len(self.page_budgets)}")
            sched = list(self.page_budgets)
        for li, b in zip(middle, sched):
            out[li] = b
        return out

    def layer_sparsity(self, layer, sparsity, *, num_layers, decode):
        if self._base is not sparsity:
            self._base = sparsity
            budgets = self.budgets(sparsity.page_budget, num_layers)
            by_budget: dict = {}
            self._configs = []
            for b in budgets:
                if b not in by_budget:
                    by_budget[b] = SparsityConfig(
                        page_budget=b, num_sink_pages=sparsity.num_sink_pages if b else 0,
                        num_recent_pages=sparsity.num_recent_pages if b else 1, dense_layers=0,
                        policy=sparsity.policy)
                self._configs.append(by_budget[b])
        return self._configs[layer]


class EarlyExit(Plugin):
    """CALM-style early exit: a decode token stops after layer ``l`` when the entropy of the prediction made
    from layer ``l``'s hidden state (the model's own final norm and classifier) is below ``threshold``.

    The token's logits then come from that state. The layers it skips still write its K/V, computed from the
    exit state (CALM's state propagation), so later tokens attend to a full cache. Prefill runs every layer.

    Args:
        threshold: entropy in nats (a uniform distribution over the 512 tokens of stories260K has 6.24).
        min_layer: the first layer after which a token may exit (earlier layers always run); default
            ``3 * n_layers // 4`` (layer 3 of stories260K's 5). Earlier exits need exit heads trained for them
            (CALM trains them): with the model's own final head, an early layer's state still looks like its
            input token's embedding (tied classifier), so it predicts that token with confidence (99.8% of
            stories260K's low-entropy predictions after layer 1 are the input token). On
            stories260K, exits from layer 1 raise the NLL from 1.15 to 3-4.5 nats (docs/engine.md).

    The engine counts the exits and skipped layers (``EngineStats.early_exits``, ``layers_skipped``).
    """

    name = "early-exit"

    def __init__(self, threshold: float = 0.25, *, min_layer: int | None = None):
        if not threshold >= 0:
            raise ValueError(f"threshold: expected entropy in nats >= 0, got {threshold!r}")
        if min_layer is not None and (isinstance(min_layer, bool) or not isinstance(min_layer, int) or min_layer < 0):
            raise ValueError(f"min_layer: expected an int >= 0 or None, got {min_layer!r}")
        self.threshold, self.min_layer = float(threshold), min_layer

    def first_exit_layer(self, num_layers: int) -> int:
        """The first layer a token may stop after: ``min_layer``, or three quarters of the depth."""
        return self.min_layer if self.min_layer is not None else (3 * num_layers) // 4

    def describe(self) -> str:
        return f"EarlyExit(threshold={self.threshold}, min_layer={self.min_layer})"

    def after_layer(self, layer, hidden, step):
        model = step.model
        if layer < self.first_exit_layer(model.config.n_layers):
            return None
        logp = torch.log_softmax(model.output(model.norm(hidden[:, -1])).float(), dim=-1)   # [B, V]
        entropy = -(logp.exp() * logp).sum(-1)
        return entropy < self.threshold
