"""``EngineStats``: counters of an :class:`tinyattn.engine.Engine` since it was built."""

from __future__ import annotations

from dataclasses import dataclass, field

from tinyattn.metrics import PagesAttended

__all__ = ["EngineStats"]


@dataclass
class EngineStats:
    """Counters of an engine's life (all steps so far).

    - ``steps``: calls of :meth:`Engine.step` that ran a forward; ``preemptions``: requests that lost their pages.
    - ``requests_added`` / ``requests_finished`` (any reason) / ``requests_aborted`` (among the finished).
    - ``prefill_tokens``: tokens run through prefill chunks (recomputed ones included); ``recomputed_tokens``:
      tokens whose K/V a preemption threw away (computed again later, by prefill or replay); ``generated_tokens``: new tokens sampled.
    - ``decode_batch_sizes``: rows of each step's decode forward (0 when the step only prefilled);
      ``step_tokens``: tokens each step scheduled (decode + prefill, at most ``max_num_batched_tokens``).
    - ``peak_pages``: most pages in use at once; ``num_pages``: the pool.
    - ``early_exits``: decode rows that stopped before the last layer; ``layers_skipped``: layers they skipped;
      ``decode_rows``: rows through decode forwards (replayed ones included).
    - ``graphed_steps``: decode forwards replayed from a CUDA graph (``Engine(cuda_graphs=True)``).
    - ``pages_attended``: a :class:`tinyattn.metrics.PagesAttended` (with a page budget; else ``None``): the pages
      each (sparse layer, KV head, row, eager decode forward) attended, as the selection kept them (``top_p`` keeps
      a varying count): ``pages_attended.summary()`` gives the mean, min / median / max and the histogram.
    """

    steps: int = 0
    preemptions: int = 0
    requests_added: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    prefill_tokens: int = 0
    recomputed_tokens: int = 0
    generated_tokens: int = 0
    decode_rows: int = 0
    early_exits: int = 0
    layers_skipped: int = 0
    peak_pages: int = 0
    graphed_steps: int = 0
    num_pages: int = 0
    decode_batch_sizes: list[int] = field(default_factory=list)
    step_tokens: list[int] = field(default_factory=list)
    pages_attended: PagesAttended | None = None

    @property
    def mean_decode_batch(self) -> float:
        sizes = [b for b in self.decode_batch_sizes if b]
        return sum(sizes) / len(sizes) if sizes else 0.0

    @property
    def layers_skipped_per_token(self) -> float:
        return self.layers_skipped / self.decode_rows if self.decode_rows else 0.0

    def format(self) -> str:
        return "\n".join([
            f"requests:     {self.requests_added} added, {self.requests_finished} finished "
            f"({self.requests_aborted} aborted), {self.preemptions} preemptions",
            f"steps:        {self.steps}, mean decode batch {self.mean_decode_batch:.1f}, "
            f"max {max(self.decode_batch_sizes, default=0)}",
            f"tokens:       {self.prefill_tokens} prefilled ({self.recomputed_tokens} lost to preemptions), "
            f"{self.generated_tokens} generated",
            f"KV pages:     peak {self.peak_pages} of {self.num_pages}",
        ] + ([f"early exit:   {self.early_exits} of {self.decode_rows} decode rows, "
              f"{self.layers_skipped_per_token:.2f} layers skipped per row"] if self.early_exits else [])
          + ([f"cuda graphs:  {self.graphed_steps} decode forwards replayed"] if self.graphed_steps else [])
          + ([f"attended:     {self.pages_attended.format()}"]
             if self.pages_attended is not None and self.pages_attended.hist is not None else []))
