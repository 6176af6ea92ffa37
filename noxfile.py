"""The sessions users run. Install nox once: `python3.11 -m pip install nox`.

    nox -s bench              the main job: the smoke suite on this machine (results/ by default)
    nox -s bench -- results_dir=/tmp/res runner.repetitions=5    (overrides go after --)
    nox -s qualify -- platform=cpu      hardware qualification: PASS/FAIL against conf/gates/cpu.yaml
    nox -s report -- --suite smoke      MLPerf-style submission folder + HTML report of the latest smoke run
    nox -s tests              the test suite (what CI runs)
    nox -s perf               the performance benchmarks (pytest-benchmark), not part of tests
    nox -s lint               ruff

Each session gets its own virtualenv under .nox/, reused between calls. torch is pinned to the
build this project is verified with (the CPU wheel on this machine); set COBENCH_TORCH to
install another, e.g. COBENCH_TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128".
"""

from __future__ import annotations

import os

import nox

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True
PYTHON = "3.11"
TORCH = os.environ.get("COBENCH_TORCH", "torch==2.13.0")
# TorchRec's metadata asks for the CUDA fbgemm-gpu, which cannot load on a CPU-only torch: install
# the CPU build (or COBENCH_FBGEMM="fbgemm-gpu==1.8.0" on CUDA), then torchrec without its deps,
# then torchrec's other requirements (torchmetrics pinned exactly by torchrec 1.8.0).
FBGEMM = os.environ.get("COBENCH_FBGEMM", "fbgemm-gpu-cpu==1.8.0")
TORCHREC = ["torchrec==1.8.0"]
TORCHREC_DEPS = ["tensordict", "torchmetrics==1.0.3", "pyre-extensions", "tqdm"]


def install(session: nox.Session, extras: str = "") -> None:
    """torch first (pinned, so nothing pulls a multi-GB CUDA build), TorchRec, then the project."""
    session.install(*TORCH.split())
    session.install(*FBGEMM.split())
    session.install("--no-deps", *TORCHREC)
    session.install(*TORCHREC_DEPS)
    session.install("-e", f".[{extras}]" if extras else ".")


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """The main job: the smoke suite on this platform; Hydra overrides after `--`."""
    install(session)
    session.run("cobench", "suite", "smoke", *session.posargs)


@nox.session(python=PYTHON)
def qualify(session: nox.Session) -> None:
    """Hardware qualification: the qualify suite judged against conf/gates/<platform>.yaml; exit 0 = PASS.
    `nox -s qualify -- platform=cpu`; `nox -s qualify -- --record-golden platform=cpu` records references."""
    install(session)
    session.run("cobench", "qualify", *session.posargs)


@nox.session(python=PYTHON)
def report(session: nox.Session) -> None:
    """Submission folder + HTML report of the latest suite run: `nox -s report -- --suite smoke --org acme`."""
    install(session)
    session.run("cobench", "report", *session.posargs)


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """The test suite; pytest arguments after `--`."""
    install(session, "test,chakra")
    session.run("pytest", *(session.posargs or ["-q"]))


@nox.session(python=PYTHON)
def perf(session: nox.Session) -> None:
    """Performance benchmarks (pytest-benchmark): figures to report, never pass/fail gates."""
    install(session, "test")
    session.run("pytest", "benchmarks", "--benchmark-only", "-p", "no:cacheprovider",
                "--benchmark-columns=min,median,max,stddev,rounds", *session.posargs)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "check", "harness", "workloads", "suite", "tests", "benchmarks", "noxfile.py")
