"""Platform discovery and peak FLOP/s: declared, table, measured — never another part's peak."""

from __future__ import annotations

import json
import os
import platform as platform_module
import subprocess
import sys

import pytest
import torch

from harness.config import PlatformConfig
from harness.platform import Platform, discover_platform, resolve_device


def test_cpu_fallback_when_no_accelerator():
    if torch.accelerator.is_available():
        pytest.skip("this machine has an accelerator")
    platform = discover_platform(PlatformConfig())
    assert platform.device.type == "cpu"
    assert platform.name == "cpu"
    assert platform.device_name  # the CPU model, e.g. from /proc/cpuinfo


def test_asking_for_a_missing_accelerator_is_a_clear_error():
    if torch.accelerator.is_available():
        pytest.skip("this machine has an accelerator")
    with pytest.raises(ValueError, match="platform.device.*not available"):
        resolve_device("cuda")


def _fake(name: str, device: str = "cuda", **cfg) -> Platform:
    # A Platform describing a part this machine lacks; peak lookup never touches the device.
    return Platform(device=torch.device(device), device_name=name, name="x", config=PlatformConfig(**cfg))


# What each part calls itself (torch.cuda.get_device_name on CUDA and ROCm, Gaudi's bridge on HPU), the
# data sheet's dense figure and the platform label: a variant never falls into the plain part's row.
KNOWN_NAMES = [
    ("NVIDIA H100 80GB HBM3", "cuda", torch.bfloat16, 989.4e12, "cuda-h100"),
    ("NVIDIA H100 80GB HBM3", "cuda", torch.float32, 66.9e12, "cuda-h100"),
    ("NVIDIA H100 PCIe", "cuda", torch.bfloat16, 756e12, "cuda-h100-pcie"),
    ("NVIDIA H100 NVL", "cuda", torch.bfloat16, 835.5e12, "cuda-h100-nvl"),
    ("NVIDIA GH200 480GB", "cuda", torch.bfloat16, 989.4e12, "cuda-gh200"),
    ("NVIDIA H200", "cuda", torch.bfloat16, 989.4e12, "cuda-h200"),
    ("NVIDIA H200", "cuda", torch.float32, 66.9e12, "cuda-h200"),
    ("NVIDIA H200 NVL", "cuda", torch.bfloat16, 835.5e12, "cuda-h200-nvl"),
    ("NVIDIA B200", "cuda", torch.bfloat16, 2250e12, "cuda-b200"),
    ("NVIDIA B200", "cuda", torch.float32, 75e12, "cuda-b200"),
    ("NVIDIA GB200", "cuda", torch.bfloat16, 2500e12, "cuda-gb200"),
    ("NVIDIA A100-SXM4-80GB", "cuda", torch.bfloat16, 312e12, "cuda-a100"),
    ("NVIDIA A100-SXM4-40GB", "cuda", torch.bfloat16, 312e12, "cuda-a100"),
    ("NVIDIA A100 80GB PCIe", "cuda", torch.bfloat16, 312e12, "cuda-a100"),
    ("NVIDIA A100-PCIE-40GB", "cuda", torch.float32, 19.5e12, "cuda-a100"),
    ("AMD Instinct MI300X", "cuda", torch.bfloat16, 1307.4e12, "cuda-mi300x"),
    ("AMD Instinct MI325X", "cuda", torch.bfloat16, 1307.4e12, "cuda-mi325x"),
    ("AMD Instinct MI250X", "cuda", torch.bfloat16, 383e12, "cuda-mi250x"),
    ("NVIDIA L40S", "cuda", torch.bfloat16, 362.05e12, "cuda-l40s"),
    ("Intel(R) Gaudi(R) 3", "hpu", torch.bfloat16, 1835e12, "hpu-gaudi3"),
    ("GAUDI3", "hpu", torch.bfloat16, 1835e12, "hpu-gaudi3"),
]


@pytest.mark.parametrize("name, device, dtype, expected, label", KNOWN_NAMES)
def test_known_parts_use_the_declared_table(name, device, dtype, expected, label):
    from harness.platform import _label

    peak = _fake(name, device).peak_flops(dtype)
    assert (peak.value, peak.source) == (expected, "table")
    assert _label(torch.device(device), name) == label


