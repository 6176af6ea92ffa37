"""Jobs on a cluster's scheduler: Hydra launcher plugins (``hydra/launcher=submitit_slurm``).

``cobench run -m ... hydra/launcher=submitit_slurm`` and ``cobench suite NAME hydra/launcher=submitit_slurm``
hand each job to Hydra's launcher, which submits it (sbatch) and runs it where the scheduler puts it;
``hydra.launcher.tasks_per_node=N`` makes a job N processes (srun tasks), which join one process group
as they would under torchrun (:func:`harness.distributed.adopt_slurm_tasks`). Here:

- :func:`check_launcher`: bad input costs nothing — a missing plugin, no SLURM commands, a controller
  that does not answer, a partition that does not exist are refused before any job or MLflow run exists;
- :func:`prepare_argv`: the sweep folder is fixed up front, so the submitting process finds what the jobs
  left there: each job's rank 0 writes its :class:`~harness.running.runner.BenchmarkResult` as ``result.json``
  in its Hydra job folder (:func:`save_result`), read back by :func:`collect_results`;
- :func:`launch_sweep`: the sweep through the launcher, returning once every job has left the scheduler's queue,
  with what each left — a job that died or was cancelled without its result (so that no result file will
  ever come) is a FAILED row, where submitit alone would wait for that file forever on a cluster that
  keeps no accounting (its watcher asked only ``sacct``; the one installed here asks ``squeue`` then).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import yaml

from harness.files import write_atomic
from harness.running.runner import STATUS_FAILED, BenchmarkResult

LOCAL_LAUNCHERS = ("basic",)  # Hydra's in-process launcher: the jobs run here, one after the other
RESULT_FILE = "result.json"
SINFO_TIMEOUT_S = 30.0
QUEUE_POLL_S = 5.0  # how often the submitting process asks whether its jobs are still queued
WATCH_DELAY_S = 60.0  # the longest submitit waits between two state queries while its jobs run
LEFT_QUEUE = "LEFT_QUEUE"  # the state of a job squeue no longer lists: ended, how is in its files


def launcher_of(argv: list[str]) -> str | None:
    """The Hydra launcher ``argv`` chooses that runs jobs elsewhere (``hydra/launcher=NAME``), or None."""
    chosen = [a.split("=", 1)[1] for a in argv if a.startswith(("hydra/launcher=", "+hydra/launcher="))]
    return chosen[-1] if chosen and chosen[-1] not in LOCAL_LAUNCHERS else None


def is_launcher_override(arg: str) -> bool:
    return arg.lstrip("+~").startswith(("hydra/launcher=", "hydra.launcher.", "hydra.sweep."))


def _override(argv: list[str], key: str) -> str | None:
    values = [a.split("=", 1)[1] for a in argv if a.lstrip("+").startswith(f"{key}=")]
    return values[-1] if values else None


def check_launcher(launcher: str, argv: list[str]) -> None:
    """Refuse a launch that cannot work, naming the problem and the fix (ValueError), before submitting."""
    if not launcher.startswith("submitit_"):
        return  # another plugin: its own checks
    if importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None:
        raise ValueError(f"hydra/launcher={launcher} needs Hydra's submitit launcher: "
                         "pip install 'cobench[slurm]' (hydra-submitit-launcher)")
    if launcher != "submitit_slurm":
        return
    missing = [c for c in ("sbatch", "sinfo", "srun") if shutil.which(c) is None]
    if missing:
        raise ValueError(f"hydra/launcher=submitit_slurm: no {', '.join(missing)} on PATH: run cobench on a "
                         "submit host of the SLURM cluster (its client commands and slurm.conf)")
    try:
        answer = subprocess.run(["sinfo", "--noheader", "--format=%R"], capture_output=True, text=True,
                                timeout=SINFO_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        answer = None
    if answer is None or answer.returncode != 0:
        said = answer.stderr.strip().splitlines()[-1] if answer is not None and answer.stderr.strip() else \
            f"no answer within {SINFO_TIMEOUT_S:.0f} s"
        raise ValueError(f"hydra/launcher=submitit_slurm: the SLURM controller is unreachable ({said}); check "
                         f"that slurmctld runs and SLURM_CONF={os.environ.get('SLURM_CONF', '/etc/slurm/slurm.conf')} "
                         "points at it (`sinfo` must answer)")
    partitions = sorted({p.strip() for p in answer.stdout.split() if p.strip()})
    partition = _override(argv, "hydra.launcher.partition")
    if partition not in (None, "null") and partition not in partitions:
        raise ValueError(f"invalid config 'hydra.launcher.partition': the cluster has no partition {partition!r}; "
                         f"its partitions: {', '.join(partitions) or 'none'}")


def prepare_argv(argv: list[str], results_dir: Path) -> tuple[list[str], Path]:
    """``argv`` for a multirun through the chosen launcher, and the sweep folder its jobs will write."""
    sweep = _override(argv, "hydra.sweep.dir")
    if sweep is None:
        stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        sweep = str(results_dir.resolve() / "hydra" / f"multirun-{stamp}")
        argv = [*argv, f"hydra.sweep.dir={sweep}"]
    if "-m" not in argv and "--multirun" not in argv:
        argv = ["-m", *argv]  # a launcher acts on a multirun (one job is a sweep of one)
    return argv, Path(sweep)


def save_result(job_dir: str | Path, result: BenchmarkResult) -> None:
    """In a job: hand its result back to the submitting process (JSON, beside Hydra's job files)."""
    path = Path(job_dir) / RESULT_FILE
    write_atomic(path, result.to_json())


def collect_results(sweep_dir: Path) -> tuple[list[BenchmarkResult], list[list[str]]]:
    """The jobs' results in job order, with each job's own overrides; a job that left no result (it died,
    or the scheduler killed or cancelled it, even before Hydra made its folder) is a FAILED row naming
    where its logs are."""
    numbers = {int(d.name): None for d in sweep_dir.iterdir() if d.is_dir() and d.name.isdigit()} \
        if sweep_dir.is_dir() else {}
    submitted = sweep_dir / ".submitit"
    for d in submitted.iterdir() if submitted.is_dir() else ():  # an array's job: <job id>_<job number>
        *_, number = d.name.split("_")
        if d.is_dir() and "_" in d.name and number.isdigit():
            numbers[int(number)] = d
    results, overrides = [], []
    for number in sorted(numbers):
        job = sweep_dir / str(number)
        hydra_overrides = job / ".hydra" / "overrides.yaml"
        overrides.append(list(yaml.safe_load(hydra_overrides.read_text()) or []) if hydra_overrides.exists() else [])
        if (job / RESULT_FILE).exists():
            results.append(BenchmarkResult.from_json((job / RESULT_FILE).read_text()))
        else:
            logs = numbers[number] or submitted
            results.append(BenchmarkResult(f"job {number}", "?", "?", STATUS_FAILED, "-", None,
                                           error=f"the job left no result; its logs: {logs}"))
    return results, overrides


def queued_jobs(job_ids: set[str]) -> dict[str, str] | None:
    """The jobs among ``job_ids`` (``7`` or an array's ``7_1``) still in the scheduler's queue (pending,
    running, completing ...), each with its state, as ``squeue`` lists them; None when squeue did not answer."""
    if not job_ids:
        return {}
    parents = sorted({job_id.split("_")[0] for job_id in job_ids})
    try:
        answer = subprocess.run(["squeue", "--noheader", "--array", "--format=%i|%T", f"--jobs={','.join(parents)}"],
                                capture_output=True, text=True, timeout=SINFO_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if answer.returncode != 0:  # every id already purged from the controller's memory: none is queued
        return {} if "invalid job id" in answer.stderr.lower() else None
    listed = dict(line.strip().split("|", 1) for line in answer.stdout.splitlines() if "|" in line)
    return {job_id: state for job_id, state in listed.items() if job_id in job_ids}


def _slurm_watcher() -> type:
    from submitit.slurm.slurm import SlurmInfoWatcher

    class QueueWatcher(SlurmInfoWatcher):
        """submitit's watcher of SLURM jobs, which also works where ``sacct`` does not (a cluster that keeps no
        accounting, ``AccountingStorageType=accounting_storage/none``, or whose database is down): a job's
        state then comes from ``squeue``, and a job no longer queued has ended. submitit's own watcher kept
        such a job's state UNKNOWN, so a job that died or was cancelled without writing its result file was
        waited for forever."""

        _queued: set[str] = set()  # what squeue listed last (any state it lists, CONFIGURING too, is not ended)

        def is_done(self, job_id: str, mode: str = "standard") -> bool:
            return super().is_done(job_id, mode) and job_id not in self._queued

        def update(self) -> None:
            command = self._make_command()
            if command is None:
                return
            self._num_calls += 1
            try:
                answer = subprocess.run(command, capture_output=True, timeout=SINFO_TIMEOUT_S)
                accounted = answer.returncode == 0
            except (OSError, subprocess.TimeoutExpired):
                accounted = False
            if accounted:
                self._info_dict.update(self.read_info(answer.stdout))
            else:
                active = self._registered - self._finished
                queued = queued_jobs(active)
                if queued is not None:
                    self._queued = set(queued)
                    for job_id in active:
                        self._info_dict[job_id] = {"JobID": job_id, "State": queued.get(job_id, LEFT_QUEUE)}
            self._last_status_check = time.time()
            for job_id in self._registered - self._finished:
                if self.is_done(job_id, mode="cache"):
                    self._finished.add(job_id)

    return QueueWatcher


def launch_sweep(task: Callable, prog: str, launcher: str, argv: list[str],
                 sweep_dir: Path) -> tuple[list[BenchmarkResult], list[list[str]]]:
    """Run the multirun ``argv`` (from :func:`prepare_argv`) through ``launcher`` and return, once every job of
    it has ended, what the jobs left (:func:`collect_results`). A job that failed makes Hydra's launcher stop
    at it while the others may still run: on SLURM they are waited for (until squeue no longer lists them),
    not reported missing. Hydra's own exit is raised again when no job was submitted at all."""
    from harness.config import run_hydra_app

    if importlib.util.find_spec("submitit") is not None:
        from submitit.slurm.slurm import SlurmJob

        # the plugin builds its executor itself; its jobs ask the watcher their class holds
        SlurmJob.watcher = _slurm_watcher()(delay_s=WATCH_DELAY_S)
    try:
        run_hydra_app(task, prog, argv)
    except SystemExit as exit_:  # Hydra's way of saying a job raised or never started: the jobs' files say which
        folders = sweep_dir / ".submitit"
        jobs = {d.name for d in folders.iterdir() if d.is_dir()} if folders.is_dir() else set()
        if exit_.code in (0, None):
            return collect_results(sweep_dir)
        if not jobs:
            raise  # nothing was submitted: Hydra's own error stands
        print(f"{prog}: a job failed (Hydra exit {exit_.code}); the jobs' logs: {folders}", file=sys.stderr)
        if launcher == "submitit_slurm":
            print(f"{prog}: waiting for the sweep's other jobs to end", file=sys.stderr)
            unanswered = 0
            while (queued := queued_jobs(jobs)) or (queued is None and unanswered * QUEUE_POLL_S < WATCH_DELAY_S):
                unanswered = unanswered + 1 if queued is None else 0  # squeue did not answer: ask again, a while
                time.sleep(QUEUE_POLL_S)
    return collect_results(sweep_dir)
