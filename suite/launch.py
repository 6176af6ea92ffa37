"""``cobench suite NAME``: the suite here, or with ``hydra/launcher=submitit_slurm`` each benchmark as its own job.

The suite is planned here first (every config composed and every workload built once: a typo in the
last benchmark costs nothing) and the launch checked (:func:`harness.distribution.scheduler.check_launcher`); the
suite's MLflow parent run opens here. Then one Hydra multirun sweeps ``suite.only=[<benchmark>]`` over
the benchmarks through the chosen launcher: Hydra's submitit plugin submits one SLURM job per
benchmark, ``hydra.launcher.tasks_per_node=N`` makes each job N processes (srun tasks joined into one
process group). Each job plans its one benchmark where it runs, tracks its child run into the suite's
store (``tracking=server`` for a cluster; an sqlite file works on one node) and hands its result back
as JSON; the parent is closed here with every benchmark's figures and deltas, FAILED naming the
benchmarks whose jobs failed or left nothing.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable

from omegaconf import DictConfig

from harness.cli import EXIT_FAILED, EXIT_OK
from harness.config import results_root
from harness.distributed import adopt_slurm_tasks, env_dist_info
from harness.distribution.scheduler import (
    check_launcher,
    is_launcher_override,
    launch_sweep,
    launcher_of,
    prepare_argv,
    save_result,
)
from harness.recording.tracking import Tracker
from harness.running.runner import STATUS_FAILED, STATUS_FINISHED, STATUS_SKIPPED, BenchmarkResult, connect_tracker
from harness.running.summary import print_summary
from suite.runner import Derived, Plan, SuiteOutcome, plan_suite, run_one, run_suite, suite_level


def launch_suite(name: str, args: list[str], launcher: str) -> SuiteOutcome:
    """Plan the suite here, then run it as one job per benchmark through ``launcher``."""
    overrides = [a for a in args if not is_launcher_override(a)]
    launch = [a for a in args if is_launcher_override(a)]
    base, plans = plan_suite(name, overrides)
    check_launcher(launcher, launch)
    results_dir = results_root(base)

    def execute(suite: str, plans: list[Plan], parent_id: str | None, tracker: Tracker | None,
                deltas_of: Callable[[str], Derived], results: list[BenchmarkResult]) -> None:
        for plan in plans:
            if plan.skip is not None:  # this platform cannot run it: SKIPPED here, nothing submitted
                results.append(run_one(plan, suite, parent_id, tracker, deltas_of(plan.name)))
        jobs = [plan.name for plan in plans if plan.skip is None]
        if not jobs:
            return
        argv, sweep_dir = prepare_argv(
            [f"suite={suite}", *(o for o in suite_level(overrides) if not o.lstrip("+~").startswith("suite.only")),
             "suite.only=" + ",".join(f"[{j}]" for j in jobs), *launch],
            results_dir)

        def job(cfg: DictConfig) -> None:  # runs on the node the scheduler chose (pickled there by submitit)
            from hydra.core.hydra_config import HydraConfig

            job_dir = HydraConfig.get().runtime.output_dir
            try:
                adopt_slurm_tasks()
                (benchmark,) = cfg.suite.only
                job_base, (plan,) = plan_suite(suite, [*overrides, f"suite.only=[{benchmark}]"])
                none: Derived = lambda metrics: {}  # noqa: E731 - deltas need the baseline's run: added afterwards
                result = run_one(plan, suite, parent_id, connect_tracker(job_base), none)
            except BaseException:  # Hydra keeps a job's exception without its traceback: the job's log has it
                traceback.print_exc()
                raise
            if env_dist_info().is_main:
                save_result(job_dir, result)

        got, job_overrides = launch_sweep(job, "cobench suite", launcher, argv, sweep_dir)
        for result, ran in zip(got, job_overrides, strict=True):
            if result.benchmark.startswith("job "):  # the job left nothing: name it by its benchmark
                chosen = [o.split("=", 1)[1].strip("[]") for o in ran if o.startswith("suite.only=")]
                number = int(result.benchmark.split()[1])  # the sweep's jobs are the benchmarks, in order
                result.benchmark = chosen[0] if chosen else jobs[number] if number < len(jobs) else result.benchmark
            results.append(result)
        for missing in sorted(set(jobs) - {r.benchmark for r in got}):
            results.append(BenchmarkResult(missing, "?", "?", STATUS_FAILED, "-", None,
                                           error=f"its job never ran; see {sweep_dir}"))
        for result in got:  # each job ran alone: its deltas against the baseline's job are logged now
            extra = deltas_of(result.benchmark)(result.metrics)
            if extra and tracker is not None and result.run_id:
                tracker.log_metrics(result.run_id, extra)
                result.metrics.update(extra)

    return run_suite(base, plans, execute)


def suite_main(args: list[str]) -> int:
    """``cobench suite NAME [OVERRIDES]``: exit 0 when every benchmark finished or was skipped, else 1."""
    if not args or args[0].startswith("-") or "=" in args[0]:
        raise ValueError("`cobench suite` needs a suite name, e.g. `cobench suite smoke`")
    launcher = launcher_of(args[1:])
    if launcher is not None:  # one job per benchmark through a Hydra launcher (SLURM)
        outcome = launch_suite(args[0], args[1:], launcher)
    else:
        outcome = run_suite(*plan_suite(args[0], args[1:]))
    if env_dist_info().is_main:
        print_summary(outcome.results, title=f"suite {args[0]}: {outcome.wall_s:.1f} s wall",
                      extra_metrics=outcome.suite.summary_metrics)
    ok = all(r.status in (STATUS_FINISHED, STATUS_SKIPPED) and not r.upload_error for r in outcome.results)
    return EXIT_OK if ok else EXIT_FAILED