def test_every_table_row_has_a_label_and_no_row_hides_behind_an_earlier_one():
    from harness.platform import KNOWN_PEAKS, PART_LABELS, known_part

    assert [pattern for pattern, _ in KNOWN_PEAKS] == list(PART_LABELS)
    for name, device, _, _, label in KNOWN_NAMES:  # each name lands on the row that carries its label
        pattern, _ = known_part(name)
        assert f"{device}-{PART_LABELS[pattern]}" == label
    reached = {known_part(name)[0] for name, *_ in KNOWN_NAMES}
    assert reached == set(PART_LABELS)  # every row is some name's first match


def test_unknown_part_never_borrows_a_peak():
    peak = _fake("Mystery Accelerator 9000", calibrate=False).peak_flops(torch.bfloat16)
    assert peak.value is None and peak.source == "unknown"
    # Gaudi 3's sheet gives no float32 matrix figure: unknown too, not the bf16 figure
    assert _fake("Intel(R) Gaudi(R) 3", "hpu", calibrate=False).peak_flops(torch.float32).value is None
    # nor does a name that only resembles a known one (an L40 is not an L40S, a Gaudi 2 not a Gaudi 3)
    assert _fake("NVIDIA L40", calibrate=False).peak_flops(torch.bfloat16).value is None
    assert _fake("GAUDI2", "hpu", calibrate=False).peak_flops(torch.bfloat16).value is None


def test_an_unknown_accelerator_is_measured_on_its_device(tmp_path, monkeypatch):
    """A part the table lacks gets a measured GEMM peak on its own device, tagged measured_gemm; the host's
    load average says nothing of an accelerator's GEMM and is not recorded as doubt."""
    measured = []

    def gemm(device, dtype, **_):
        measured.append((device, dtype))
        return 123e12

    monkeypatch.setattr("harness.platform.measure_gemm_flops", gemm)
    monkeypatch.setattr("harness.platform.load_average", lambda: 99.0)  # a busy host
    platform = _fake("Mystery Accelerator 9000", calibration_cache=str(tmp_path / "calibration.json"))
    peak = platform.peak_flops(torch.bfloat16)
    assert measured == [(torch.device("cuda"), torch.bfloat16)]
    assert (peak.value, peak.source, peak.mfu_ceiling) == (123e12, "measured_gemm", 0.85)
    assert peak.conditions["loadavg"] == "0.00" and "doubt" not in peak.conditions
    assert _fake("Mystery Accelerator 9000").name == "x"  # a label of its own comes from platform.name


def test_the_measured_gemm_synchronises_the_device_around_every_timed_product(monkeypatch):
    """Device work is asynchronous: each GEMM's clock is read only after the device has finished it."""
    from harness import platform as platform_module_

    calls = []
    monkeypatch.setattr(platform_module_, "synchronize", lambda device: calls.append(device))
    flops = platform_module_.measure_gemm_flops(torch.device("cpu"), torch.float32, size=256, repeats=3,
                                                min_seconds=0.0)
    assert flops > 0 and len(calls) >= 4  # warm-up, size probe, then every timed product
    synced = []
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda device=None: synced.append(device))
    from workloads.device import synchronize

    synchronize(torch.device("cuda", 0))
    synchronize(torch.device("cpu"))
    assert synced == [torch.device("cuda", 0)]  # any accelerator through torch.accelerator; nothing on the CPU


def test_a_torch_below_the_floor_is_named():
    from harness.platform import torch_too_old

    assert torch_too_old("2.9.1+cu128") is not None and "2.10" in torch_too_old("2.9.1+cu128")
    assert torch_too_old("2.10.0") is None and torch_too_old("2.11.0+cu130") is None
    assert torch_too_old(torch.__version__) is None


def test_memory_calls_fall_back_to_the_device_module_where_torch_accelerator_lacks_them(monkeypatch):
    """torch.accelerator's memory functions came in torch 2.9 (get_memory_info in 2.10): older ones answer
    through torch.<device type>."""
    import types

    from workloads import device as device_module

    fake_cuda = types.SimpleNamespace(max_memory_allocated=lambda d: 7, mem_get_info=lambda d: (100, 200),
                                      memory_reserved=lambda d: 50, memory_allocated=lambda d: 30,
                                      reset_peak_memory_stats=lambda d: None)
    monkeypatch.setattr(torch, "cuda", fake_cuda)
    for name in ("max_memory_allocated", "get_memory_info", "memory_reserved", "memory_allocated",
                 "reset_peak_memory_stats"):
        monkeypatch.delattr(torch.accelerator, name, raising=False)
    cuda = torch.device("cuda", 0)
    device_module.reset_peak_memory_stats(cuda)
    assert device_module.max_memory_allocated(cuda) == 7
    assert device_module.free_memory_bytes(cuda) == 100 + 20  # the driver's free plus the allocator's unused cache
    assert device_module.max_memory_allocated(torch.device("cpu")) == 0


