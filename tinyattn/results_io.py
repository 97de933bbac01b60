"""Result files of the evaluation commands: one JSON document and one CSV table per result.

``python -m tinyattn eval`` (:class:`tinyattn.models.evaluate.EvalResult`) and ``eval --task``
(:class:`tinyattn.retrieval.evaluate.TaskResult`) write their results the same way: :class:`SavesRows` gives a
result class ``save_json`` / ``save_csv``, and :func:`write_result_files` is the ``--json`` / ``--csv`` /
``--plot-dir`` block of both commands.

The plots need matplotlib, an optional extra (``pip install -e ".[plots]"`` in the checkout): without it a command given
``--plot-dir`` writes the figures' data (``results.json`` and ``results.csv`` in that folder) and says how to
install it (:func:`have_matplotlib`, :data:`PLOTS_HINT`).
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

__all__ = ["SavesRows", "write_json", "write_csv", "write_result_files", "have_matplotlib", "PLOTS_HINT"]

PLOTS_HINT = 'pip install -e ".[plots]"'      # matplotlib: the one optional dependency of the plots


def have_matplotlib() -> bool:
    """Whether matplotlib can be imported (without importing it)."""
    return importlib.util.find_spec("matplotlib") is not None


def no_plots_note(instead: str) -> str:
    """The note a plotting command prints when matplotlib is missing; ``instead`` says what it wrote."""
    return f"note: matplotlib is not installed: no PNG drawn; {instead}. For the plots: {PLOTS_HINT}"


def write_json(path: str | os.PathLike, document) -> None:
    """``document`` as indented JSON (one space) and a final newline; the parent folder is created."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")


def write_csv(path: str | os.PathLike, fieldnames, rows: Iterable[dict]) -> None:
    """A CSV table with a header of ``fieldnames`` and one line per dict of ``rows``; the parent folder is
    created."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(fieldnames))
        w.writeheader()
        w.writerows(rows)


class SavesRows:
    """``save_json`` / ``save_csv`` for a result with ``rows`` (each with ``as_dict()``), a ``to_json()`` document
    and the CSV columns in the class attribute ``csv_fields``."""

    csv_fields: tuple = ()

    def to_json(self) -> dict:
        raise NotImplementedError

    def save_json(self, path: str | os.PathLike) -> None:
        """:meth:`to_json` to ``path``."""
        write_json(path, self.to_json())

    def save_csv(self, path: str | os.PathLike) -> None:
        """One line per row (``row.as_dict()``), columns ``csv_fields``, to ``path``."""
        write_csv(path, self.csv_fields, (r.as_dict() for r in self.rows))


def write_result_files(result: SavesRows, *, json_path=None, csv_path=None,
                       plot: Callable[[], Iterable] | None = None, plot_dir=None) -> None:
    """Write what a command's ``--json`` / ``--csv`` ask for and the plots ``plot()`` makes (``None``: none),
    each followed by ``wrote PATH`` on stderr. Without matplotlib, ``plot`` is not called: ``results.json`` and
    ``results.csv`` go to ``plot_dir`` instead, with a note naming the ``plots`` extra."""
    if plot is not None and not have_matplotlib():
        if plot_dir is not None:
            json_path = Path(plot_dir) / "results.json" if json_path is None else json_path
            csv_path = Path(plot_dir) / "results.csv" if csv_path is None else csv_path
        plot = None
        print(no_plots_note("the figures' data is in the JSON / CSV files below"), file=sys.stderr)
    if json_path is not None:
        result.save_json(json_path)
        print(f"wrote {json_path}", file=sys.stderr)
    if csv_path is not None:
        result.save_csv(csv_path)
        print(f"wrote {csv_path}", file=sys.stderr)
    for path in (plot() if plot is not None else ()):
        print(f"wrote {path}", file=sys.stderr)
