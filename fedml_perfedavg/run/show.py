"""``fedml-perfedavg show RUN_DIR [RUN_DIR ...] [--plot]``: a run's summary and per-user table, or
several runs side by side; ``--plot`` draws each run's accuracy.png (run/plot.py)."""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from typing import Any, Dict, List, Optional

from ..algorithms.registry import algorithm_names, method_choices
from ..core.errors import ConfigError, OutputError


def read_summary(path: str) -> Dict[str, Any]:
    """The summary.json of a run directory (or the file itself)."""
    file = os.path.join(path, "summary.json") if os.path.isdir(path) else path
    try:
        with open(file) as stream:
            return json.load(stream)
    except FileNotFoundError:
        raise ConfigError(f"{path!r}: no summary.json there; give a run directory (output_dir/run_name)") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"{file!r}: not a readable summary ({err})") from None


def _percent(value: Optional[float]) -> str:
    return "-" if value is None else f"{100 * value:.2f}"


def _method(summary: Dict[str, Any]) -> str:
    train = summary.get("config", {}).get("train_args", {})
    name = train.get("federated_optimizer", "?")
    choices = method_choices(name, train) if name in algorithm_names() else []
    return f"{name} ({', '.join(choices)})" if choices else name


def status_of(summary: Dict[str, Any]) -> str:
    """The run's status, with ``running`` checked: a run whose process is gone (killed without a
    word: SIGKILL, a lost machine) is ``dead``; one on another host cannot be checked from here."""
    status = str(summary.get("status"))
    process = summary.get("process")
    if status != "running" or not isinstance(process, dict):
        return status
    from .reporting import process_start_ticks

    host, pid = process.get("host"), process.get("pid")
    if host != socket.gethostname():
        return f"running on {host} (pid {pid}; not checked from here)"
    alive = isinstance(pid, int) and process_start_ticks(pid) is not None
    if alive and isinstance(pid, int) and process.get("start_ticks") is not None:
        alive = process_start_ticks(pid) == process["start_ticks"]  # the pid may belong to another process now
    if alive:
        return f"running (pid {pid})"
    return (
        f"dead (summary.json says running, but its process {pid} on this host is gone: killed or crashed; "
        f"what it measured is below)"
    )


def _privacy_line(privacy: Dict[str, Any]) -> str:
    return (
        f"epsilon {_figure(privacy.get('epsilon'))} over {privacy.get('uses')} uses of its data (DP-SGD"
        f"{_stated(privacy)})"
    )


def _stated(privacy: Dict[str, Any]) -> str:
    """Which accountant an epsilon is, at which delta, as the record says (", by A at delta D"; ""
    for a record of an earlier version that did not say)."""
    accountant = privacy.get("epsilon_from")
    if accountant is None:
        return ""
    bound = " (an RDP bound: each organization's own record has the accountant's figure)"
    reported = privacy.get("reported_by") and accountant.endswith(".rdp")
    delta = privacy.get("delta")
    return f", by {accountant}" + (f" at delta {delta:g}" if delta is not None else "") + (bound if reported else "")


def describe_silo(path: str, summary: Dict[str, Any]) -> str:
    """A data owner's own record (``silo-rank-R/summary.json``): its user's figures and DP account."""
    lines = [
        f"{path}: silo rank {summary.get('rank')} (user {summary.get('user')}), {summary.get('status')}, "
        f"last evaluated the model of round {summary.get('evaluated_round')}"
    ]
    if summary.get("error"):
        lines.append(f"  ended by: {summary['error']}")
    lines.append(
        f"  user {summary.get('user')}'s personalized accuracy {_percent(summary.get('personalized_accuracy'))}% "
        f"(before adaptation {_percent(summary.get('accuracy_before_adaptation'))}%) on "
        f"{summary.get('test_samples')} test samples"
    )
    if summary.get("privacy"):
        lines.append("  " + _privacy_line(summary["privacy"]))
    return "\n".join(lines)


def silo_records(path: str) -> List[str]:
    """The silo records in an organization's run folder (``silo-rank-R/summary.json``)."""
    if not os.path.isdir(path):
        return []
    return sorted(
        os.path.join(path, name)
        for name in os.listdir(path)
        if name.startswith("silo-rank-") and os.path.isfile(os.path.join(path, name, "summary.json"))
    )


