"""Platform discovery and peak FLOP/s.

The device comes from ``torch.accelerator`` (CUDA, ROCm, XPU, MPS, ...) with a CPU fallback.
Peak FLOP/s comes from, in order: the platform config's declared ``peak_flops``, the built-in
table of known parts below, or a measured GEMM calibration cached per platform fingerprint. An
unknown part never borrows another part's peak: if calibration is off, the peak is unknown and
so is MFU.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import platform as pyplatform
import re
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from harness.config import PlatformConfig
from workloads.device import synchronize  # the harness's modules take it from here

# Dense (no sparsity) peak FLOP/s per device, from the vendors' data sheets (each row names its source; a
# sheet's "with sparsity" figure is halved). "float32" is the non-tensor-core rate, since torch's default
# matmul precision for float32 is "highest" (no TF32); the 66.9 and 51.2 TFLOP/s of the H100/H200 rows are
# SMs x 128 FP32 lanes x 2 x boost clock, which the sheets round to 67 and 51. A part whose sheet gives no
# figure for a dtype has none here: its peak for that dtype is measured (or unknown), never borrowed.
# Order matters: the first pattern that matches the device name wins, so a variant (NVL, PCIe, GH200, GB200)
# comes before the plain part whose name it contains.
KNOWN_PEAKS: list[tuple[str, dict[str, float]]] = [
    # NVIDIA H100 NVL (data sheet "NVIDIA H100 Tensor Core GPU", H100 NVL column; "NVIDIA H100 NVL")
    (r"H100.*NVL", {"bfloat16": 835.5e12, "float16": 835.5e12, "float8": 1670.5e12, "float32": 60e12}),
    # NVIDIA H100 PCIe (data sheet "NVIDIA H100 Tensor Core GPU", H100 PCIe column; "NVIDIA H100 PCIe")
    (r"H100.*PCIe", {"bfloat16": 756e12, "float16": 756e12, "float8": 1513e12, "float32": 51.2e12}),
    # NVIDIA GH200 Grace Hopper: the H100 SXM's compute (data sheet "NVIDIA GH200 Grace Hopper Superchip")
    (r"GH200", {"bfloat16": 989.4e12, "float16": 989.4e12, "float8": 1978.9e12, "float32": 66.9e12}),
    # NVIDIA H100 SXM (data sheet "NVIDIA H100 Tensor Core GPU", H100 SXM column; "NVIDIA H100 80GB HBM3")
    (r"H100", {"bfloat16": 989.4e12, "float16": 989.4e12, "float8": 1978.9e12, "float32": 66.9e12}),
    # NVIDIA H200 NVL (data sheet "NVIDIA H200 Tensor Core GPU", H200 NVL column; "NVIDIA H200 NVL")
    (r"H200.*NVL", {"bfloat16": 835.5e12, "float16": 835.5e12, "float8": 1670.5e12, "float32": 60e12}),
    # NVIDIA H200 SXM (data sheet "NVIDIA H200 Tensor Core GPU", H200 SXM column; "NVIDIA H200")
    (r"H200", {"bfloat16": 989.4e12, "float16": 989.4e12, "float8": 1978.9e12, "float32": 66.9e12}),
    # NVIDIA GB200's Blackwell GPU at up to 1200 W (data sheet "NVIDIA GB200 NVL72", per-GPU column)
    (r"GB200", {"bfloat16": 2500e12, "float16": 2500e12, "float8": 5000e12, "float32": 80e12}),
    # NVIDIA B200 at up to 1000 W (data sheet "NVIDIA HGX B200" / "NVIDIA DGX B200": 8 GPUs, sparse tensor
    # figures; per GPU dense 2.25 PF bf16, 4.5 PF fp8; FP32 600 TFLOPS / 8)
    (r"B200", {"bfloat16": 2250e12, "float16": 2250e12, "float8": 4500e12, "float32": 75e12}),
    # NVIDIA A100 SXM4 40/80 GB and PCIe 40/80 GB: one dense peak (data sheet "NVIDIA A100 Tensor Core GPU")
    (r"A100", {"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12}),
    # AMD Instinct MI325X: the MI300X's compute (data sheet "AMD Instinct MI325X Accelerator")
    (r"MI325X", {"bfloat16": 1307.4e12, "float16": 1307.4e12, "float8": 2614.9e12, "float32": 163.4e12}),
    # AMD Instinct MI300X (data sheet "AMD Instinct MI300X Accelerator"; FP32 matrix = vector, 163.4)
    (r"MI300X", {"bfloat16": 1307.4e12, "float16": 1307.4e12, "float8": 2614.9e12, "float32": 163.4e12}),
    # AMD Instinct MI250X (data sheet "AMD Instinct MI250X Accelerator"; FP32 matrix rate)
    (r"MI250X", {"bfloat16": 383e12, "float16": 383e12, "float32": 95.7e12}),
    # NVIDIA L40S (data sheet "NVIDIA L40S GPU"; tensor figures without sparsity)
    (r"L40S", {"bfloat16": 362.05e12, "float16": 362.05e12, "float8": 733e12, "float32": 91.6e12}),
    # Intel Gaudi 3, device type "hpu" (Intel, "Intel Gaudi 3 AI Accelerator" white paper and Hot Chips 2024:
    # MME 1835 TFLOPS in BF16 and FP8; no float32 matrix figure published). Names: "Intel(R) Gaudi(R) 3",
    # "GAUDI3", "Gaudi 3"; the OAM and PCIe cards are HL-325L and HL-338.
    (r"(?i)gaudi(\(r\))?[\s-]*3|HL-3[23]\d", {"bfloat16": 1835e12, "float8": 1835e12}),
]

# The platform label (``<device type>-<label>``, e.g. cuda-h100) of each KNOWN_PEAKS row: variants apart,
# since an H100 PCIe is not an H100 SXM to compare against
PART_LABELS: dict[str, str] = {
    r"H100.*NVL": "h100-nvl", r"H100.*PCIe": "h100-pcie", r"GH200": "gh200", r"H100": "h100",
    r"H200.*NVL": "h200-nvl", r"H200": "h200", r"GB200": "gb200", r"B200": "b200", r"A100": "a100",
    r"MI325X": "mi325x", r"MI300X": "mi300x", r"MI250X": "mi250x", r"L40S": "l40s",
    KNOWN_PEAKS[-1][0]: "gaudi3",
}


def known_part(device_name: str) -> tuple[str, dict[str, float]] | None:
    """The KNOWN_PEAKS row (pattern, peaks) whose pattern is the first to match ``device_name``, or None."""
    return next(((pattern, peaks) for pattern, peaks in KNOWN_PEAKS if re.search(pattern, device_name)), None)


# The oldest torch cobench supports (pyproject.toml's floor; docs/accelerators.md says why)
MIN_TORCH = (2, 10)


def torch_too_old(version: str = torch.__version__) -> str | None:
    """Why this torch is below cobench's floor, or None: a release older than MIN_TORCH lacks APIs the device
    paths use (they fall back where they can, but the MoE's grouped GEMM and the memory figures may not)."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None or (int(match[1]), int(match[2])) >= MIN_TORCH:
        return None
    return (f"torch {version} is older than {MIN_TORCH[0]}.{MIN_TORCH[1]}, the oldest cobench supports "
            f"(torch.nn.functional.grouped_mm and torch.accelerator.get_memory_info are 2.10's)")


@dataclass(frozen=True)
class PeakFlops:
    """A peak FLOP/s figure and where it came from (declared, table, measured, unknown); a measured one
    also says when and under what conditions (threads, the load average while it was measured)."""

    value: float | None
    source: str
    conditions: dict[str, str] = field(default_factory=dict)
    # the MFU above which a figure against this peak is not credible: eager PyTorch on a CPU reaches well under
    # this share of its own best GEMM (attention, norms and the optimiser run far below it); on accelerators
    # the best published training runs stay near 0.5-0.6 of the data-sheet peak
    mfu_ceiling: float = 0.85

    def tags(self) -> dict[str, str]:
        """MLflow tags: ``peak_flops_source`` and, for a measured peak, ``peak_flops_<condition>``."""
        return {"peak_flops_source": self.source, **{f"peak_flops_{k}": v for k, v in self.conditions.items()}}


@dataclass
class Platform:
    """The resolved platform of this process."""

    device: torch.device
    device_name: str  # what the hardware calls itself, e.g. "NVIDIA H100 80GB HBM3"
    name: str  # the label runs are tagged with, e.g. "cpu" or "cuda-h100"
    config: PlatformConfig
    host_allocator: str = "system"  # what configure_host_allocator applied, as recorded with every run
    _peaks: dict[str, PeakFlops] = field(default_factory=dict)

    @property
    def is_accelerator(self) -> bool:
        return self.device.type != "cpu"

    def fingerprint(self) -> str:
        """Identifies a platform for calibration caching: hardware, threads and software."""
        threads = torch.get_num_threads()
        parts = [self.device.type, self.device_name, str(os.cpu_count()), str(threads), torch.__version__]
        return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]

    def peak_flops(self, dtype: torch.dtype) -> PeakFlops:
        """Peak FLOP/s of one device for ``dtype``, with its source; cached per process."""
        key = str(dtype).removeprefix("torch.")
        if key not in self._peaks:
            self._peaks[key] = self._resolve_peak(key, dtype)
        return self._peaks[key]

    def peak_flops_measured_again(self, dtype: torch.dtype) -> PeakFlops:
        """A measured peak measured once more now, the faster of the two kept (a measurement is a lower bound),
        for a run that reached more of it than the platform credibly does; a declared, tabled or unknown peak
        is returned as it is."""
        peak = self.peak_flops(dtype)
        if peak.source != "measured_gemm":
            return peak
        key = str(dtype).removeprefix("torch.")
        self._peaks[key] = self._measured_peak(calibrated_gemm_entry(self, dtype, again=True))
        return self._peaks[key]

    def _resolve_peak(self, key: str, dtype: torch.dtype) -> PeakFlops:
        if key in self.config.peak_flops:
            return PeakFlops(float(self.config.peak_flops[key]), "declared")
        part = known_part(self.device_name) if self.is_accelerator else None
        if part is not None and key in part[1]:
            return PeakFlops(part[1][key], "table")
        if not self.config.calibrate:
            return PeakFlops(None, "unknown")
        return self._measured_peak(calibrated_gemm_entry(self, dtype))

    def _measured_peak(self, entry: dict) -> PeakFlops:
        conditions = {"measured_at": entry["measured_at"], "threads": str(entry["threads"]),
                      "loadavg": f"{entry['loadavg']:.2f}", "cores": str(entry["cores"])}
        if entry.get("doubt"):
            conditions["doubt"] = entry["doubt"]
        return PeakFlops(entry["flops"], "measured_gemm", conditions, 0.85 if self.is_accelerator else 0.7)


