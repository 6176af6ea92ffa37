"""`cobench doctor`: the page says what this machine is, in text and as JSON, without measuring anything."""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys

import pytest
import torch

from harness.config import PlatformConfig
from harness.platform import Platform, discover_platform
from suite import doctor
from suite.cli import main


def _doctor(*args: str) -> tuple[int, str]:
    """``cobench doctor ARGS`` in this process (the heavy imports are paid once for the whole file)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["doctor", *args])
    return code, out.getvalue()


@pytest.fixture(scope="module")
def empty_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("doctor") / "calibration.json")


@pytest.fixture(scope="module")
def page(empty_cache: str) -> str:
    code, out = _doctor(f"platform.calibration_cache={empty_cache}")
    assert code == 0
    return out


@pytest.fixture(scope="module")
def report(empty_cache: str) -> dict:
    code, out = _doctor("--json", f"platform.calibration_cache={empty_cache}")
    assert code == 0
    return json.loads(out)


def test_the_page_has_every_section_and_this_machines_facts(page, empty_cache):
    for section in ("host", "device", "versions", "peak FLOP/s", "workloads", "options"):
        assert f"\n{section}" in f"\n{page}"
    assert torch.__version__ in page
    assert f"cores             {os.cpu_count()} (" in page
    assert "  float32           not measured: `cobench calibrate`" in page
    assert not os.path.exists(empty_cache), "the doctor measured a GEMM without --measure"


def test_json_matches_the_machine(report):
    assert report["versions"]["torch"] == torch.__version__
    assert report["host"]["cpu_count"] == os.cpu_count()
    assert report["device"]["device"] == "cpu" and report["device"]["dist_backend"] == "gloo"
    assert report["device"]["backends_built"]["gloo"] is True
    assert report["versions"]["libraries"]["torchrec"] != "not installed"
    for name in ("llama", "dlrm", "seqrec", "llama_infer", "generated", "collectives"):
        assert report["workloads"][name]["supported"], report["workloads"][name]
    assert "cpu build" in report["workloads"]["dlrm"]["reason"]  # fbgemm-gpu-cpu is what this machine has
    row_wise = report["options"]["sharding=row_wise (dlrm, seqrec)"]
    assert not row_wise["supported"] and "needs CUDA" in row_wise["reason"]
    assert report["peaks"]["float32"] == {"flops": None, "source": doctor.NOT_MEASURED, "conditions": {},
                                          "doubt": None}


def test_a_cached_calibration_is_shown_with_its_conditions_and_doubt(tmp_path):
    cache = tmp_path / "calibration.json"
    platform = discover_platform(PlatformConfig(calibration_cache=str(cache)))
    entry = {"flops": 5.0e10, "device_name": platform.device_name, "dtype": "torch.float32", "threads": 2,
             "cores": 2, "loadavg": 7.5, "torch": torch.__version__, "measured_at": "2026-01-02T03:04:05+0000"}
    cache.write_text(json.dumps({f"{platform.fingerprint()}:torch.float32": entry}))
    peak = doctor.peak_figures(platform, measure=False)["float32"]
    assert peak["flops"] == 5.0e10 and peak["source"] == "measured_gemm (cached)"
    assert peak["conditions"]["measured_at"] == "2026-01-02T03:04:05+0000"
    assert "busy" in peak["doubt"]
    assert doctor.describe_peak(peak).startswith("50.0 GFLOP/s  measured_gemm (cached): 2026-01-02T03:04:05+0000, "
                                                 "2 threads, load 7.50 on 2 cores  DOUBTFUL: ")


def test_a_known_accelerator_takes_its_peaks_from_the_table_float8_included(tmp_path):
    h100 = Platform(device=torch.device("cuda"), device_name="NVIDIA H100 80GB HBM3", name="cuda-h100",
                    config=PlatformConfig(calibration_cache=str(tmp_path / "none.json")))  # never touches a GPU
    peaks = doctor.peak_figures(h100, measure=False)
    assert {dtype: (p["flops"], p["source"]) for dtype, p in peaks.items()} == {
        "float32": (66.9e12, "table"), "bfloat16": (989.4e12, "table"), "float16": (989.4e12, "table"),
        "float8": (1978.9e12, "table")}
    assert doctor.describe_peak(peaks["bfloat16"]) == "989.4 TFLOP/s  table"


def test_a_workload_whose_library_is_missing_is_not_supported_and_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlperf_loadgen", None)  # import of it fails, as where it is not installed
    support = doctor.workload_support(discover_platform(PlatformConfig()))
    assert support["llama_infer"] == {"supported": False, "reason": "mlperf_loadgen is not installed "
                                                                    "(pip install mlcommons-loadgen==6.0.*)"}
    assert support["llama"]["supported"]


def test_a_module_that_fails_to_import_is_reported_with_its_errors_first_line(tmp_path, monkeypatch):
    (tmp_path / "broken_kernels").mkdir()
    (tmp_path / "broken_kernels" / "__init__.py").write_text(
        "print('noise'); raise OSError('libtorch_cuda.so: cannot open shared object file\\nsecond line')")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert doctor.missing("broken_kernels", load=False) is None  # located: only importing tells
    assert doctor.missing("broken_kernels", load=True) == \
        "broken_kernels fails to import: OSError: libtorch_cuda.so: cannot open shared object file"


@pytest.mark.parametrize("args", [["--bogus"], ["workload=llama"], ["platform.no_such_key=1"]])
def test_a_bad_argument_exits_2(args, capsys):
    assert main(["doctor", *args]) == 2
    assert "cobench doctor" in capsys.readouterr().err
