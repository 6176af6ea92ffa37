"""``cobench doctor [--json] [--measure] [platform overrides]``: what this machine is to cobench.

One page: the host, the device cobench would run on and the distributed backend it would pick, the
versions of torch and of every library cobench uses, the peak FLOP/s MFU is measured against and where
each figure comes from, and which workloads and options can run here — each with the reason when not.

Nothing is measured unless asked: a peak is the declared one, the table's, or a GEMM calibration already
in the cache (with its conditions and any doubt); ``--measure`` calibrates what is missing and builds the
error-bounded codec's CPU kernels. Support is decided by real checks: a package is imported where an
installed one can still fail to load (native extensions: FBGEMM, TorchRec, LoadGen, tokenizers, torchft,
Triton) and located (``importlib.util.find_spec``) where it cannot, and every workload's own module is
imported. :func:`doctor_report` returns the page as one JSON-serialisable dict (``--json`` prints it).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import importlib.metadata
import importlib.util
import io
import json
import logging
import os
import platform as pyplatform
import re
import shutil
import socket
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist

from harness.cli import EXIT_OK
from harness.config import PlatformConfig
from harness.platform import KNOWN_PEAKS, Platform, cpu_model_name, device_name, discover_platform, implausible

# the distributions cobench imports, by their names on PyPI
LIBRARIES = ("hydra-core", "omegaconf", "mlflow", "mlflow-skinny", "mlperf-logging", "mlcommons-loadgen", "torchrec",
             "fbgemm-gpu", "fbgemm-gpu-cpu", "torchft", "transformers", "datasets", "tokenizers", "megatron-core",
             "mlc-chakra", "triton")
BACKENDS = ("gloo", "nccl", "xccl", "mpi")
NOT_MEASURED = "not measured: `cobench calibrate`"
# what to install when a module is missing
CPU_TORCH = torch.version.cuda is None and torch.version.hip is None
INSTALL = {"mlperf_loadgen": "mlcommons-loadgen==6.0.*",
           "torchrec": "torchrec --no-deps, after fbgemm-gpu-cpu" if CPU_TORCH else "torchrec",
           "fbgemm_gpu": "fbgemm-gpu-cpu" if CPU_TORCH else "fbgemm-gpu", "torchft": "'cobench[ft]'",
           "datasets": "'cobench[data]'", "tokenizers": "'cobench[data]'", "pandas": "'cobench[data]'",
           "megatron.core": "megatron-core --no-deps", "chakra.src.converter.pytorch_converter": "'cobench[chakra]'",
           "mlflow": "mlflow", "triton": "triton (CUDA torch wheels bring it)", "mlperf_logging": "mlperf-logging",
           "hydra_plugins.hydra_submitit_launcher": "'cobench[slurm]'"}


def doctor_report(measure: bool = False, platform_config: PlatformConfig | None = None) -> dict[str, Any]:
    """The page as a dict: ``host``, ``device``, ``versions``, ``peaks``, ``workloads``, ``options``.

    ``workloads`` and ``options`` map a name (``dlrm``, ``workload.compile=true``) to ``{"supported": bool,
    "reason": str}``. ``measure`` calibrates the peaks runs use that are not in the cache yet (the platform's
    ``peak_flops``) and builds the CPU codec kernels; without it nothing is measured or built.
    """
    platform = discover_platform(platform_config or PlatformConfig())
    return {"host": host_facts(), "device": device_facts(platform), "versions": versions(),
            "peaks": peak_figures(platform, measure), "workloads": workload_support(platform),
            "options": option_support(platform, measure)}


def host_facts() -> dict[str, Any]:
    """Hostname, OS, Python, CPU model, cores (all, and those this process may use), memory, load."""
    try:
        release = pyplatform.freedesktop_os_release().get("PRETTY_NAME", "")
    except OSError:
        release = ""
    memory = psutil.virtual_memory()
    return {"hostname": socket.gethostname(), "os": f"{pyplatform.system()} {pyplatform.release()}",
            "os_release": release, "python": pyplatform.python_version(), "cpu_model": cpu_model_name(),
            "cpu_count": os.cpu_count(),
            "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "torch_threads": torch.get_num_threads(), "memory_total_bytes": memory.total,
            "memory_available_bytes": memory.available, "loadavg": list(psutil.getloadavg())}


def device_facts(platform: Platform) -> dict[str, Any]:
    """The device runs get, every accelerator device, and the distributed backends."""
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    count = torch.accelerator.device_count() if accelerator is not None else 0
    devices = [describe_device(torch.device(accelerator.type, i)) for i in range(count)] if accelerator else []
    return {"device": str(platform.device), "platform": platform.name, "device_name": platform.device_name,
            "accelerator": accelerator.type if accelerator is not None else None, "count": count,
            "devices": devices, "dist_backend": chosen_backend(platform),
            "backends_built": {b: dist.is_available() and dist.is_backend_available(b) for b in BACKENDS}}


def chosen_backend(platform: Platform) -> str:
    """The process-group backend runs take: ``platform.dist_backend``, where auto is the harness's choice."""
    from harness.distributed import default_backend

    backend = platform.config.dist_backend
    return default_backend(platform.device) if backend == "auto" else backend