def test_declared_peak_wins():
    peak = _fake("NVIDIA H100 80GB HBM3", peak_flops={"bfloat16": 1e15}).peak_flops(torch.bfloat16)
    assert (peak.value, peak.source) == (1e15, "declared")


def test_cpu_peak_is_measured_once_and_cached_per_fingerprint(tmp_path, quiet_now):
    cache = tmp_path / "calibration.json"
    platform = discover_platform(PlatformConfig(device="cpu", calibration_cache=str(cache)))
    peak = platform.peak_flops(torch.float32)
    assert peak.source == "measured_gemm" and peak.value > 1e8  # any real CPU beats 0.1 GFLOP/s
    entries = json.loads(cache.read_text())
    (key, entry), = entries.items()
    assert key.startswith(platform.fingerprint())
    # A second process on the same platform reads the cache instead of measuring again.
    assert {"threads", "cores", "loadavg", "measured_at", "torch"} <= set(entry)  # the conditions it was taken in
    entry.pop("doubt", None)  # measured while this machine was busy: here, as if it had been quiet
    entry["flops"], entry["loadavg"] = 123.0e9, 0.0  # as measured on a quiet machine
    cache.write_text(json.dumps({key: entry}))
    again = discover_platform(PlatformConfig(device="cpu", calibration_cache=str(cache)))
    assert again.peak_flops(torch.float32).value == 123.0e9


def _cached(platform, cache, **entry):
    """A cache holding this platform's float32 peak with ``entry``'s fields (the rest as measured quietly)."""
    key = f"{platform.fingerprint()}:{torch.float32}"
    fields = {"flops": 1.0e6, "device_name": platform.device_name, "dtype": str(torch.float32),
              "threads": torch.get_num_threads(), "cores": os.cpu_count(), "loadavg": 0.0,
              "torch": torch.__version__, "measured_at": "2026-01-01T00:00:00+0000", **entry}
    cache.write_text(json.dumps({key: fields}))
    return key, fields


@pytest.fixture
def quiet_now(monkeypatch):
    """The machine as a calibration sees it when nothing else runs."""
    monkeypatch.setattr("harness.platform.load_average", lambda: 0.0)


@pytest.mark.parametrize("stale", [{"loadavg": 99.0}, {"loadavg": None}], ids=["measured-busy", "no-conditions"])
def test_a_peak_measured_on_a_busy_machine_or_without_its_conditions_is_measured_again(tmp_path, stale, quiet_now):
    cache = tmp_path / "calibration.json"
    platform = discover_platform(PlatformConfig(device="cpu", calibration_cache=str(cache)))
    key, _ = _cached(platform, cache, **stale)
    if stale["loadavg"] is None:
        data = json.loads(cache.read_text())
        del data[key]["loadavg"]
        cache.write_text(json.dumps(data))
    peak = platform.peak_flops(torch.float32)
    assert peak.value > 1e8  # measured again, not the stale 1 MFLOP/s
    assert set(peak.tags()) >= {"peak_flops_source", "peak_flops_threads", "peak_flops_loadavg",
                                "peak_flops_measured_at"}


def test_a_doubtful_peak_waits_for_a_quiet_machine_and_says_why_meanwhile(tmp_path, monkeypatch):
    """Measuring again while the machine is busy would give no better figure and cost every run its time: the
    cached figure is used, with its doubt in the run's tags."""
    monkeypatch.setattr("harness.platform.load_average", lambda: 99.0)
    cache = tmp_path / "calibration.json"
    platform = discover_platform(PlatformConfig(device="cpu", calibration_cache=str(cache)))
    _cached(platform, cache, loadavg=50.0)
    peak = platform.peak_flops(torch.float32)
    assert peak.value == 1.0e6 and "busy (load 50.0" in peak.tags()["peak_flops_doubt"]


