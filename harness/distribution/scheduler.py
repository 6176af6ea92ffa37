"""Jobs on a cluster's scheduler: Hydra launcher plugins (``hydra/launcher=submitit_slurm``).

``cobench run -m ... hydra/launcher=submitit_slurm`` and ``cobench suite NAME hydra/launcher=submitit_slurm``
hand each job to Hydra's launcher, which submits it (sbatch) and runs it where the scheduler puts it;
``hydra.launcher.tasks_per_node=N`` makes a job N processes (srun tasks), which join one process group
as they would under torchrun (:func:`harness.distributed.adopt_slurm_tasks`). Here:

- :func:`check_launcher`: bad input costs nothing — a missing plugin, no SLURM commands, a controller
  that does not answer, a partition that does not exist are refused before any job or MLflow run exists;
- :func:`prepare_argv`: the sweep folder is fixed up front, so the submitting process finds what the jobs
  left there: each job's rank 0 writes its :class:`~harness.running.runner.BenchmarkResult` as ``result.json``
  in its Hydra job folder (:func:`save_result`), read back by :func:`collect_results`.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import yaml

from harness.files import write_atomic
from harness.running.runner import STATUS_FAILED, BenchmarkResult

LOCAL_LAUNCHERS = ("basic",)  # Hydra's in-process launcher: the jobs run here, one after the other
RESULT_FILE = "result.json"
SINFO_TIMEOUT_S = 30.0


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
    or the scheduler killed it) is a FAILED row naming where its logs are."""
    results, overrides = [], []
    jobs = sorted((d for d in sweep_dir.iterdir() if d.is_dir() and d.name.isdigit()), key=lambda d: int(d.name)) \
        if sweep_dir.is_dir() else []
    for job in jobs:
        hydra_overrides = job / ".hydra" / "overrides.yaml"
        overrides.append(list(yaml.safe_load(hydra_overrides.read_text()) or []) if hydra_overrides.exists() else [])
        if (job / RESULT_FILE).exists():
            results.append(BenchmarkResult.from_json((job / RESULT_FILE).read_text()))
        else:
            results.append(BenchmarkResult(f"job {job.name}", "?", "?", STATUS_FAILED, "-", None,
                                           error=f"the job left no result; its logs: {sweep_dir / '.submitit'}"))
    return results, overrides
