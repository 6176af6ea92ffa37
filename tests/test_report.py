"""`cobench report`: an MLPerf submission folder and an HTML report, rendered in headless Chromium."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.fixture(scope="module")
def smoke_results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import sys

    from conftest import clean_env

    results = tmp_path_factory.mktemp("report") / "results"
    proc = subprocess.run([sys.executable, "-m", "suite.cli", "suite", "smoke", "runner.repetitions=2",
                           "runner.progress=false", f"results_dir={results}"],
                          capture_output=True, text=True, timeout=600, env=clean_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return results


@pytest.fixture(scope="module")
def report_dir(smoke_results: Path) -> Path:
    import sys

    from conftest import clean_env

    out = smoke_results.parent / "submission"
    proc = subprocess.run([sys.executable, "-m", "suite.cli", "report", "--results-dir", str(smoke_results),
                           "--org", "acme", "--system", "ci-cpu", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, env=clean_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    # llama and dlrm, 2 repetitions each; the MoE's logs name no MLPerf benchmark (MLPerf has no MoE LLM one)
    assert "compliance: 4 of 4 MLPerf logs pass" in proc.stdout
    return out


def test_submission_folder_has_the_mlperf_layout(report_dir: Path):
    system = json.loads((report_dir / "acme" / "systems" / "ci-cpu.json").read_text())
    for key in ("submitter", "division", "status", "system_name", "number_of_nodes", "host_processor_model_name",
                "host_processor_core_count", "host_memory_capacity", "accelerator_model_name",
                "accelerators_per_node", "framework", "operating_system"):
        assert key in system, key
    assert system["submitter"] == "acme" and system["framework"].startswith("PyTorch")
    for bench in ("llama_tiny_train", "dlrm_tiny_train", "seqrec_tiny_train"):
        logs = sorted((report_dir / "acme" / "results" / "ci-cpu" / bench).glob("result_*.txt"))
        assert [p.name for p in logs] == ["result_0.txt", "result_1.txt"]
        bench_dir = report_dir / "acme" / "benchmarks" / bench
        assert "cobench run workload=" in (bench_dir / "README.md").read_text()
        assert (bench_dir / "config.yaml").is_file()
    compliance = json.loads((report_dir / "compliance.json").read_text())
    assert {c["mlperf_benchmark"] for c in compliance} == {"llama31_8b", "dlrm_dcnv2"}
    assert all(c["passed"] for c in compliance)


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary: install Debian's `chromium` (.ci/run does)")
def test_html_report_renders_in_headless_chromium(report_dir: Path):
    html = (report_dir / "report.html").read_text()
    assert 'src="http' not in html and 'href="http' not in html and "<link" not in html  # self-contained
    dom = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom",
                          (report_dir / "report.html").as_uri()], capture_output=True, text=True, timeout=120).stdout
    for text in ("ci-cpu", "System description", "llama_tiny_train", "dlrm_tiny_train", "seqrec_tiny_train",
                 "moe_tiny_train", "llama_infer_tiny", "tokens/s", "MLPerf compliance", "llama31_8b",
                 "cobench run workload=llama", "Reproduce"):
        assert text in dom, text
    assert dom.count("<svg") >= 2 and dom.count(">PASS<") == 4  # the compliance rows: 2 training logs x 2
    shot = report_dir / "report.png"
    subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={shot}",
                    "--window-size=1200,2000", (report_dir / "report.html").as_uri()],
                   capture_output=True, timeout=120, check=True)
    assert shot.stat().st_size > 20_000  # a rendered page, not a blank one


def test_report_bad_input(smoke_results: Path, tmp_path: Path, capsys):
    from suite.cli import main

    def refused(*args: str) -> str:
        """`cobench report ARGS` through the command's entry point, in this process: exit 2; what it said."""
        assert main(["report", *args]) == 2
        return capsys.readouterr().err

    assert "no tracking store" in refused("--results-dir", str(tmp_path / "nothing"))
    assert "no run of suite 'qualify'" in refused("--results-dir", str(smoke_results), "--suite", "qualify")
    assert "no run '0123456789abcdef'" in refused("--results-dir", str(smoke_results), "--run", "0123456789abcdef")


def test_a_reproduce_command_runs_the_same_configuration_on_the_same_platform(report_dir: Path, smoke_results: Path,
                                                                             tmp_path: Path):
    """The command a benchmark's README gives runs what the suite ran: the same config hash and the same
    platform settings (none of the run's overrides dropped)."""
    import shlex
    import sys

    from conftest import clean_env, mlflow_runs

    readme = (report_dir / "acme" / "benchmarks" / "llama_tiny_train" / "README.md").read_text()
    command = shlex.split(readme.split("Reproduce:", 1)[1].strip())
    assert command[:2] == ["cobench", "run"] and "runner.repetitions=2" in command
    again = tmp_path / "again"
    proc = subprocess.run([sys.executable, "-m", "suite.cli", *command[1:], f"results_dir={again}"],
                          capture_output=True, text=True, timeout=300, env=clean_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    (rerun,) = mlflow_runs(again)
    (original,) = [r for r in mlflow_runs(smoke_results) if r.data.tags.get("benchmark") == "llama_tiny_train"]
    assert rerun.data.tags["config_hash"] == original.data.tags["config_hash"]
    platform = {k: v for k, v in original.data.params.items() if k.startswith("platform.")}
    assert platform and {k: rerun.data.params.get(k) for k in platform} == platform