def describe_run(path: str, summary: Dict[str, Any]) -> str:
    """One run: how it ended, its headline figures and the per-user table (with each user's
    epsilon under DP-SGD); a silo's own record as :func:`describe_silo`."""
    if summary.get("role") == "silo":
        return describe_silo(path, summary)
    lines = [
        f"{path}: {_method(summary)}, {status_of(summary)}, {summary.get('rounds')} rounds, "
        f"{summary.get('wall_seconds', 0):.1f} s"
    ]
    if summary.get("error"):
        lines.append(f"  ended by: {summary['error']}")
    lines.append(
        f"  personalized accuracy {_percent(summary.get('personalized_accuracy'))}% "
        f"(before adaptation {_percent(summary.get('accuracy_before_adaptation'))}%) "
        f"at round {summary.get('headline_round')}"
    )
    training = summary.get("train_history") or []
    if training:  # the last round's training figures (its clients' local steps on their minibatches)
        last = training[-1]
        accuracy = last.get("train_accuracy")
        lines.append(
            f"  training loss {_figure(last.get('train_loss'))}"
            + (f", accuracy {_percent(accuracy)}%" if accuracy is not None else "")
            + f" in round {last.get('round')} ({last.get('train_clients')} clients' local steps)"
        )
    own: Dict[str, List[Any]] = summary.get("per_user_metrics") or {}
    if own:
        means = summary.get("own_metrics") or {}
        lines.append("  " + ", ".join(f"{name} {_figure(means.get(name))}" for name in own) + " (mean over users)")
    for lost in summary.get("lost_silos", []):
        lines.append(f"  lost silo rank {lost['rank']} in round {lost['round']}: {lost['why']}")
    after = summary.get("per_user_accuracy") or []
    before = summary.get("per_user_accuracy_before_adaptation") or [None] * len(after)
    new = set(summary.get("new_users") or [])
    dp = (summary.get("privacy") or {}).get("per_user") or {}
    bounds: Dict[str, List[float]] = summary.get("dp_clip_bounds") or {}  # adaptive clipping: each user's bounds
    if dp:
        lines.append("  epsilon" + _stated(summary["privacy"]).replace(",", "", 1))
    if after:
        widths = [max(len(name), 8) for name in own]
        lines.append(
            "  user  after%  before%"
            + "".join(f"  {name:>{w}}" for name, w in zip(own, widths))
            + ("   epsilon  uses" if dp else "")
            + ("  clip bounds D/D'/D''" if bounds else "")
        )
        for user, (a, b) in enumerate(zip(after, before)):
            figures = "".join(f"  {_figure(_at(values, user)):>{w}}" for values, w in zip(own.values(), widths))
            if dp:
                entry = dp.get(str(user)) or {}
                figures += f"  {_figure(entry.get('epsilon')):>8}  {entry.get('uses', '-'):>4}"
            if bounds:
                own_bounds = bounds.get(str(user))
                figures += "  " + ("/".join(f"{b:.3g}" for b in own_bounds) if own_bounds else "- (not trained)")
            lines.append(
                f"  {user:4d}  {_percent(a):>6}  {_percent(b):>7}{figures}{'  (new user)' if user in new else ''}"
                f"{'  (missing from the last evaluation)' if a is None else ''}"
            )
    return "\n".join(lines)


def _figure(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.4g}"


def _at(values: List[Any], user: int) -> Optional[float]:
    return values[user] if user < len(values) else None


def compare_runs(paths: List[str], summaries: List[Dict[str, Any]]) -> str:
    """Several runs side by side."""
    rows = [("run", "method", "status", "rounds", "after%", "before%", "std%")]
    for path, s in zip(paths, summaries):
        rows.append(
            (
                path,
                _method(s),
                status_of(s).split(" (")[0],
                str(s.get("rounds")),
                _percent(s.get("personalized_accuracy")),
                _percent(s.get("accuracy_before_adaptation")),
                _percent(s.get("personalized_accuracy_std")),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="fedml-perfedavg show", description="Print a run's summary and per-user table, or compare runs."
    )
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR")
    parser.add_argument(
        "--plot",
        action="store_true",
        help="also draw each run's accuracy.png into its folder (accuracy and loss against the round; "
        "a running run as far as it got)",
    )
    args = parser.parse_args(argv)
    paths: List[str] = []
    for path in args.runs:  # an organization's folder holds its silo's record, not the run's summary
        records = silo_records(path)
        server_side = os.path.isfile(os.path.join(path, "summary.json"))
        paths += records if records and not server_side else [path]
    try:
        summaries = [read_summary(path) for path in paths]
    except ConfigError as err:
        print(f"fedml-perfedavg show: error: {err}", file=sys.stderr)
        return 2
    if len(summaries) == 1 or all(summary.get("role") == "silo" for summary in summaries):
        print("\n".join(describe_run(path, summary) for path, summary in zip(paths, summaries)))
    else:
        print(compare_runs(paths, summaries))
    if args.plot:
        return _plot(paths, summaries)
    return 0


def _plot(paths: List[str], summaries: List[Dict[str, Any]]) -> int:
    from .plot import write_plot

    failed = False
    for path, summary in zip(paths, summaries):
        if summary.get("role") == "silo" or not summary.get("history"):
            why = "a silo's own record holds no history" if summary.get("role") == "silo" else "no evaluation yet"
            print(f"fedml-perfedavg show: {path}: nothing to plot ({why})", file=sys.stderr)
            failed = True
            continue
        run_dir = path if os.path.isdir(path) else os.path.dirname(path) or "."
        try:
            print(f"plotted {write_plot(summary, run_dir)}")
        except (ConfigError, OutputError) as err:
            print(f"fedml-perfedavg show: error: {err}", file=sys.stderr)
            failed = True
    return 2 if failed else 0