def resolve_device(requested: str) -> torch.device:
    """``auto`` → the current accelerator, else CPU; anything else must exist here."""
    if requested == "auto":
        accelerator = torch.accelerator.current_accelerator(check_available=True)
        if accelerator is None:
            return torch.device("cpu")
        return torch.device(accelerator.type, torch.accelerator.current_device_index())
    device = torch.device(requested)
    if device.type != "cpu":
        accelerator = torch.accelerator.current_accelerator(check_available=True)
        if accelerator is None or accelerator.type != device.type:
            found = accelerator.type if accelerator is not None else "none (CPU only)"
            raise ValueError(
                f"invalid config 'platform.device': {requested!r} is not available on this machine "
                f"(accelerator found: {found}); use platform.device=auto or cpu"
            )
    return device


def cpu_model_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return pyplatform.processor() or pyplatform.machine() or "unknown CPU"


def device_name(device: torch.device) -> str:
    """What the hardware calls itself: the device module's ``get_device_name`` (``torch.cuda`` on CUDA and
    ROCm, ``torch.xpu``, ``torch.hpu`` once Intel Gaudi's bridge is imported, ...), the CPU's model name."""
    if device.type == "cpu":
        return cpu_model_name()
    get_name = getattr(getattr(torch, device.type, None), "get_device_name", None)
    if get_name is not None:
        try:
            return str(get_name(device))
        except (RuntimeError, TypeError):  # a backend whose get_device_name takes no device
            return str(get_name())
    return device.type