def test_a_peak_slower_than_fewer_threads_measured_is_measured_again(tmp_path, quiet_now):
    """More threads cannot be slower at a GEMM than fewer: the many-thread figure was taken on a busy machine
    (a 2-thread peak of 68 GFLOP/s beside a 1-thread one of 188 read as 86 % MFU)."""
    cache = tmp_path / "calibration.json"
    platform = discover_platform(PlatformConfig(device="cpu", calibration_cache=str(cache)))
    key, mine = _cached(platform, cache, threads=torch.get_num_threads() + 1)
    fewer = {**mine, "threads": 0, "flops": 1.0e7}  # fewer threads, ten times faster than the stale figure
    cache.write_text(json.dumps({key: mine, "other-fingerprint:torch.float32": fewer}))
    from harness.platform import implausible

    assert "below the" in implausible(mine, json.loads(cache.read_text()))
    assert platform.peak_flops(torch.float32).value > 1e8
    assert json.loads(cache.read_text())[key]["flops"] > 1e8


def test_an_mfu_above_what_the_platform_reaches_is_flagged_with_the_fix():
    from harness.running.metrics import mfu_doubt

    assert mfu_doubt({"mfu": 0.3}, 0.7, None) is None
    assert "86 % is above the 70 %" in mfu_doubt({"mfu": 0.86}, 0.7, None)
    assert "cobench calibrate --force" in mfu_doubt({"mfu": 0.2}, 0.7, "measured while the machine was busy")
    assert mfu_doubt({}, 0.7, "busy") is None  # no MFU, nothing to doubt


def test_damaged_calibration_cache_is_remeasured(tmp_path):
    cache = tmp_path / "calibration.json"
    cache.write_text("{not json")
    platform = discover_platform(PlatformConfig(device="cpu", calibration_cache=str(cache)))
    assert platform.peak_flops(torch.float32).value > 1e8
    assert json.loads(cache.read_text())  # rewritten whole


FAULTS_PER_STEP = """
import resource, sys
import torch
from harness.config import PlatformConfig
from harness.platform import discover_platform
platform = discover_platform(PlatformConfig(device="cpu", host_allocator=sys.argv[1]))
def step():  # a training step's shape: 48 MB of activations made, used and freed
    x = torch.empty(12 * 2**20)
    x.fill_(1.0)
for _ in range(3):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(platform.host_allocator, "|", (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10)
"""


@pytest.mark.skipif(platform_module.libc_ver()[0] != "glibc", reason="steady sets glibc thresholds")
def test_steady_host_memory_spares_each_step_the_page_faults_of_memory_it_freed():
    """glibc unmaps a freed 48 MB block, so the next step faults it all in again (12,288 pages);
    platform.host_allocator=steady keeps it, and the run's record says which applied."""
    seen = {}
    for mode in ("system", "steady"):
        done = subprocess.run([sys.executable, "-c", FAULTS_PER_STEP, mode], capture_output=True, text=True,
                              check=True)
        applied, faults = done.stdout.strip().rsplit("|", 1)
        seen[mode] = (applied.strip(), float(faults))
    assert seen["system"][0].startswith("system (glibc")
    assert seen["steady"][0].startswith("steady (glibc")
    assert seen["system"][1] > 10_000  # every page of the block, every step
    assert seen["steady"][1] < 100


def test_a_host_allocator_that_does_not_exist_is_refused():
    with pytest.raises(ValueError, match="platform.host_allocator.*allowed values: steady, system"):
        PlatformConfig(host_allocator="jemalloc")


def test_torch_fx_tracing_notice_is_filtered_at_its_origin_and_nothing_else_there_is(caplog):
    """TorchRec asks torch.fx's is_fx_tracing() on every DLRM/seqrec run, which logs advice meant for
    TorchRec's authors; the runner filters that one message, not the logger."""
    import logging

    import torch.fx._symbolic_trace as symbolic_trace

    import harness.running.runner  # noqa: F401 - installs the filter

    symbolic_trace.is_fx_tracing_warning.cache_clear()
    with caplog.at_level(logging.WARNING, logger="torch.fx._symbolic_trace"):
        symbolic_trace.is_fx_tracing()
        logging.getLogger("torch.fx._symbolic_trace").warning("another warning")
    assert [r.getMessage() for r in caplog.records] == ["another warning"]


def test_calibrate_force_measures_again_and_says_under_what_load(tmp_path, capsys):
    from suite.cli import main

    cache = tmp_path / "calibration.json"
    platform = discover_platform(PlatformConfig(device="cpu", calibration_cache=str(cache)))
    _cached(platform, cache, flops=1.0e6)  # plausible on its face: only --force replaces it
    assert main(["calibrate", "--force", f"platform.calibration_cache={cache}"]) == 0
    out = capsys.readouterr().out
    assert "GFLOP/s  measured" in out and "at load" in out and f"cache: {cache}" in out
    assert next(iter(json.loads(cache.read_text()).values()))["flops"] > 1e8
