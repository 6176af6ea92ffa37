"""The sessions users run. Install nox once: `python3.11 -m pip install nox`.

    nox -s bench              the main job: the smoke suite on this machine (results/ by default)
    nox -s bench -- results_dir=/tmp/res runner.repetitions=5    (overrides go after --)
    nox -s qualify -- platform=cpu      hardware qualification: PASS/FAIL against conf/gates/cpu.yaml
    nox -s report -- --suite smoke      MLPerf-style submission folder + HTML report of the latest smoke run
    nox -s tests              the test suite on 2 workers (what CI runs); `nox -s tests -- -n 0` runs it serially
    nox -s perf               the performance benchmarks (pytest-benchmark), not part of tests
    nox -s zoo                the model zoo, whole (its own environment: torchvision, timm, TorchRec, ...)
    nox -s docs               the documentation site, built strictly into site/ (what CI builds)
    nox -s lint               ruff

bench, qualify, report, tests, perf and docs share one virtualenv, .nox/cobench: made by whichever
runs first, each adding only the extras it needs (so the quickstart installs torch and TorchRec
once); lint has its own. torch is pinned to the build this project is verified with (the CPU wheel
on this machine); set COBENCH_TORCH to install another, e.g.
COBENCH_TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128".
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

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
# megatron-core's indexed dataset (the `.bin`/`.idx` format of MLPerf's Llama 3.1 8B data) runs on CPU; its
# metadata pulls GPU-only packages, so it comes without its dependencies, with the `data` extra.
MEGATRON = ["megatron-core==0.16.1"]


SHARED = Path(".nox") / "cobench"  # the one environment the project's sessions share


def install(session: nox.Session, extras: str = "") -> dict[str, str]:
    """The shared environment with the project and ``extras`` in it; returns the ``env`` that puts
    its commands first on PATH (for what they start: torchrun, mlflow). torch first (pinned, so
    nothing pulls a multi-GB CUDA build), TorchRec, then the project. A stamp per (pins,
    pyproject.toml, extras) skips what is already there."""
    python = SHARED / "bin" / "python"
    if not python.exists():
        session.run(f"python{PYTHON}", "-m", "venv", str(SHARED), external=True)
        session.run(str(python), "-m", "pip", "install", "--quiet", "--upgrade", "pip", external=True)
    key = hashlib.sha256("\n".join([TORCH, FBGEMM, *TORCHREC, *TORCHREC_DEPS, *MEGATRON, extras,
                                    Path("pyproject.toml").read_text()]).encode()).hexdigest()[:16]
    stamp = SHARED / f".installed-{key}"
    if not stamp.exists():
        pip = [str(python), "-m", "pip", "install"]
        session.run(*pip, *TORCH.split(), external=True)
        session.run(*pip, *FBGEMM.split(), external=True)
        session.run(*pip, "--no-deps", *TORCHREC, external=True)
        session.run(*pip, *TORCHREC_DEPS, external=True)
        session.run(*pip, "-e", f".[{extras}]" if extras else ".", external=True)
        if "data" in extras.split(","):
            session.run(*pip, "--no-deps", *MEGATRON, external=True)
        stamp.touch()
    home = SHARED.resolve()
    return {"PATH": str(home / "bin") + os.pathsep + os.environ.get("PATH", ""), "VIRTUAL_ENV": str(home)}


def _bin(command: str) -> str:
    """A command of the shared environment, by its full path."""
    return str(SHARED.resolve() / "bin" / command)


@nox.session(venv_backend="none")
def bench(session: nox.Session) -> None:
    """The main job: the smoke suite on this platform; Hydra overrides after `--`."""
    session.run(_bin("cobench"), "suite", "smoke", *session.posargs, env=install(session), external=True)


@nox.session(venv_backend="none")
def qualify(session: nox.Session) -> None:
    """Hardware qualification: the qualify suite judged against conf/gates/<platform>.yaml; exit 0 = PASS.
    `nox -s qualify -- platform=cpu`; `nox -s qualify -- --record-golden platform=cpu` records references."""
    session.run(_bin("cobench"), "qualify", *session.posargs, env=install(session), external=True)


@nox.session(venv_backend="none")
def report(session: nox.Session) -> None:
    """Submission folder + HTML report of the latest suite run: `nox -s report -- --suite smoke --org acme`."""
    session.run(_bin("cobench"), "report", *session.posargs, env=install(session), external=True)


# Two pytest-xdist workers: a test spends about half its time starting processes, importing and waiting on
# servers, so two keep CI's two cores busy. tests/worker_groups.py says which tests share a worker and which run
# with no neighbour. Set here, not in pytest's addopts, so that a plain `pytest tests/test_x.py` stays serial and
# `-p no:xdist` still parses; pytest arguments after `--` come later and win (`nox -s tests -- -n 0`).
TEST_WORKERS = ["-n", "2", "--dist", "loadgroup"]


@nox.session(venv_backend="none")
def tests(session: nox.Session) -> None:
    """The test suite; pytest arguments after `--`."""
    env = install(session, "test,chakra,data")
    session.run(_bin("pytest"), *TEST_WORKERS, *(session.posargs or ["-q"]), env=env, external=True)


@nox.session(venv_backend="none")
def perf(session: nox.Session) -> None:
    """Performance benchmarks (pytest-benchmark): figures to report, never pass/fail gates."""
    env = install(session, "test")
    session.run(_bin("pytest"), "benchmarks", "--benchmark-only", "-p", "no:cacheprovider",
                "--benchmark-columns=min,median,max,stddev,rounds", *session.posargs, env=env, external=True)


@nox.session(venv_backend="none")
def docs(session: nox.Session) -> None:
    """The documentation site (MkDocs, mkdocs.yml) built strictly into site/: a broken link or any warning fails.
    The metrics page's table is rendered from harness.running.metrics at build time (docs/hooks/metrics.py)."""
    env = install(session, "docs")
    env["NO_MKDOCS_2_WARNING"] = "1"  # Material's banner about MkDocs 2: a notice, not a warning of this site's
    session.run(_bin("mkdocs"), "build", "--strict", "--site-dir", "site", *session.posargs, env=env, external=True)


