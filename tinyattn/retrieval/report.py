"""Tables and plots of a retrieval evaluation (:class:`tinyattn.retrieval.evaluate.TaskResult`).

- :func:`format_task_table`: a Markdown table per task and page size: a row per (context, budget), a column
  per policy, accuracy over every depth (sample-weighted), the dense accuracy beside.
- :func:`plot_depth_heatmaps`: the needle-in-a-haystack figure: accuracy over (needle depth x context) as a
  red-to-green heatmap, one panel per (policy, budget), one PNG per (task, page size).
- :func:`plot_budget_curves`: Quest's accuracy-vs-budget figure: accuracy (mean over depths) against the
  budget fraction, a line per policy, dense dashed, one panel per context, one PNG per (task, page size).
- :func:`plot_task_results`: both.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from .evaluate import DENSE, TaskResult, format_fraction

__all__ = ["format_task_table", "plot_depth_heatmaps", "plot_budget_curves", "plot_task_results", "POLICY_STYLES"]

#: Colour and marker of each policy in every plot (the colours of docs/accuracy.md's other plots).
POLICY_STYLES = {"quest": ("C0", "o"), "meanstd": ("C9", "s"), "oracle": ("k", "*"), "streaming": ("C1", "v"),
                 "h2o": ("C3", "^"), "random": ("C7", "x")}
#: Line styles that keep overlapping curves (quest, meanstd and oracle often coincide) visible.
_LINESTYLES = {"quest": ("-", 9, 2.4), "meanstd": ("--", 6, 1.6), "oracle": (":", 7, 1.6)}


def _pct(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.0%}"


def format_task_table(result: TaskResult, metric: str = "accuracy") -> str:
    """Markdown tables of ``metric`` (``"accuracy"``: exact match, or ``"token_accuracy"``) averaged over the
    needle depths: one table per (task, page size), a row per (context, budget fraction) with its page and
    token budget, a column per sparse policy, then dense."""
    if metric not in ("accuracy", "token_accuracy"):
        raise ValueError(f"metric: expected 'accuracy' or 'token_accuracy', got {metric!r}")
    sparse = [p for p in result.policies if p != DENSE]
    blocks = []
    for task in result.tasks:
        for ps in result.page_sizes:
            depths = ", ".join(f"{d:g}" for d in result.depths)
            lines = [f"{task}, page_size={ps}: {metric.replace('_', ' ')} over depths {depths} "
                     f"({_samples(result.options.get('samples', '?'))} each)", "",
                     "| context | budget | page_budget (tokens) | " + " | ".join(sparse) + " | dense |",
                     "|---" * (len(sparse) + 4) + "|"]
            for context in result.contexts:
                dense = _pct(result.accuracy(metric, task=task, policy=DENSE, context=context, page_size=ps))
                for frac in result.budget_fractions or [None]:
                    rows = result.select(task=task, context=context, page_size=ps, budget_fraction=frac)
                    budget = next((r for r in rows if r.page_budget is not None), None)
                    pages = "" if budget is None else f"{budget.page_budget} ({budget.token_budget})"
                    cells = [_pct(result.accuracy(metric, task=task, policy=p, context=context, page_size=ps,
                                                  budget_fraction=frac)) for p in sparse]
                    lines.append(f"| {context} | {format_fraction(frac)} | {pages} | " + " | ".join(cells)
                                 + f" | {dense} |")
            blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def _pyplot():
    try:
        import matplotlib
    except ModuleNotFoundError as exc:      # the CLI notes it and writes CSV / JSON; a Python caller gets the fix
        from ..results_io import PLOTS_HINT

        raise ModuleNotFoundError(f"the retrieval plots need matplotlib, the plots extra: {PLOTS_HINT}") from exc

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_depth_heatmaps(result: TaskResult, out_dir: str | os.PathLike, prefix: str = "") -> list[Path]:
    """``<prefix>heatmap_<task>_ps<page_size>.png``: accuracy per (needle depth, context), one panel per
    (policy, budget fraction) (rows: policies, columns: budgets; dense alone in its row), cells annotated
    with the accuracy in percent. Returns the paths."""
    plt = _pyplot()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    contexts, depths, fractions = result.contexts, result.depths, result.budget_fractions
    policies = result.policies
    n_cols = max(len(fractions), 1)
    paths = []
    for task in result.tasks:
        for ps in result.page_sizes:
            fig, axes = plt.subplots(len(policies), n_cols, squeeze=False, layout="constrained",
                                     figsize=(1.6 + 0.5 * len(contexts) * n_cols + 0.3 * n_cols,
                                              0.6 + 0.26 * len(depths) * len(policies) + 0.5 * len(policies)))
            image = None
            for i, policy in enumerate(policies):
                for j in range(n_cols):
                    ax = axes[i][j]
                    frac = None if policy == DENSE else (fractions[j] if fractions else None)
                    if policy == DENSE and j > 0:
                        ax.axis("off")
                        continue
                    grid = [[result.accuracy(task=task, policy=policy, context=c, depth=d, page_size=ps,
                                             budget_fraction=frac) for c in contexts] for d in depths]
                    image = ax.imshow(grid, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto", origin="upper")
                    for di, row in enumerate(grid):
                        for ci, v in enumerate(row):
                            if not math.isnan(v):
                                ax.text(ci, di, f"{v * 100:.0f}", ha="center", va="center", fontsize=7)
                    ax.set_xticks(range(len(contexts)))
                    bottom = i == len(policies) - 1 or policy == DENSE
                    ax.set_xticklabels([_k(c) for c in contexts] if bottom else [], fontsize=7)
                    ax.set_yticks(range(len(depths)))
                    ax.set_yticklabels([f"{d:.0%}" for d in depths] if j == 0 else [], fontsize=7)
                    ax.set_title(policy if frac is None else f"{policy}, budget {format_fraction(frac)}", fontsize=8)
                    if j == 0:
                        ax.set_ylabel("needle depth", fontsize=8)
                    if bottom:
                        ax.set_xlabel("context (tokens)", fontsize=8)
            if image is not None:
                fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.5, label="accuracy (exact match)")
            fig.suptitle(f"{task}: accuracy by needle depth and context, page size {ps} "
                         f"({result.options.get('samples', '?')} samples per cell)", fontsize=10)
            paths.append(_save(plt, fig, out_dir / f"{prefix}heatmap_{task}_ps{ps}.png"))
    return paths


def _save(plt, fig, path: Path) -> Path:
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _k(tokens: int) -> str:
    return f"{tokens // 1024}K" if tokens % 1024 == 0 else str(tokens)


def plot_budget_curves(result: TaskResult, out_dir: str | os.PathLike, prefix: str = "") -> list[Path]:
    """``<prefix>budget_<task>_ps<page_size>.png``: accuracy (mean over depths) against the budget fraction of
    the context (log 2 axis), one line per sparse policy, dense as a dashed line, one panel per context.
    Nothing is written without a sparse row. Returns the paths."""
    plt = _pyplot()
    from matplotlib.ticker import PercentFormatter

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fractions = sorted(result.budget_fractions)
    sparse = [p for p in result.policies if p != DENSE]
    if not fractions or not sparse:
        return []
    paths = []
    for task in result.tasks:
        for ps in result.page_sizes:
            contexts = result.contexts
            fig, axes = plt.subplots(1, len(contexts), figsize=(3.2 * len(contexts) + 1.4, 3.4), squeeze=False,
                                     sharey=True, layout="constrained")
            for ax, context in zip(axes[0], contexts):
                for i, policy in enumerate(sparse):
                    ys = [result.accuracy(task=task, policy=policy, context=context, page_size=ps,
                                          budget_fraction=f) for f in fractions]
                    color, marker = POLICY_STYLES.get(policy, (f"C{i}", "o"))
                    style, size, width = _LINESTYLES.get(policy, ("-", 6, 1.6))
                    ax.plot(fractions, ys, marker=marker, color=color, label=policy, linestyle=style, linewidth=width,
                            markersize=size, markerfacecolor="none" if policy == "quest" else color)
                dense = result.accuracy(task=task, policy=DENSE, context=context, page_size=ps)
                if not math.isnan(dense):
                    ax.axhline(dense, color="k", linestyle="--", linewidth=1, label="dense")
                ax.set_xscale("log", base=2)
                ax.set_xticks(fractions)
                ax.set_xticklabels([format_fraction(f) for f in fractions], fontsize=8)
                ax.minorticks_off()
                ax.set_ylim(-0.04, 1.04)
                ax.yaxis.set_major_formatter(PercentFormatter(1.0))
                ax.grid(True, alpha=0.3)
                ax.set_title(f"context {context} tokens", fontsize=9)
                ax.set_xlabel("budget (fraction of the context)", fontsize=8)
            axes[0][0].set_ylabel("accuracy (exact match)")
            handles, labels = axes[0][-1].get_legend_handles_labels()
            fig.legend(handles, labels, fontsize=8, loc="outside right center")
            fig.suptitle(f"{task}: accuracy vs budget, page size {ps} (mean over needle depths "
                         f"{', '.join(f'{d:.0%}' for d in result.depths)})", fontsize=10)
            paths.append(_save(plt, fig, out_dir / f"{prefix}budget_{task}_ps{ps}.png"))
    return paths


def plot_task_results(result: TaskResult, out_dir: str | os.PathLike, prefix: str = "") -> list[Path]:
    """:func:`plot_depth_heatmaps` and :func:`plot_budget_curves` into ``out_dir``; the paths written."""
    return plot_depth_heatmaps(result, out_dir, prefix) + plot_budget_curves(result, out_dir, prefix)


def _samples(n) -> str:
    return "1 sample" if n == 1 else f"{n} samples"
