"""`cobench compare`: real runs on two platform configurations, read back from MLflow."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import TINY


@pytest.fixture(scope="module")
def two_platforms(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One results folder with tiny Llama on '1 thread' and '2 threads' (two runs each)."""
    import subprocess
    import sys

    from conftest import clean_env

    results = tmp_path_factory.mktemp("cmp") / "results"
    # one command, four runs (a sweep): the same configuration twice per platform, each named by its threads
    proc = subprocess.run(
        [sys.executable, "-m", "suite.cli", "run", "-m", "platform.num_threads=1,2,1,2",
         "platform.name=cpu-${platform.num_threads}t", "platform.calibrate=false", *TINY, f"results_dir={results}"],
        capture_output=True, text=True, timeout=600, env=clean_env(), cwd=results.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return results


def test_compare_two_thread_counts(cobench, two_platforms: Path, tmp_path: Path):
    out = tmp_path / "cmp"
    proc = cobench("compare", "--results-dir", str(two_platforms), "--baseline", "cpu-1t", "--workload", "llama",
                   "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "cpu-1t" in proc.stdout and "cpu-2t" in proc.stdout
    data = json.loads((out / "compare.json").read_text())
    rows = {r["platform"]: r for r in data["rows"]}
    assert rows["cpu-1t"]["ratio"] == 1.0 and rows["cpu-1t"]["n"] == 2
    assert rows["cpu-2t"]["ratio"] == pytest.approx(rows["cpu-2t"]["value"] / rows["cpu-1t"]["value"])
    assert rows["cpu-2t"]["unit"] == "tokens/s"
    assert (out / "compare.svg").read_text().lstrip().startswith(("<?xml", "<svg"))
    assert (out / "compare.png").stat().st_size > 1000
    assert "| llama | cpu-2t |" in (out / "compare.md").read_text()


def test_compare_filters_and_bad_input(cobench, two_platforms: Path, tmp_path: Path, capsys):
    from suite.cli import main

    def refused(*args: str) -> str:
        """`cobench compare ARGS` through the command's entry point, in this process: exit 2; what it said."""
        assert main(["compare", *args]) == 2
        return capsys.readouterr().err

    assert "platforms found: cpu-1t, cpu-2t" in refused("--results-dir", str(two_platforms), "--baseline", "h100")
    assert "no finished runs" in refused("--results-dir", str(two_platforms), "--workload", "dlrm")
    assert "no finished runs" in refused("--results-dir", str(two_platforms), "--since", "2999-01-01")
    assert "no tracking store" in refused("--results-dir", str(tmp_path / "empty"))
    # a real command: no traceback on its stderr, whatever MLflow's own logging prints there
    proc = cobench("compare", "--tracking-uri", "http://127.0.0.1:9")
    assert proc.returncode == 2 and "127.0.0.1:9" in proc.stderr and "Traceback" not in proc.stderr


def test_compare_takes_the_shared_settings_as_key_value(cobench, two_platforms: Path, tmp_path: Path, capsys):
    """`results_dir=DIR` works in every command, as in `cobench run`; other key=value is refused by name."""
    from suite.cli import main

    proc = cobench("compare", f"results_dir={two_platforms}", "--workload", "llama", "--out", str(tmp_path / "kv"))
    assert proc.returncode == 0, proc.stderr
    assert {r["platform"] for r in json.loads((tmp_path / "kv" / "compare.json").read_text())["rows"]} == {
        "cpu-1t", "cpu-2t"}
    assert main(["compare", f"results_dir={two_platforms}", "workload=llama"]) == 2  # in this process
    err = capsys.readouterr().err
    assert "'workload=llama'" in err and "results_dir=" in err


def test_compare_reads_a_tracking_server(cobench, mlflow_server, tmp_path: Path):
    # the session's shared server: these runs go to an experiment of this test's own
    proc = cobench("run", "-m", "tracking=server", f"tracking.uri={mlflow_server}",
                   "tracking.experiment=compare-server", "platform.num_threads=1,2",
                   "platform.name=cpu-${platform.num_threads}t", "platform.calibrate=false", *TINY, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = cobench("compare", "--tracking-uri", mlflow_server, "--experiment", "compare-server", "--baseline", "cpu-2t",
                   "--out", str(tmp_path / "o"))
    assert proc.returncode == 0, proc.stderr
    rows = json.loads((tmp_path / "o" / "compare.json").read_text())["rows"]
    assert {r["platform"] for r in rows} == {"cpu-1t", "cpu-2t"}


def test_plot_with_one_run_per_platform(tmp_path: Path):
    """One run per platform: min == value == max, and the whiskers must not go negative by rounding
    (CI once failed with matplotlib's "'yerr' must not contain negative values")."""
    from suite.compare import _plot

    rows = []
    for platform, value in (("a", 59319.690671274955), ("b", 42879.2093986462)):
        rows.append({"benchmark": "llama_tiny", "platform": platform, "value": value, "min": value, "max": value,
                     "n": 1, "cv": 0.0, "ratio": value / 59319.690671274955})
    _plot(rows, ["a", "b"], "a", "throughput", tmp_path)
    assert (tmp_path / "compare.svg").stat().st_size > 0


def test_configurations_are_named_by_what_differs(cobench, tmp_path: Path):
    """Two configurations of one benchmark get one row each, named by the setting that differs (not a hash),
    with the world size and the spread over every repetition."""
    proc = cobench("run", "-m", "workload.batch_size=2,4", *TINY, "runner.repetitions=2", "platform.calibrate=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = cobench("compare", f"results_dir={tmp_path / 'results'}", "--out", str(tmp_path / "o"))
    assert proc.returncode == 0, proc.stderr
    rows = json.loads((tmp_path / "o" / "compare.json").read_text())["rows"]
    assert sorted(r["benchmark"] for r in rows) == ["llama batch_size=2", "llama batch_size=4"]
    assert all(r["world_size"] == "1" and r["n"] == 1 and r["min"] <= r["value"] <= r["max"] for r in rows)
    assert all(r["min"] < r["max"] for r in rows)  # one run, two repetitions: their spread, not min == max
    assert "llama batch_size=2" in proc.stdout and "tok/s" in proc.stdout
