"""A picture of one run: ``accuracy.png`` in its folder, drawn from summary.json's history at the
run's end and by ``fedml-perfedavg show RUN --plot`` for any run, a running one included.

Left: the personalized accuracy (after each user's one-step adaptation) and the accuracy before
adaptation, against the round. Right: the training loss per round (the sampled clients' mean)
where the run recorded it, else the evaluation's personalized loss. matplotlib is the ``bench``
extra; it is imported only here, and only the ``Agg`` canvas (no display, no pyplot state).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..core.errors import ConfigError
from .files import write_atomic

logger = logging.getLogger(__name__)

PLOT = "accuracy.png"
EXTRA = "pip install 'fedml-perfedavg[bench]' (matplotlib)"

Series = Tuple[List[int], List[float]]


def series(history: Sequence[Dict[str, Any]], key: str) -> Series:
    """(rounds, values) of ``key`` over the history entries that hold a number for it."""
    points = [
        (int(entry["round"]), float(entry[key]))
        for entry in history
        if isinstance(entry.get(key), (int, float)) and not isinstance(entry.get(key), bool)
    ]
    return [r for r, _ in points], [v for _, v in points]


def loss_series(summary: Dict[str, Any]) -> Tuple[str, Series]:
    """The right panel's curve: the training loss per round where recorded, else the evaluations'
    personalized loss."""
    train = series(summary.get("train_history") or [], "train_loss")
    if train[0]:
        return "training loss (clients' mean)", train
    return "personalized loss (evaluation)", series(summary.get("history") or [], "personalized_loss")


def draw(summary: Dict[str, Any], title: str = ""):
    """The run's figure (a matplotlib Figure, not shown): what :func:`write_plot` saves."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigError(f"drawing {PLOT} needs matplotlib: {EXTRA}") from None
    history = summary.get("history") or []
    figure = Figure(figsize=(10, 3.8))
    FigureCanvasAgg(figure)
    accuracy, loss = figure.subplots(1, 2)
    for key, label in (
        ("personalized_accuracy", "personalized (after one adaptation step)"),
        ("accuracy_before_adaptation", "before adaptation"),
    ):
        rounds, values = series(history, key)
        accuracy.plot(rounds, values, marker="o" if len(rounds) < 30 else None, label=label)
    accuracy.set(xlabel="round", ylabel="mean accuracy over users", ylim=(0, 1))
    accuracy.grid(alpha=0.3)
    accuracy.legend(loc="best")
    label, (rounds, values) = loss_series(summary)
    loss.plot(rounds, values, color="tab:red", marker="o" if len(rounds) < 30 else None)
    loss.set(xlabel="round", ylabel=label)
    loss.grid(alpha=0.3)
    status = summary.get("status")
    figure.suptitle(f"{title}{' - ' if title else ''}{status}, {summary.get('rounds')} rounds")
    # fixed margins: matplotlib's constrained layout doubled the time to draw (0.16 s against 0.08),
    # paid at the end of every run
    figure.subplots_adjust(left=0.06, right=0.99, bottom=0.13, top=0.89, wspace=0.22)
    return figure


def write_plot(summary: Dict[str, Any], run_dir: str, path: Optional[str] = None) -> str:
    """Draw the run and save it (atomically) as ``path`` (default ``run_dir/accuracy.png``)."""
    target = path or os.path.join(run_dir, PLOT)
    figure = draw(summary, os.path.basename(os.path.normpath(run_dir)))
    write_atomic(target, lambda stream: figure.savefig(stream, format="png", dpi=100))
    return target


def plot_at_end(summary: Dict[str, Any], run_dir: str) -> None:
    """At a run's end: its accuracy.png, or a line saying why there is none (never fails the run,
    whose record is already written)."""
    try:
        write_plot(summary, run_dir)
    except ConfigError as err:
        logger.info("%s not drawn: %s", PLOT, err)
    except Exception as err:  # noqa: BLE001  (a picture must not turn a finished run into a failed one)
        logger.warning("%s not drawn: %s: %s", PLOT, type(err).__name__, err)
