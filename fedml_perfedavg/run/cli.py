"""Command line: ``fedml-perfedavg --cf CONFIG.yaml [--set KEY=VALUE ...]``.

A convenience over FedML's own path: it validates the config, picks the run directory, then
takes the steps of FedML's example main script (``fedml.init``, ``fedml.device``,
``fedml.data.load``, ``fedml.model.create``, ``FedMLRunner(...).run()``) with the plugin
installed. Cross-silo: ``fedml-perfedavg launch-silo --cf CONFIG.yaml`` starts a server and its
silos on this machine; each process alone is ``fedml-perfedavg --cf ... --rank R --role server|client``,
with certificates from ``fedml-perfedavg certs --out DIR --clients N`` (``comm_args.tls_dir``).
``fedml-perfedavg export-split --cf CONFIG.yaml --out DIR`` writes one folder per user for
data-owner cross-silo runs (``comm_args.silo_data: own``). ``fedml-perfedavg show RUN_DIR
[RUN_DIR ...]`` prints a finished run's summary and per-user table, or compares runs.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import sys
from typing import Any, Dict, List, Optional, Tuple

from ..core.errors import ConfigError, DivergenceError, OutputError, RunStopped
from .config import load
from .schema import Config
from .options import add_config_options
from .. import logs
from ..stopping import exit_code_of, stop_exit_code
from .files import record_of


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fedml-perfedavg", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_config_options(parser, required=False)  # --resume takes the run's own config instead
    parser.add_argument("--run-dir", help="output directory of this run (default: output_dir/run_name)")
    parser.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue the run in RUN_DIR from its last checkpoint (its config.yaml is used; a "
        "finished run continues only with a larger --set comm_round; --set may change only comm_round, "
        "checkpoint_every and the reporting)",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="start the run even where --run-dir holds one, replacing its results"
    )
    parser.add_argument(
        "--describe-data", action="store_true", help="print each user's per-class train/test counts and exit"
    )
    parser.add_argument("--rank", type=int, help="cross-silo: this process's rank (0: server, 1..N: silos)")
    parser.add_argument("--role", choices=["server", "client"], help="cross-silo: this process's role")
    parser.add_argument("--run_id", "--run-id", dest="run_id", default="0", help="cross-silo: FedML run id")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return parser


def describe_data(config) -> str:
    """A table of each user's per-class train/test counts."""
    from .runner import load_split

    data = load_split(config)
    lines = [
        f"{config.data.dataset}, {config.data.partition_method}, n={config.train.client_num_in_total}, "
        f"seed={config.common.random_seed}",
        "user  train  test  classes (class: train/test)",
    ]
    for user_id, counts in enumerate(data.describe()):
        train = sum(c[0] for c in counts.values())
        test = sum(c[1] for c in counts.values())
        detail = " ".join(f"{c}:{tr}/{te}" for c, (tr, te) in counts.items())
        lines.append(f"{user_id:4d}  {train:5d}  {test:4d}  {detail}")
    return "\n".join(lines)


def _already_finished(run_dir: str, comm_round: int) -> bool:
    """``--resume`` on a run that finished all of ``comm_round`` rounds: say so (nothing to train)."""
    import json

    try:
        with open(os.path.join(run_dir, "summary.json")) as stream:
            summary = json.load(stream)
    except (OSError, ValueError):
        return False
    if summary.get("status") != "finished":
        return False
    rounds = summary.get("rounds")
    if isinstance(rounds, int) and rounds >= comm_round:
        print(
            f"fedml-perfedavg: {run_dir} finished all {rounds} rounds already; nothing to train (to train more, "
            f"--resume {run_dir} --set comm_round=N with N > {rounds})"
        )
        return True
    print(
        f"fedml-perfedavg: {run_dir} finished {rounds} rounds; continuing it to comm_round={comm_round}",
        file=sys.stderr,
    )
    return False


def _remove_failed_start(run_dir: Optional[str], existed: bool) -> None:
    """A run that failed before it measured anything leaves no directory behind."""
    if run_dir and not existed and os.path.isdir(run_dir) and not os.path.exists(os.path.join(run_dir, "summary.json")):
        logs.close_files_under(run_dir)  # run.log is closed before its folder goes
        shutil.rmtree(run_dir, ignore_errors=True)


SUBCOMMANDS = {  # fedml-perfedavg NAME ...: the module whose main() takes the rest
    "launch-silo": "launch_silo",
    "certs": "certs",
    "show": "show",
    "export-split": "silo_data",
}


