"""What a run reports: log lines, a progress bar, wandb, the metrics history and summary.json."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import torch

from ..algorithms.registry import method_choices
from ..core.evaluation import ACCURACY, ACCURACY_BEFORE, EvaluationResult, accuracy_of
from ..core.ledger import PrivacyRecord
from ..core.sampling import held_out_users
from .files import write_json

logger = logging.getLogger(__name__)
# Per-user lines go to run.log; the console shows the means (see run.cli).
per_user_logger = logging.getLogger(__name__ + ".per_user")


def process_start_ticks(pid: int) -> Optional[int]:
    """When process ``pid`` started, in clock ticks since boot (Linux's /proc), or None: with its
    pid, it names one process even after the pid is reused."""
    try:
        with open(f"/proc/{pid}/stat") as stream:
            return int(stream.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def record_failure(run_dir: str, why: str) -> None:
    """Mark the run's summary.json ``aborted`` with ``why`` (another process, such as a failing
    MPI rank, ends the run), keeping the evaluations it holds."""
    path = os.path.join(run_dir, "summary.json")
    summary: Dict[str, Any] = {"personalized_accuracy": None, "history": []}
    if os.path.exists(path):
        with open(path) as stream:
            summary = json.load(stream)
    summary.update(status="aborted", error=why)
    write_json(path, summary)


class WandbSink:
    """A run's wandb record: live, or (``deferred``: several runs share this process in grid
    mode, and wandb keeps one live run per process) written from the history when it finishes."""

    def __init__(self, settings: Dict[str, Any], run_dir: str, config_sections: Dict[str, Dict[str, Any]]) -> None:
        self.settings, self.run_dir, self.config_sections = settings, run_dir, config_sections
        self.deferred: Optional[List[tuple]] = [] if settings.get("deferred") else None
        self.run: Any = None if self.deferred is not None else self._start()  # a wandb Run

    def _start(self):
        import wandb

        os.environ.setdefault("WANDB_MODE", "offline")  # never needs an account unless asked
        return wandb.init(
            project=self.settings["project"],
            group=self.settings.get("group"),
            name=self.settings.get("name"),
            tags=self.settings.get("tags"),
            dir=self.run_dir,
            config=self.config_sections,
            reinit=True,
        )

    def log_training(self, round_idx: int, training: Dict[str, Any]) -> None:
        """A round's training figures: the plugin's ``train/*`` and FedML's own keys (``Train/Loss``,
        ``Train/Acc``, ``round``: what FedML's trainers log, so its dashboards find them)."""
        if self.deferred is not None:
            self.deferred.append((self.log_training, (round_idx, training)))
            return
        scalars = {"train/loss": training["train_loss"], "Train/Loss": training["train_loss"], "round": round_idx}
        if training.get("train_accuracy") is not None:
            scalars.update({"train/accuracy": training["train_accuracy"], "Train/Acc": training["train_accuracy"]})
        self.run.log(scalars, step=round_idx)

    def log_evaluation(self, round_idx: int, metrics: Dict[str, Any], per_user: List[float]) -> None:
        if self.deferred is not None:
            self.deferred.append((self.log_evaluation, (round_idx, metrics, list(per_user))))
            return
        import wandb

        scalars = {
            f"eval/{k}": v
            for k, v in metrics.items()
            if k != "round" and isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        if "missing_users" in metrics:  # a federated evaluation: how many users sent nothing
            scalars["eval/missing_users"] = len(metrics["missing_users"])
        # FedML's own keys for the test figures: the personalized evaluation's (the protocol's headline)
        fedml_keys = {"Test/Acc": metrics.get("personalized_accuracy"), "Test/Loss": metrics.get("personalized_loss")}
        scalars.update({k: v for k, v in fedml_keys.items() if isinstance(v, (int, float))})
        scalars["round"] = round_idx
        logged: Dict[str, Any] = dict(scalars)
        if per_user:  # a secure evaluation has none: the server holds means only
            logged["eval/per_user_accuracy"] = wandb.Histogram(per_user)
        self.run.log(logged, step=round_idx)

    def log_silo_evaluation(self, round_idx: int, mean: float) -> None:
        if self.run is not None:
            self.run.log({"silo/personalized_accuracy": mean}, step=round_idx)

    def finish(self, summary: Dict[str, Any], last: Optional[EvaluationResult]) -> None:
        """The final per-user table and the summary's numbers; the wandb run ends."""
        import wandb

        if self.deferred is not None:
            self.run, deferred, self.deferred = self._start(), self.deferred, None
            for log, arguments in deferred:
                log(*arguments)
        if last is not None:
            names = [ACCURACY, ACCURACY_BEFORE, *last.own_names]
            dp = (summary.get("privacy") or {}).get("per_user") or {}  # each user's epsilon and uses, under DP-SGD
            columns = ["user", *names]
            rows: List[List[Any]] = [[user, *(last.per_user[n][i] for n in names)] for i, user in enumerate(last.ids)]
            if dp:
                columns += ["epsilon", "dp_uses"]
                for row in rows:
                    entry = dp.get(str(row[0])) or {}
                    row += [entry.get("epsilon"), entry.get("uses")]
            table = wandb.Table(columns=columns, data=rows)
            self.run.log({"final/per_user_accuracy": table})
        self.run.summary.update({k: v for k, v in summary.items() if isinstance(v, (int, float))})
        self.run.summary.update({f"own/{k}": v for k, v in (summary.get("own_metrics") or {}).items()})
        self.run.finish()


def split_new_users(result: EvaluationResult, new_users: Sequence[int]) -> Dict[str, Any]:
    """Headline metrics over the users trained on; new (held-out) users reported apart."""
    if not new_users:
        return result.metrics()
    new = set(new_users)
    held = [i for i, user in enumerate(result.ids) if user in new]
    trained = result.subset([i for i, user in enumerate(result.ids) if user not in new]).metrics()
    held_metrics: Dict[str, Optional[float]] = {
        "new_user_personalized_accuracy": None,
        "new_user_accuracy_before_adaptation": None,
    }
    if held:
        held_result = result.subset(held)
        held_metrics = {
            "new_user_personalized_accuracy": held_result.personalized_accuracy,
            "new_user_accuracy_before_adaptation": held_result.accuracy_before_adaptation,
        }
    return {**trained, **held_metrics}


def per_user_table(result: EvaluationResult, num_users: Optional[int]) -> Dict[str, List[Optional[float]]]:
    """Each per-user metric by user id (metric name -> a value for each user); a user the
    evaluation missed is None."""
    if result.user_ids is None:
        return {name: list(values) for name, values in result.per_user.items()}
    size = num_users if num_users is not None else max(result.user_ids) + 1
    table: Dict[str, List[Optional[float]]] = {}
    for name, values in result.per_user.items():
        column: List[Optional[float]] = [None] * size
        for user, value in zip(result.user_ids, values):
            column[user] = value
        table[name] = column
    return table


def per_user_epsilons(privacy: Optional[PrivacyRecord]) -> Dict[int, float]:
    """Each user's DP-SGD epsilon so far (none without DP-SGD)."""
    if privacy is None:
        return {}
    return {int(user): float(entry["epsilon"]) for user, entry in privacy.report()["per_user"].items()}


def log_per_user(
    round_idx: int, result: EvaluationResult, metrics: Dict[str, Any], epsilons: Optional[Dict[int, float]] = None
) -> None:
    """The per-user figures of an evaluation (``fedml_perfedavg.per_user``), each user's DP-SGD
    epsilon where the run has DP-SGD, and the means of an algorithm's own figures."""
    per_user_logger.info(
        "round %d: per-user accuracy after/before adaptation: %s",
        round_idx,
        " ".join(
            f"{i}:{a:.4f}/{b:.4f}"
            for i, a, b in zip(result.ids, result.per_user_accuracy, result.per_user_accuracy_before)
        ),
    )
    if epsilons:
        per_user_logger.info(
            "round %d: per-user epsilon: %s", round_idx, " ".join(f"{u}:{e:.4g}" for u, e in sorted(epsilons.items()))
        )
    for name in result.own_names:
        logger.info("round %d: %s %.4g (mean over users)", round_idx, name, metrics[name])
        per_user_logger.info(
            "round %d: per-user %s: %s",
            round_idx,
            name,
            " ".join(f"{i}:{v:.4g}" for i, v in zip(result.ids, result.per_user[name])),
        )


def this_process() -> Dict[str, Any]:
    """Who writes a record: `show` tells a live run from one whose process died without a word; the
    torch threads, on which some CPU kernels' float order depends (docs/backends.md)."""
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "torch_threads": torch.get_num_threads(),
        "started": time.time(),
        "start_ticks": process_start_ticks(os.getpid()),
    }


def privacy_metrics(privacy: Optional[PrivacyRecord], round_idx: int) -> Dict[str, float]:
    """DP-SGD's figure for an evaluation's record (the account already counts its personalization),
    logged; none without DP-SGD."""
    if privacy is None:
        return {}
    epsilon, user = privacy.largest()
    dp = privacy.dp
    logger.info(
        "round %d: epsilon %.4g at delta %g (the largest of any user: user %s; DP-SGD, sigma %g, %s)",
        round_idx,
        epsilon,
        dp.delta,
        user,
        dp.noise_multiplier,
        dp.clip_label,
    )
    return {"epsilon": epsilon}


#: An evaluation record's ``evaluation`` under secure aggregation: means from a secure sum, no per-user figure.
SUMMED = "secure sum"


def federated_result(counts: Dict[int, Dict[str, Any]]) -> EvaluationResult:
    """Data-owner cross-silo: the evaluation made of each user's counts from its own silo (the
    protocol's accuracies from whole counts, an algorithm's own figures as its silo sent them)."""
    users = sorted(counts)
    result = EvaluationResult.of(
        [accuracy_of(counts[u]["correct"], counts[u]["total"]) for u in users],
        [accuracy_of(counts[u]["correct_before"], counts[u]["total"]) for u in users],
        [float(counts[u]["loss"]) for u in users],
        user_ids=users,
    )
    own_names = list(counts[users[0]].get("own", {})) if users else []
    return result.with_own({name: [float(counts[u]["own"][name]) for u in users] for name in own_names})


@dataclass
class SiloRecord:
    """Cross-silo: what the server saw of its silos, for summary.json (each key only when there
    is something to say)."""

    silo_evaluation: List[Dict[str, Any]] = field(default_factory=list)  # the silos' own (shared mode)
    lost_silos: List[Dict[str, Any]] = field(default_factory=list)  # the server went on without them
    rejoined_silos: List[Dict[str, Any]] = field(default_factory=list)  # they came back
    refusals: Dict[str, int] = field(default_factory=dict)  # what the server's transport refused, by reason
    # secagg_args.enable_secagg: rounds summed securely, those that could not be, and each round's record
    secure_aggregation: Dict[str, Any] = field(default_factory=dict)

    def secure_round(self, record: Dict[str, Any]) -> None:
        """A securely aggregated round, or evaluation (``record["evaluation"]``), or one that could
        not be (``record["failed"]`` says why)."""
        summary = self.secure_aggregation or {"rounds": 0, "failed_rounds": 0, "per_round": []}
        if record.get("evaluation"):
            for key, empty in (("evaluations", 0), ("failed_evaluations", 0), ("per_evaluation", [])):
                summary.setdefault(key, empty)
            summary["failed_evaluations" if record["failed"] else "evaluations"] += 1
            summary["per_evaluation"].append(record)
        else:
            summary["failed_rounds" if record["failed"] else "rounds"] += 1
            summary["per_round"].append(record)
        self.secure_aggregation = summary

    def evaluated(self, label: str, mean: float, silos: Dict[int, Dict[str, Any]]) -> None:
        """The silos' own evaluations of the model they received (``label``: the round, or final)."""
        self.silo_evaluation.append(
            {"when": label, "mean_accuracy": mean, "silos": {str(rank): metrics for rank, metrics in silos.items()}}
        )

    def lost(self, round_idx: int, ranks: Sequence[int], why: str) -> None:
        """The server gave up on these silos in this round."""
        self.lost_silos.extend({"rank": int(rank), "round": round_idx, "why": why} for rank in ranks)

    def rejoined(self, round_idx: int, rank: int, why: str) -> None:
        """A silo the server had given up on came back in this round."""
        self.rejoined_silos.append({"rank": int(rank), "round": round_idx, "why": why})

    def summary(self) -> Dict[str, Any]:
        return {name: value for name, value in vars(self).items() if value}


class RunRecorder:
    """Collects per-round metrics and reports them (logging, tqdm, optional wandb)."""

    def __init__(
        self,
        run_dir: str,
        total_rounds: int,
        config_sections: Dict[str, Dict[str, Any]],
        show_progress: bool = True,
        wandb_settings: Optional[Dict[str, Any]] = None,
        new_users: Sequence[int] = (),
        num_users: Optional[int] = None,
    ) -> None:
        self.run_dir = run_dir
        self.num_users = num_users
        self.process = this_process()
        self.new_users = sorted(new_users)
        self.total_rounds = total_rounds
        self.config_sections = config_sections
        self.history: List[Dict[str, Any]] = []
        #: Each round's training figures (training_record.py): its clients' mean loss and accuracy.
        self.train_history: List[Dict[str, Any]] = []
        self.last: Optional[EvaluationResult] = None
        self.rounds_done = 0
        self.silos = SiloRecord()
        self.privacy: Optional[PrivacyRecord] = None  # DP-SGD's account (assembly's)
        self.started = time.perf_counter()
        self.evaluation_seconds = 0.0  # spent evaluating: not training time
        self._bar = None
        if show_progress:
            from tqdm.auto import tqdm

            # disable=None: no bar when stderr is not a terminal (piped output stays line by line).
            self._bar = tqdm(total=total_rounds, desc="rounds", unit="round", dynamic_ncols=True, disable=None)
        self._wandb = WandbSink(wandb_settings, run_dir, config_sections) if wandb_settings else None

    def round_finished(self, round_idx: int, training: Optional[Dict[str, Any]] = None) -> None:
        """Round ``round_idx`` is done; ``training``: its clients' training figures, if recorded."""
        self.rounds_done = round_idx + 1
        if training is not None:
            self.train_history.append(training)
            if self._wandb is not None:
                self._wandb.log_training(round_idx, training)
        if self._bar is not None:
            if training is not None:
                self._bar.set_postfix(self._postfix(), refresh=False)
            self._bar.update(self.rounds_done - self._bar.n)

    def _postfix(self) -> Dict[str, str]:
        """The progress bar's figures: the last round's training loss, the last evaluation's accuracy."""
        figures = {}
        if self.train_history:
            figures["loss"] = f"{self.train_history[-1]['train_loss']:.4f}"
        if self.history and self.history[-1].get("personalized_accuracy") is not None:
            figures["pers_acc"] = f"{self.history[-1]['personalized_accuracy']:.4f}"
        return figures

    def headline(self, result: EvaluationResult) -> Dict[str, float]:
        """The metrics of ``result`` as the run reports them (training users; new users apart)."""
        return split_new_users(result, self.new_users)

    def record_federated_evaluation(
        self,
        round_idx: int,
        counts: Dict[int, Dict[str, Any]],
        missing: Sequence[int],
        evaluation_started: Optional[float] = None,
    ) -> None:
        """Data-owner cross-silo: the silos' own evaluations of the model after ``round_idx``
        (user -> its counts), the users that sent none listed as missing, never counted as zero."""
        users = sorted(counts)
        extra = {"evaluated_users": len(users), "missing_users": sorted(missing)}
        if missing:
            logger.warning(
                "round %d: %d user(s) sent no evaluation and are left out of the mean: %s",
                round_idx,
                len(missing),
                sorted(missing),
            )
        if not users:
            entry = {"round": round_idx, "personalized_accuracy": None, **extra}
            self.history.append({**entry, "wall_seconds": time.perf_counter() - self.started})
            write_json(os.path.join(self.run_dir, "summary.json"), self.summary(status="running"))
            return
        self.record_evaluation(round_idx, federated_result(counts), extra, evaluation_started)

    def _evaluation_times(self, evaluation_started: Optional[float]) -> Dict[str, float]:
        """An evaluation's ``train_seconds`` (wall time less every evaluation's, this one from
        ``evaluation_started`` on) and ``wall_seconds``; this one's time counted as evaluating."""
        now = time.perf_counter()
        started = now if evaluation_started is None else evaluation_started
        times = {"train_seconds": started - self.started - self.evaluation_seconds, "wall_seconds": now - self.started}
        self.evaluation_seconds += now - started
        return times

    def record_summed_evaluation(
        self,
        round_idx: int,
        metrics: Optional[Dict[str, Any]],
        summed: Sequence[int],
        missing: Sequence[int],
        evaluation_started: Optional[float] = None,
    ) -> None:
        """Data-owner cross-silo with secure aggregation: the means over the ``summed`` users that
        the evaluation's secure sum gave (None: it failed), the users left out listed as missing.
        No per-user figure reaches the server: each silo's record keeps its own."""
        extra = {"evaluated_users": len(summed), "missing_users": sorted(missing), "evaluation": SUMMED}
        if missing:
            logger.warning(
                "round %d: %d user(s) are not in the evaluation's secure sum: %s",
                round_idx,
                len(missing),
                sorted(missing),
            )
        entry = {
            "round": round_idx,
            **(metrics or {"personalized_accuracy": None}),
            **extra,
            **privacy_metrics(self.privacy, round_idx),
            **self._evaluation_times(evaluation_started),
        }
        self.history.append(entry)
        if metrics is not None:
            logger.info(
                "round %d: personalized accuracy %.4f (before adaptation %.4f, std %.4f; the secure sum of %d users)",
                round_idx,
                entry["personalized_accuracy"],
                entry["accuracy_before_adaptation"],
                entry["personalized_accuracy_std"],
                len(summed),
            )
        if self._bar is not None:
            self._bar.set_postfix(self._postfix())
        write_json(os.path.join(self.run_dir, "summary.json"), self.summary(status="running"))
        if self._wandb is not None and metrics is not None:
            self._wandb.log_evaluation(round_idx, entry, [])

    def record_evaluation(
        self,
        round_idx: int,
        result: EvaluationResult,
        extra: Optional[Dict[str, Any]] = None,
        evaluation_started: Optional[float] = None,
    ) -> None:
        """One evaluation: its metrics, ``extra`` scalars (stationarity, ...), the wall time and
        the training time so far (wall time less every evaluation's, this one from
        ``evaluation_started`` on: what the accuracy-against-time plots use)."""
        metrics = {
            "round": round_idx,
            **split_new_users(result, self.new_users),
            **(extra or {}),
            **privacy_metrics(self.privacy, round_idx),
            **self._evaluation_times(evaluation_started),
        }
        self.history.append(metrics)
        self.last = result
        logger.info(
            "round %d: personalized accuracy %.4f (before adaptation %.4f, std %.4f)",
            round_idx,
            metrics["personalized_accuracy"],
            metrics["accuracy_before_adaptation"],
            metrics["personalized_accuracy_std"],
        )
        if "stationarity" in metrics:
            logger.info("round %d: ||grad F(w)||^2 = %.4g", round_idx, metrics["stationarity"])
        log_per_user(round_idx, result, metrics, per_user_epsilons(self.privacy))
        if self._bar is not None:
            self._bar.set_postfix(self._postfix())
        # Kept current, so a process killed without warning (SIGKILL, MPI_Abort) loses nothing measured.
        write_json(os.path.join(self.run_dir, "summary.json"), self.summary(status="running"))
        if self._wandb is not None:
            self._wandb.log_evaluation(round_idx, metrics, result.per_user_accuracy)

    def record_silo_evaluation(self, label: str, mean: float, silos: Dict[int, Dict[str, Any]]) -> None:
        """Cross-silo: the silos' own personalized evaluations of the model they received."""
        self.silos.evaluated(label, mean, silos)
        if self._wandb is not None and label != "final":
            self._wandb.log_silo_evaluation(int(label.split()[-1]), mean)

    def state_dict(self) -> Dict[str, Any]:
        """What a checkpoint needs to continue the record exactly."""
        last = None if self.last is None else self.last.record()
        return {
            "history": self.history,
            "train_history": self.train_history,
            "last": last,
            "rounds_done": self.rounds_done,
            "elapsed": time.perf_counter() - self.started,
            "evaluation_seconds": self.evaluation_seconds,
            "privacy": None if self.privacy is None else self.privacy.state_dict(),
            # cross-silo: what the server saw of its silos (lost, back, secure rounds): a resumed run's summary
            # keeps the rounds before its resume (the transport's refusals are each process's own)
            "silos": {k: v for k, v in dataclasses.asdict(self.silos).items() if k != "refusals"},
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.history = list(state["history"])
        self.train_history = list(state.get("train_history", []))  # absent from checkpoints before it
        self.last = None if state["last"] is None else EvaluationResult.from_record(state["last"])
        self.rounds_done = state["rounds_done"]
        self.started = time.perf_counter() - state["elapsed"]
        self.evaluation_seconds = float(state.get("evaluation_seconds", 0.0))
        if self.privacy is not None and state.get("privacy") is not None:
            self.privacy.load_state_dict(state["privacy"])
        self.silos = SiloRecord(**state.get("silos", {}))  # absent from checkpoints before it
        if self._bar is not None:
            self._bar.update(self.rounds_done - self._bar.n)

    def summary(
        self,
        status: str = "finished",
        error: Optional[str] = None,
        aggregation: Optional[Dict[str, Any]] = None,
    ) -> Dict[str, Any]:
        """The run's final numbers (last evaluation), how it ended, and its resolved config
        (``aggregation``: the algorithm's record of it, :meth:`FederatedAlgorithm.record`)."""
        headline_round = self.history[-1]["round"] if self.history else None
        common = {
            "status": status,
            "error": error,
            "rounds": self.rounds_done,
            "headline_round": headline_round,
            "aggregate_calls": None,
            "rejected_updates": {},
            "process": self.process,
            "wall_seconds": time.perf_counter() - self.started,
            **(aggregation or {}),
            "history": self.history,
            "train_history": self.train_history,
            "config": self.config_sections,
            **self.silos.summary(),
            **({"privacy": self.privacy.report(final=status != "running")} if self.privacy is not None else {}),
        }
        summed = [
            e for e in self.history if e.get("evaluation") == SUMMED and e.get("personalized_accuracy") is not None
        ]
        if self.last is None and summed:  # a secure run: its last evaluation's means, no per-user figure
            keys = ("personalized_accuracy", "personalized_accuracy_std", "accuracy_before_adaptation")
            return {
                **{k: summed[-1][k] for k in keys},
                "evaluated_users": summed[-1]["evaluated_users"],
                "per_user_accuracy": [],
                **common,
                "headline_round": summed[-1]["round"],
            }
        if self.last is None:
            return {
                "personalized_accuracy": None,
                "accuracy_before_adaptation": None,
                "per_user_accuracy": [],
                **common,
            }
        headline = split_new_users(self.last, self.new_users)
        table = per_user_table(self.last, self.num_users)
        own = self.last.own_names  # the algorithm's own figures: their means and tables apart, by name
        return {
            **{k: v for k, v in headline.items() if k != "personalized_loss" and k not in own},
            "new_users": self.new_users,
            "per_user_accuracy": table[ACCURACY],
            "per_user_accuracy_before_adaptation": table[ACCURACY_BEFORE],
            **(
                {"own_metrics": {n: headline[n] for n in own}, "per_user_metrics": {n: table[n] for n in own}}
                if own
                else {}
            ),
            **common,
        }

    def finish(
        self,
        status: str = "finished",
        error: Optional[str] = None,
        aggregation: Optional[Dict[str, Any]] = None,
    ) -> Dict[str, Any]:
        """Write ``summary.json`` (atomically) into the run directory; close the bar and wandb."""
        if self._bar is not None:
            self._bar.close()
        summary = self.summary(status, error, aggregation)
        write_json(os.path.join(self.run_dir, "summary.json"), summary)
        if self.history:
            from .plot import plot_at_end

            plot_at_end(summary, self.run_dir)
        if self._wandb is not None:
            self._wandb.finish(summary, self.last)
        return summary


def wandb_tags(config: Any) -> List[str]:
    """A run's wandb tags: its method (with the variant), seed and dataset, so that a grouped
    grid (group = cell) can be filtered and compared per method and seed in wandb's UI."""
    name = config.train.federated_optimizer
    method = "-".join([name, *method_choices(name, config.algorithm_settings(name))])
    return [method, f"seed{config.common.random_seed}", config.data.dataset]


def recorder_for(config: Any, run_dir: str, deferred_wandb: bool = False) -> RunRecorder:
    """The recorder of a run (its wandb run, if ``tracking_args.enable_wandb``: group defaulting to
    the run's name; ``deferred_wandb``: written at the end, for one of several runs in a process)."""
    name = os.path.basename(run_dir)
    wandb_settings = None
    if config.tracking.enable_wandb:
        wandb_settings = {
            "project": config.tracking.wandb_project,
            "group": config.tracking.wandb_group or name,
            "name": config.tracking.wandb_name or name,
            "tags": wandb_tags(config),
            "deferred": deferred_wandb,
        }
    new_users = held_out_users(
        config.common.random_seed, config.train.client_num_in_total, config.train.new_user_fraction
    )
    return RunRecorder(
        run_dir,
        config.train.comm_round,
        config.sections(),
        config.tracking.show_progress,
        wandb_settings,
        new_users,
        config.train.client_num_in_total,
    )