def _label(device: torch.device, name: str) -> str:
    """``cpu``, ``<device type>-<part>`` for a known part (cuda-h100, cuda-h200-nvl, hpu-gaudi3), else the
    device type alone (an unknown accelerator: name it with ``platform.name``)."""
    if device.type == "cpu":
        return "cpu"
    part = known_part(name)
    return f"{device.type}-{PART_LABELS[part[0]]}" if part is not None else device.type


# glibc's mallopt parameters (malloc.h) and the values "steady" sets
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
STEADY_MMAP_THRESHOLD = 1 << 30  # blocks under 1 GiB come from the heap, so a freed one is reused, not unmapped
STEADY_TRIM_THRESHOLD = 2**31 - 1  # (mallopt takes an int) the heap's free top is kept, not given back
PRELOADED_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")


_host_allocator: str | None = None  # what configure_host_allocator last applied in this process


def host_allocator_in_effect() -> str:
    """How host memory behaves in this process, as :func:`configure_host_allocator` words it (the C library's
    defaults where nothing configured it), for records that outlive the process (a trace bundle's)."""
    return _host_allocator or configure_host_allocator("system")


def configure_host_allocator(mode: str) -> str:
    """Make host memory behave as a caching allocator's for this process (``platform.host_allocator``); returns
    what applies, for the run's record.

    glibc by default gives memory back to the system as soon as it is freed: a block over the (adaptive) mmap
    threshold is unmapped on free, and the heap's top is trimmed past 128 KiB. A training step frees its
    activations and allocates them again the next step, so each step pays page faults for memory it already
    had — measured here: Llama tiny at batch 16, 996 minor faults and 2.3 ms of system time in a 12 ms step
    (batch 8: 36 faults), so a step's time jumps where a tensor crosses the threshold, which no model of the
    work predicts. "steady" fixes the thresholds high (what ``MALLOC_MMAP_THRESHOLD_`` and
    ``MALLOC_TRIM_THRESHOLD_`` set at start-up), as PyTorch's CPU tuning guide gets by preloading jemalloc or
    tcmalloc; a preloaded allocator is left alone and named. Other C libraries are left as they are."""
    global _host_allocator
    _host_allocator = _configure_host_allocator(mode)
    return _host_allocator