@nox.session(venv_backend="none")
def accelerator(session: nox.Session) -> None:
    """The accelerator check's whole dry run, offline, in a bare venv with torch and the wheelhouse (~5 min);
    the tests run a subset of its steps in the project's environment."""
    env = install(session, "test")
    session.run(_bin("pytest"), "tests/test_accelerator_check.py", "-m", "wheelhouse", "-p", "no:cacheprovider",
                *session.posargs, env=env, external=True)


@nox.session(venv_backend="none")
def corpus(session: nox.Session) -> None:
    """Every program written as newcomers write them (tests/newcomer_programs.py), captured and replayed op by op
    (7 min here); the tests run a fast subset of them."""
    env = install(session, "test")
    session.run(_bin("pytest"), "tests/test_newcomer_programs.py", "-m", "not wheelhouse", "-p", "no:cacheprovider",
                *session.posargs, env=env, external=True)


# The model zoo needs torchvision, and PyPI's torchvision imports only beside the torch it was built with:
# no CPU build of torchvision matches the project's CPU torch on PyPI, so the zoo has an environment of its
# own with the torch/torchvision pair that does (a CUDA build, which runs on the CPU too) and the FBGEMM/TorchRec
# built for that torch.
ZOO_TORCH = os.environ.get("COBENCH_ZOO_TORCH", "torch==2.14.1 torchvision==0.29.1")
ZOO_LIBRARIES = ["timm==1.0.31", "transformers>=4.45", "diffusers==0.42.1", "torch_geometric==2.8.1",
                 "fbgemm-gpu-cpu==1.9.0"]
ZOO_TORCHREC = ["torchrec==1.9.2"]


@nox.session(venv_backend="none")
def zoo(session: nox.Session) -> None:
    """The model zoo, whole: every program judged twice, each a fresh capture in a process of its own, the table in
    <results_dir>/zoo/<time>/ (zoo.md, zoo.csv, zoo.json) and MLflow; `cobench trace zoo` options after `--`."""
    home = Path(".nox") / "zoo"
    python = home / "bin" / "python"
    if not python.exists():
        session.run(f"python{PYTHON}", "-m", "venv", str(home), external=True)
    key = hashlib.sha256("\n".join([ZOO_TORCH, *ZOO_LIBRARIES, *ZOO_TORCHREC, *TORCHREC_DEPS,
                                    Path("pyproject.toml").read_text()]).encode()).hexdigest()[:16]
    stamp = home / f".installed-{key}"
    if not stamp.exists():
        pip = [str(python), "-m", "pip", "install", "--quiet"]
        session.run(*pip, *ZOO_TORCH.split(), external=True)
        session.run(*pip, *ZOO_LIBRARIES, external=True)
        session.run(*pip, "--no-deps", *ZOO_TORCHREC, external=True)
        session.run(*pip, *TORCHREC_DEPS, external=True)
        session.run(*pip, "-e", ".", external=True)
        stamp.touch()
    env = {"PATH": str(home.resolve() / "bin") + os.pathsep + os.environ.get("PATH", ""),
           "VIRTUAL_ENV": str(home.resolve())}
    session.run(str(home / "bin" / "cobench"), "trace", "zoo", *session.posargs, env=env, external=True)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "check", "harness", "workloads", "suite", "tests", "tools", "benchmarks", "docs",
                "noxfile.py")