def describe_device(device: torch.device) -> dict[str, Any]:
    """Name, memory and (CUDA) compute capability of one accelerator device."""
    facts: dict[str, Any] = {"index": device.index, "name": device_name(device), "memory_bytes": None}
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        facts["memory_bytes"] = properties.total_memory
        facts["compute_capability"] = f"{properties.major}.{properties.minor}"
    elif hasattr(torch.accelerator, "get_memory_info"):
        with contextlib.suppress(RuntimeError, NotImplementedError):  # a backend without the query
            facts["memory_bytes"] = torch.accelerator.get_memory_info(device)[1]
    return facts


def library_version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def versions() -> dict[str, Any]:
    """torch (and the CUDA/HIP it was built with), Python, and each library cobench uses."""
    return {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "torch_hip": torch.version.hip,
            "python": pyplatform.python_version(), "libraries": {name: library_version(name) for name in LIBRARIES}}


def peak_figures(platform: Platform, measure: bool) -> dict[str, dict[str, Any]]:
    """Peak FLOP/s per dtype with its source: declared, table, a cached calibration, or not measured.

    ``measure`` asks the platform for the dtypes runs take MFU in (float32; bfloat16 too on accelerators,
    as ``cobench calibrate``), which calibrates where the cache has no plausible figure."""
    unmeasured = dataclasses.replace(platform, config=dataclasses.replace(platform.config, calibrate=False), _peaks={})
    used = ("float32", "bfloat16") if platform.is_accelerator else ("float32",)
    figures = {}
    for name in ("float32", "bfloat16", "float16"):
        asked = platform if measure and name in used else unmeasured
        peak = asked.peak_flops(getattr(torch, name))
        if peak.value is None and platform.config.calibrate:
            figures[name] = cached_peak(platform, name)
        else:
            figures[name] = {"flops": peak.value, "source": peak.source, "conditions": peak.conditions,
                             "doubt": peak.conditions.get("doubt")}
    float8 = platform.config.peak_flops.get("float8")  # declared or tabled only: no GEMM calibration in float8
    part = next((p for pattern, p in KNOWN_PEAKS if re.search(pattern, platform.device_name)), {})
    tabled = part.get("float8") if platform.is_accelerator else None  # the first row that matches, as runs
    if float8 is not None or tabled is not None:
        figures["float8"] = {"flops": float(float8 if float8 is not None else tabled), "conditions": {},
                             "source": "declared" if float8 is not None else "table", "doubt": None}
    return figures