def _config_of(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Config:
    """The run's config: ``--cf`` with ``--set``, or a run directory's own config.yaml for ``--resume``."""
    if args.resume:
        if args.config:
            raise ConfigError("--resume takes the run's own config.yaml; do not pass --cf as well")
        args.config = os.path.join(args.resume, "config.yaml")
        if not os.path.isfile(args.config):
            raise ConfigError(
                f"--resume {args.resume!r}: no config.yaml there; is it a run directory (output_dir/run_name)?"
            )
        args.run_dir = args.resume
    if not args.config:
        parser.print_usage(sys.stderr)
        raise ConfigError(
            "--cf CONFIG.yaml is required (e.g. --cf yaml_configs/quickstart_mnist_hf.yaml), or --resume RUN_DIR"
        )
    config = load(args.config, [*args.overrides, *(["overwrite=true"] if args.overwrite else [])])
    if args.resume:  # refused before anything in the run's folder is touched
        from .checkpoint import resume_changes_problem

        problem = resume_changes_problem(load(args.config).sections(), config.sections())
        if problem is not None:
            raise ConfigError(problem)
    return config


def _run_dir_of(config: Config, args: argparse.Namespace) -> Tuple[str, bool]:
    """(the run directory, whether it existed before this process). Silos share the server's and
    MPI ranks rank 0's, which rank 0 may have written to already: only the owner checks it, and
    only the owner removes a failed start's (so to any other process it "existed")."""
    from .runner import mpi_world_rank, resolve_run_dir, shared_run_dir

    owner = args.role != "client" and (config.comm.backend != "MPI" or mpi_world_rank() == 0)
    resume = bool(args.resume)
    run_id = str(args.run_id)
    planned = args.run_dir
    if owner:
        planned = resolve_run_dir(config, args.run_dir, create=False, resume=resume, run_id=run_id)
    existed = not owner or os.path.isdir(planned)
    if config.comm.backend == "MPI":
        return shared_run_dir(config, planned, resume), existed
    return resolve_run_dir(config, planned, resume=resume, owner=owner, run_id=run_id), existed


def _figure(summary: Dict[str, Any], key: str) -> str:
    """``key=value`` of a run's last figure, or ``key=none`` where no user was evaluated (every
    silo declined the evaluation: the server's log names each one and why)."""
    value = summary.get(key)
    return f"{key}=none" if value is None else f"{key}={value:.4f}"


def main(argv: Optional[List[str]] = None) -> int:
    """The console script and ``python -m fedml_perfedavg``: a run, or a subcommand (exit code)."""
    with logs.as_found_afterwards():
        return _main(sys.argv[1:] if argv is None else list(argv))


def _main(argv: List[str]) -> int:
    if argv[:1] and argv[0] in SUBCOMMANDS:
        module = importlib.import_module(f"{__package__}.{SUBCOMMANDS[argv[0]]}")
        return module.main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    run_dir: Optional[str] = None
    existed = True
    try:
        config = _config_of(args, parser)
        if args.resume and _already_finished(args.resume, config.train.comm_round):
            return 0
        if args.describe_data:
            logs.use_console(args.log_level)
            print(describe_data(config))
            return 0
        from .assembly import check_device, check_extras, check_one_process
        from .runner import fedml_args, run_fedml_main
        from ..stopping import sigterm_as_interrupt

        if args.resume:
            from .assembly import resume_problem

            problem = resume_problem(config, is_server=args.role != "client")
            if problem is not None:  # before the run's files are touched: a refused resume leaves them as they were
                raise ConfigError(problem)
        check_one_process(config)  # before any process resolves or creates the run directory
        check_extras(config)
        check_device(config)
        if config.common.training_type == "cross_silo" or args.role is not None:
            from .silo_roles import check_silo_role

            check_silo_role(config, args.rank, args.role)
        run_dir, existed = _run_dir_of(config, args)
        logs.use_console(args.log_level)
        from tqdm.contrib.logging import logging_redirect_tqdm

        with logging_redirect_tqdm(), sigterm_as_interrupt():
            result = run_fedml_main(
                fedml_args(config, run_dir, bool(args.resume), args.rank, args.role, str(args.run_id))
            )
        if result.summary.get("role") == "client":  # an MPI client rank or a silo: the server reports
            return exit_code_of(result.summary["status"])  # a run the server stopped is no success here either
        figures = (_figure(result.summary, key) for key in ("personalized_accuracy", "accuracy_before_adaptation"))
        print(" ".join(figures) + f" run_dir={result.run_dir}")
        return 0
    except (ConfigError, FileNotFoundError) as err:
        _remove_failed_start(run_dir, existed)
        print(f"fedml-perfedavg: error: {err}", file=sys.stderr)
        return 2
    except OutputError as err:
        print(f"fedml-perfedavg: error: {err}", file=sys.stderr)
        return 1
    except (DivergenceError, RunStopped) as err:
        print(f"fedml-perfedavg: run stopped: {err}{record_of(run_dir, 'what was measured')}", file=sys.stderr)
        return stop_exit_code(err)
    except KeyboardInterrupt:
        print(f"fedml-perfedavg: interrupted{record_of(run_dir, 'what was measured so far')}", file=sys.stderr)
        from ..stopping import stopped_exit_code

        return stopped_exit_code()