def _configure_host_allocator(mode: str) -> str:
    preload = os.environ.get("LD_PRELOAD", "")
    preloaded = next((name for name in PRELOADED_ALLOCATORS if name in preload), None)
    if preloaded:
        return f"{preloaded} (LD_PRELOAD)"
    libc, version = pyplatform.libc_ver()
    if libc != "glibc":
        return f"system ({libc or 'unknown C library'}: left as it is)"
    if mode == "system" and _host_allocator and _host_allocator.startswith("steady"):
        return _host_allocator  # thresholds once set stay set: the record says what holds
    if mode == "system":
        tuned = sorted(k for k in os.environ if k.startswith("MALLOC_") and k.endswith("_"))
        return f"system (glibc {version} defaults{', ' + ' '.join(tuned) + ' from the environment' if tuned else ''})"
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if not (mallopt(M_TRIM_THRESHOLD, STEADY_TRIM_THRESHOLD) and mallopt(M_MMAP_THRESHOLD, STEADY_MMAP_THRESHOLD)):
        warnings.warn(f"glibc {version} refused platform.host_allocator=steady's thresholds: its defaults stand",
                      stacklevel=2)
        return f"system (glibc {version} refused the steady thresholds)"
    return f"steady (glibc {version}: mmap threshold 1 GiB, no trimming)"


def discover_platform(config: PlatformConfig, local_rank: int = 0) -> Platform:
    """Resolve the device (one per local rank on accelerators), set up host memory and name the platform."""
    allocator = configure_host_allocator(config.host_allocator)
    if (too_old := torch_too_old()) is not None:
        warnings.warn(too_old, stacklevel=2)
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    device = resolve_device(config.device)
    if device.type != "cpu" and config.device == "auto":
        device = torch.device(device.type, local_rank % torch.accelerator.device_count())
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index or 0)
    name = device_name(device)
    label = config.name if config.name != "auto" else _label(device, name)
    return Platform(device=device, device_name=name, name=label, config=config, host_allocator=allocator)


def measure_gemm_flops(device: torch.device, dtype: torch.dtype, size: int = 2048, repeats: int = 5,
                       min_seconds: float = 1.0, max_gemm_seconds: float = 0.25) -> float:
    """Best achieved FLOP/s of a square GEMM: the practical peak of a part we don't know. The GEMM grows from
    256 to ``size`` while one takes at most ``max_gemm_seconds`` (a dtype the part has no fast path for — bf16
    on a CPU without bf16 instructions: 106 s for one 2048 GEMM on one thread here — is measured at a size that
    takes a moment, at the same FLOP rate), then at least ``repeats`` GEMMs and ``min_seconds`` of them are
    timed, so a burst of other work does not set the figure."""
    def one(a: torch.Tensor, b: torch.Tensor) -> float:
        start = time.perf_counter()
        torch.mm(a, b)
        synchronize(device)
        return time.perf_counter() - start

    chosen = 256
    while True:
        a = torch.randn(chosen, chosen, device=device, dtype=dtype)
        b = torch.randn(chosen, chosen, device=device, dtype=dtype)
        one(a, b)  # warm-up: thread pools, kernel selection, clocks
        if chosen * 2 > size or one(a, b) > max_gemm_seconds / 8:  # the next size costs ~8x this one
            break
        chosen *= 2
    best, spent, done = float("inf"), 0.0, 0
    while done < repeats or spent < min_seconds:
        took = one(a, b)
        best, spent, done = min(best, took), spent + took, done + 1
    return 2.0 * chosen**3 / best


