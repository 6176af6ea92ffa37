"""``cobench run``: one benchmark (or a Hydra ``-m`` sweep of them) from the command line.

Hydra composes ``conf/config.yaml`` with the user's overrides against the structured schema in
``harness.config``; unknown keys and wrong types fail there, bad values in ``to_run_config``,
and the workload's own checks before any MLflow run exists. Exit codes: 0 all runs finished,
1 a run failed, 2 bad input (nothing ran), 130 interrupted.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import DictConfig

if TYPE_CHECKING:
    from harness.config import CobenchConfig

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130


class CommandFailed(Exception):
    """A command ran and did not succeed (exit 1); the message says what failed and where to look."""


def add_store_flags(parser: argparse.ArgumentParser) -> None:
    """The flags a command that reads the results store takes (``cobench compare``, ``cobench report``);
    the dispatcher turns the shared ``results_dir=``, ``tracking.uri=``, ``tracking.experiment=`` into them."""
    parser.add_argument("--tracking-uri", help="an MLflow server (default: the sqlite store in --results-dir)")
    parser.add_argument("--results-dir", type=Path, default=Path("results"))
    parser.add_argument("--experiment", default="cobench")


def fail(message: str, code: int = EXIT_BAD_INPUT) -> None:
    """Leave a Hydra task with a message: Hydra reports other exceptions as its own crash."""
    print(f"cobench run: error: {message}", file=sys.stderr)
    raise SystemExit(code)


def validate_overrides(overrides: list[str]) -> CobenchConfig:
    """Compose and validate every value of every sweep before the first run starts.

    Hydra composes each job only when it starts, so without this a bad value in the last job of
    a sweep would fail after the others ran. Raises ValueError naming the key; returns the first job's.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from harness.config import compose_config, to_run_config

    user = [o for o in overrides if not o.startswith(("hydra.", "+hydra.", "~hydra."))]
    try:
        parsed = OverridesParser.create().parse_overrides(user)
    except Exception as err:  # Hydra's grammar errors have several types; re-raised as one
        raise ValueError(f"cannot parse overrides {user}: {err}") from err
    choices = [
        [f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()] if o.is_sweep_override() else [o.input_line]
        for o in parsed
    ]
    first = [values[0] for values in choices]
    for i, values in enumerate(choices):
        for value in values[1:] if i else values:
            to_run_config(compose_config([*first[:i], value, *first[i + 1 :]]))
    return to_run_config(compose_config(first))


def run_main(argv: list[str]) -> int:
    """Entry of ``cobench run [hydra overrides] [-m]``; errors take the dispatcher's one path
    (:func:`suite.cli.guarded`): ValueError and TrackingError are bad input, Ctrl-C an interruption."""
    from harness.config import results_root, run_hydra_app, to_run_config
    from harness.distributed import adopt_slurm_tasks, env_dist_info
    from harness.distribution.scheduler import check_launcher, launch_sweep, launcher_of, prepare_argv, save_result
    from harness.recording.tracking import TrackingError
    from harness.running.runner import STATUS_FINISHED, BenchmarkResult, run_benchmark
    from harness.running.summary import print_summary, sweep_labels

    results: list[BenchmarkResult] = []
    job_overrides: list[list[str]] = []  # each job's own overrides: a sweep's rows are named by what differs

    def task(cfg: DictConfig) -> None:
        from hydra.core.hydra_config import HydraConfig

        try:
            adopt_slurm_tasks()  # a job of several srun tasks: one process group, as under torchrun
            run_cfg = to_run_config(cfg)
            job_overrides.append(list(HydraConfig.get().overrides.task))
            if run_cfg.ft.name != "none":  # the failure scenario launches its own processes (harness/distribution/ft/)
                from harness.distribution.ft.supervisor import run_ft

                results.append(run_ft(run_cfg))
            else:
                results.append(run_benchmark(run_cfg))
            if remote and env_dist_info().is_main:  # on a node: hand the result back to the submitter
                save_result(HydraConfig.get().runtime.output_dir, results[-1])
        except (ValueError, TrackingError) as err:
            # refused before any run existed: leave no empty Hydra job folder behind
            shutil.rmtree(HydraConfig.get().runtime.output_dir, ignore_errors=True)
            fail(str(err))

    hydra_flags = [a for a in argv if a.startswith("-") and a not in ("-m", "--multirun")]
    remote = launcher_of(argv)  # a launcher that runs the jobs elsewhere (SLURM): results come back as files
    if not hydra_flags:  # --help, --cfg, --info ... only show things: let Hydra answer
        first = validate_overrides([a for a in argv if not a.startswith("-")])
        if remote:
            check_launcher(remote, argv)
            argv, sweep_dir = prepare_argv(argv, results_root(first))
    if remote and not hydra_flags:  # the jobs run elsewhere: what they left comes back once all have ended
        results[:], job_overrides[:] = launch_sweep(task, "cobench run", remote, argv, sweep_dir)
    else:
        run_hydra_app(task, "cobench run", argv)
    if not results:  # --help, --cfg job, ... : Hydra answered and ran nothing
        return EXIT_OK
    if env_dist_info().is_main:
        print_summary(results, labels=sweep_labels(results, job_overrides))
    # a run the store did not get is not done yet (`cobench upload` finishes it): exit 1 says so
    return EXIT_OK if all(r.status == STATUS_FINISHED and not r.upload_error for r in results) else EXIT_FAILED