def cached_peak(platform: Platform, dtype: str) -> dict[str, Any]:
    """The GEMM calibration cached for this platform fingerprint and ``dtype`` (read, never measured)."""
    path = Path(platform.config.calibration_cache).expanduser()
    try:
        cache = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, json.JSONDecodeError):
        cache = {}
    cache = {k: v for k, v in cache.items() if isinstance(v, dict)} if isinstance(cache, dict) else {}
    entry = cache.get(f"{platform.fingerprint()}:torch.{dtype}")
    if entry is None or not isinstance(entry.get("flops"), float):
        return {"flops": None, "source": NOT_MEASURED, "conditions": {}, "doubt": None}
    conditions = {k: str(entry[k]) for k in ("measured_at", "threads", "loadavg", "cores") if k in entry}
    return {"flops": entry["flops"], "source": "measured_gemm (cached)", "conditions": conditions,
            "doubt": implausible(entry, cache)}


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence what importing a heavy package says (warnings, log lines, prints)."""
    previous = logging.root.manager.disable
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)
        try:
            yield
        finally:
            logging.disable(previous)


def missing(module: str, load: bool = False) -> str | None:
    """Why ``module`` cannot be used here (a sentence), or None; ``load`` imports it, not only locates it."""
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package absent, or a module without a spec
        found = False
    if not found:
        return f"{module} is not installed" + (f" (pip install {INSTALL[module]})" if module in INSTALL else "")
    if load:
        try:
            with quiet():
                importlib.import_module(module)
        except Exception as err:  # noqa: BLE001 - any failure to import means: not usable here; say which
            first = str(err).splitlines()[0] if str(err) else ""
            return f"{module} fails to import: {type(err).__name__}: {first}"
    return None


def verdict(problems: list[str | None], works: str) -> dict[str, Any]:
    """``{"supported", "reason"}``: the first problem, or ``works`` when there is none."""
    found = [p for p in problems if p]
    return {"supported": not found, "reason": found[0] if found else works}


def torchrec_problem() -> str | None:
    """Why TorchRec (and the FBGEMM build it runs on) cannot be used in this process, or None."""
    problem = missing("fbgemm_gpu", load=True)
    if problem and CPU_TORCH and "libtorch_cuda" in problem:
        problem += " (this is the CUDA build of fbgemm-gpu on CPU torch: install fbgemm-gpu-cpu)"
    return problem or missing("torchrec", load=True)


def fbgemm_variant() -> str | None:
    """``cpu``, ``cuda`` or ``rocm``: the FBGEMM build imported (None where it is not importable)."""
    module = sys.modules.get("fbgemm_gpu")
    return getattr(module, "__variant__", None) if module is not None else None


def workload_support(platform: Platform) -> dict[str, dict[str, Any]]:
    """Every registered workload: its requirements checked, then its own module imported."""
    from workloads import discover

    device, backend = platform.device, chosen_backend(platform)
    backend_problem = None if dist.is_available() and dist.is_backend_available(backend) else \
        f"the {backend} backend is not built into this torch"
    if backend == "nccl" and torch.accelerator.device_count() < 2:  # NCCL refuses two ranks on one GPU
        backend_problem = "nccl needs one GPU per rank and this machine has 1: platform=cpu runs 2 ranks here"
    recsys = torchrec_problem()
    recsys_works = "" if recsys else \
        f"TorchRec {library_version('torchrec')} + FBGEMM ({fbgemm_variant()} build) import"
    if device.type == "cuda" and fbgemm_variant() == "cpu":
        recsys_works += ("; one process only: fbgemm-gpu-cpu is installed, and TorchRec's table-wise/row-wise "
                         "sharding on GPU needs the CUDA build (pip install fbgemm-gpu)")
    requires: dict[str, tuple[list[str | None], str]] = {
        "llama": ([], "needs only torch"),
        "llama_infer": ([missing("mlperf_loadgen", load=True)], "MLPerf LoadGen imports"),
        "dlrm": ([recsys], recsys_works),
        "seqrec": ([recsys], recsys_works),
        "collectives": ([backend_problem], f"needs >= 2 ranks: `torchrun --nproc-per-node 2 -m suite.cli suite "
                                           f"collectives` (backend {backend})"),
        "generated": ([], "needs only torch; replays a spec from `cobench trace generate`"),
    }
    harness = missing("mlperf_logging") or missing("harness.running.runner", load=True)  # what runs every workload
    support = {}
    for name, spec in sorted(discover().items()):
        problems, works = requires.get(name, ([], "its module imports"))
        support[name] = verdict([harness, *problems, missing(spec.module, load=True)], works)
    return support


def option_support(platform: Platform, measure: bool) -> dict[str, dict[str, Any]]:
    """Notable options (compile, codecs, sharding, real data, fault tolerance, Chakra, MLflow, SLURM)."""
    device = platform.device
    recsys = torchrec_problem()
    tokenizers = missing("tokenizers", load=True)
    compiler = next((found for name in ("c++", "g++", "cc") if (found := shutil.which(name))), None)
    if device.type == "cpu":
        compile_ = verdict([None if compiler else "no C++ compiler on PATH (c++, g++ or cc): inductor's CPU backend "
                            "needs one"], f"inductor's CPU backend compiles with {compiler}")
    else:
        compile_ = verdict([missing("triton", load=True)], f"Triton {library_version('triton')}")
    gpu_sharding = None
    if device.type != "cuda":
        gpu_sharding = f"row_wise needs CUDA: TorchRec shards row-wise only on cuda (here: {device.type})"
    elif fbgemm_variant() not in (None, "cuda"):
        gpu_sharding = "fbgemm-gpu-cpu is installed: row-wise/table-wise sharding on GPU needs CUDA fbgemm-gpu"
    # the harness's own checks, where the harness's modules import here (a bare machine may lack their libraries)
    fp8 = missing("workloads.dlrm.codec_registry", load=True)
    if fp8 is None:
        from workloads.dlrm.codec_registry import codec_unsupported

        fp8 = codec_unsupported("fp8", device, 2)
    slurm = missing("hydra_plugins.hydra_submitit_launcher") or missing("harness.distribution.scheduler", load=True)
    if slurm is None:
        from harness.distribution.scheduler import check_launcher

        try:
            check_launcher("submitit_slurm", [])
        except ValueError as err:
            slurm = str(err)
    ft, lighthouse = missing("torchft", load=True) or missing("harness.distribution.ft.supervisor", load=True), None
    if ft is None:
        from harness.distribution.ft.processes import lighthouse_binary

        lighthouse = lighthouse_binary()
        ft = None if lighthouse else "no torchft_lighthouse program beside this Python or on PATH"
    return {
        "workload.compile=true": compile_,
        "comm_codec=eb (dlrm)": verdict([recsys], eb_kernel(device, compiler, measure)),
        "comm_codec=fp8 (dlrm)": verdict([recsys, fp8], "FBGEMM's FP8 codec"),
        "sharding=row_wise (dlrm, seqrec)": verdict([recsys, gpu_sharding], "TorchRec row-wise sharding on CUDA"),
        "workload.data=c4 (llama)": verdict([missing("datasets"), tokenizers], "datasets + tokenizers"),
        "workload.data=megatron (llama)": verdict([missing("megatron.core"), tokenizers],
                                                  "megatron-core's indexed dataset + tokenizers"),
        "workload.data=criteo_1tb (dlrm)": verdict([recsys], "MLPerf's Criteo layout, read with numpy"),
        "workload.data=movielens (seqrec)": verdict([recsys, missing("pandas")], "pandas reads the ratings"),
        "ft=torchft": verdict([ft], f"torchft with its lighthouse {lighthouse}"),
        "trace export --format chakra": verdict([missing("chakra.src.converter.pytorch_converter")], "mlc-chakra"),
        "tracking=sqlite|server (MLflow)": verdict(
            [missing("mlflow") and f"{missing('mlflow')}: only tracking=off runs"], "MLflow"),
        "hydra/launcher=submitit_slurm": verdict([slurm], "submitit launcher and a reachable SLURM controller"),
    }


def eb_kernel(device: torch.device, compiler: str | None, measure: bool) -> str:
    """Which implementation of the error-bounded codec runs here; on CPU without building it unless ``measure``."""
    from workloads.dlrm.error_bounded import fast_kernels

    if device.type != "cpu" or measure:
        with quiet():
            name = fast_kernels.kernel_name(device)
        return {"cpp": "cpp kernels", "compiled": "the tensor program under torch.compile"}.get(
            name, "the tensor program, eager (slower)") + " (with >1 rank)"
    from torch.utils.cpp_extension import is_ninja_available

    built = next(fast_kernels.build_directory().glob("*.so"), None)
    if built is not None:
        return f"cpp kernels, built: {built} (with >1 rank)"
    if compiler and is_ninja_available():
        return f"cpp kernels, built with {compiler} + ninja on first use (with >1 rank)"
    return "tensor program: no C++ compiler or ninja to build the cpp kernels (same bytes, slower; with >1 rank)"


def render(report: dict[str, Any]) -> str:
    """The plain-text page."""
    gib = 1024**3
    host, device, versions_ = report["host"], report["device"], report["versions"]

    def row(label: str, value: str) -> str:
        return f"  {label:<17} {value}"

    lines = ["host", row("hostname", host["hostname"]),
             row("os", host["os"] + (f" ({host['os_release']})" if host["os_release"] else "")),
             row("python", host["python"]), row("cpu", host["cpu_model"]),
             row("cores", f"{host['cpu_count']} ({host['cpu_affinity']} usable by this process, torch uses "
                          f"{host['torch_threads']} threads)"),
             row("memory", f"{host['memory_total_bytes'] / gib:.1f} GiB total, "
                           f"{host['memory_available_bytes'] / gib:.1f} GiB available"),
             row("load average", " ".join(f"{x:.2f}" for x in host["loadavg"])),
             "", "device",
             row("runs on", f"{device['device']}: {device['device_name']} (platform {device['platform']})"),
             row("accelerator", f"{device['accelerator']} x {device['count']}" if device["accelerator"]
                 else "none: runs take the CPU")]
    for d in device["devices"]:
        memory = f", {d['memory_bytes'] / gib:.1f} GiB" if d["memory_bytes"] else ""
        capability = f", compute capability {d['compute_capability']}" if d.get("compute_capability") else ""
        lines.append(row(f"{device['accelerator']}:{d['index']}", f"{d['name']}{memory}{capability}"))
    built = ", ".join(f"{b} {'yes' if ok else 'no'}" for b, ok in device["backends_built"].items())
    lines += [row("distributed", f"{device['dist_backend']} (built in: {built})"),
              "", "versions",
              row("torch", f"{versions_['torch']} (CUDA {versions_['torch_cuda'] or '-'}, "
                           f"HIP {versions_['torch_hip'] or '-'})"),
              row("python", versions_["python"])]
    lines += [row(name, version) for name, version in versions_["libraries"].items()]
    lines += ["", "peak FLOP/s (what MFU is measured against)"]
    for dtype, peak in report["peaks"].items():
        lines.append(row(dtype, describe_peak(peak)))
    for title in ("workloads", "options"):
        lines += ["", title]
        width = max(len(name) for name in report[title])
        lines += [f"  {name:<{width}}  {'SUPPORTED' if v['supported'] else 'NOT':9s}  {v['reason']}"
                  for name, v in report[title].items()]
    return "\n".join(lines)


def describe_peak(peak: dict[str, Any]) -> str:
    """``117.7 GFLOP/s  measured_gemm (cached): 2026-..., 2 threads, load 0.58 on 2 cores`` and any doubt."""
    if peak["flops"] is None:
        return peak["source"]
    scale, unit = (1e12, "TFLOP/s") if peak["flops"] >= 1e12 else (1e9, "GFLOP/s")
    said, conditions = f"{peak['flops'] / scale:.1f} {unit}  {peak['source']}", peak["conditions"]
    if "measured_at" in conditions:
        said += (f": {conditions['measured_at']}, {conditions.get('threads', '?')} threads, load "
                 f"{float(conditions.get('loadavg', 'nan')):.2f} on {conditions.get('cores', '?')} cores")
    return said + (f"  DOUBTFUL: {peak['doubt']}" if peak["doubt"] else "")


def run(argv: list[str]) -> int:
    """``cobench doctor``: print the page (or ``--json``: the report as one JSON object); always exit 0."""
    parser = argparse.ArgumentParser(prog="cobench doctor", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.add_argument("--measure", action="store_true",
                        help="calibrate the peaks not yet in the cache, and build the codec's CPU kernels")
    parser.add_argument("overrides", nargs="*", metavar="platform.KEY=VALUE",
                        help="platform settings, as for `cobench calibrate` (e.g. platform.calibration_cache=F)")
    args = parser.parse_args(argv)
    config = None
    if args.overrides:
        wrong = [o for o in args.overrides if not o.lstrip("+").startswith(("platform.", "platform="))]
        if wrong:
            raise ValueError(f"`cobench doctor` takes platform settings only (platform=NAME, platform.KEY=VALUE), "
                             f"got {' '.join(wrong)}")
        from harness.config import compose_config, to_run_config

        config = to_run_config(compose_config(args.overrides)).platform
    report = doctor_report(measure=args.measure, platform_config=config)
    print(json.dumps(report, indent=1) if args.json else render(report))
    return EXIT_OK