def load_average() -> float:
    """The 1-minute load average (0 where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


def implausible(entry: dict, cache: dict[str, dict]) -> str | None:
    """Why a cached peak cannot be trusted, or None. A measured peak is a lower bound of the real one: it is
    doubted when it was measured while the machine was busier than its cores (or its conditions were not
    recorded), and when the same device, dtype and torch measured *faster with fewer threads* (the figure
    with more threads was then taken on a busy machine)."""
    if not isinstance(entry.get("flops"), float) or "loadavg" not in entry or "cores" not in entry:
        return "measured without its conditions recorded"
    if entry["loadavg"] > entry["cores"]:
        return f"measured while the machine was busy (load {entry['loadavg']:.1f} on {entry['cores']} cores)"
    fewer = [other for other in cache.values()
             if other is not entry and isinstance(other.get("flops"), float)
             and (other.get("device_name"), other.get("dtype"), other.get("torch")) ==
             (entry["device_name"], entry["dtype"], entry["torch"])
             and other.get("threads", 0) < entry["threads"] and other["flops"] > 1.1 * entry["flops"]]
    if fewer:
        best = max(fewer, key=lambda other: other["flops"])
        return (f"{entry['flops'] / 1e9:.3g} GFLOP/s at {entry['threads']} threads, below the "
                f"{best['flops'] / 1e9:.3g} GFLOP/s measured at {best['threads']}")
    return None


def calibrated_gemm_entry(platform: Platform, dtype: torch.dtype, force: bool = False, again: bool = False) -> dict:
    """Measured GEMM peak and its conditions, cached in ``platform.calibration_cache`` by platform fingerprint.

    A cached figure is used while it is plausible (:func:`implausible`); a doubtful one is measured again
    once the machine is quiet (load average within its cores) — measuring on a busy machine would give no
    better figure, and would cost every run its time — and until then is used with its doubt (tag
    ``peak_flops_doubt``). ``force`` measures again whatever the load, and keeps the new figure; ``again``
    measures again whatever the cache holds, and keeps the faster figure."""
    key = f"{platform.fingerprint()}:{dtype}"
    cache_path = Path(platform.config.calibration_cache).expanduser()
    cache: dict[str, dict] = {}
    if cache_path.exists():
        try:
            cache = json.loads(cache_path.read_text())
        except (OSError, json.JSONDecodeError):
            cache = {}  # a damaged cache is only a cache: measure again and rewrite it
    cache = {k: v for k, v in cache.items() if isinstance(v, dict)}
    before = load_average()
    if not (force or again) and key in cache and isinstance(cache[key].get("flops"), float):
        doubt = implausible(cache[key], cache)
        if doubt is None:
            return cache[key]
        if before > (os.cpu_count() or 1) and platform.device.type == "cpu":
            return {**{"loadavg": 0.0, "cores": os.cpu_count() or 1, "threads": torch.get_num_threads(),
                       "measured_at": "unknown"}, **cache[key], "doubt": doubt}
    # an accelerator's GEMM units fill only at large sizes (an H200 reaches 47 % of its bf16 peak at 2048, 99 %
    # at 8192); a CPU reaches its rate well below 2048
    flops = measure_gemm_flops(platform.device, dtype, size=8192 if platform.is_accelerator else 2048)
    entry = {
        "flops": flops,
        "device_name": platform.device_name,
        "dtype": str(dtype),
        "threads": torch.get_num_threads(),
        "cores": os.cpu_count() or 1,
        "loadavg": max(before, load_average()),
        "torch": torch.__version__,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if platform.is_accelerator:
        entry["loadavg"] = 0.0  # the host's load says nothing of an accelerator's GEMM
    previous = cache.get(key)
    if previous is not None and isinstance(previous.get("flops"), float) and previous["flops"] > flops and not force:
        entry = {**previous, "loadavg": min(previous.get("loadavg", entry["loadavg"]), entry["loadavg"]),
                 "cores": entry["cores"]}  # a measurement is a lower bound: keep the faster one
    doubt = implausible(entry, {**cache, key: entry})
    if doubt:
        entry["doubt"] = doubt
        warnings.warn(f"the measured peak of {platform.device_name} ({dtype}) is doubtful: {doubt}; MFU against "
                      f"it reads high. Re-measure on a quiet machine: cobench calibrate --force", stacklevel=2)
    else:
        entry.pop("doubt", None)
    cache[key] = entry
    try:
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=cache_path.parent, delete=False, suffix=".tmp") as tmp:
            json.dump(cache, tmp, indent=1)
        os.replace(tmp.name, cache_path)  # atomic: concurrent runs never read half a file
    except OSError as err:  # the measurement stands; only the cache is lost
        warnings.warn(f"cannot write calibration cache {cache_path}: {err}", stacklevel=2)
    return entry
