"""The environment fingerprint stored with every run: enough to tell two runs' setups apart."""

from __future__ import annotations

import importlib.metadata
import os
import platform as pyplatform
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import torch

from harness.distributed import node_count
from harness.platform import Platform, cpu_model_name

LIBRARIES = (
    "torch", "numpy", "hydra-core", "omegaconf", "mlflow", "mlperf-logging",
    "torchrec", "fbgemm-gpu", "fbgemm-gpu-cpu", "transformers",
)
PROJECT_ROOT = Path(__file__).resolve().parent.parent


def git_state(root: Path = PROJECT_ROOT) -> tuple[str, bool]:
    """(commit SHA, dirty flag) of the project checkout; ("unknown", False) outside git."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root, capture_output=True, text=True, timeout=10, check=True,
        ).stdout
        return sha, bool(status.strip())
    except (OSError, subprocess.SubprocessError):
        return "unknown", False


def library_versions() -> dict[str, str]:
    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def accelerator_info(platform: Platform) -> dict[str, Any]:
    if not platform.is_accelerator:
        return {}
    info: dict[str, Any] = {"device_count": torch.accelerator.device_count()}
    if platform.device.type == "cuda":
        props = torch.cuda.get_device_properties(platform.device)
        info.update(
            cuda_runtime=torch.version.cuda,
            hip_runtime=torch.version.hip,
            compute_capability=f"{props.major}.{props.minor}",
            total_memory_gb=round(props.total_memory / 2**30, 1),
            multiprocessors=props.multi_processor_count,
        )
        try:
            driver = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=10, check=True,
            )
            info["driver"] = driver.stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError, IndexError):
            info["driver"] = "unknown"  # ROCm, or no nvidia-smi on PATH
    return info


def environment_fingerprint(platform: Platform, config_hash: str, world_size: int) -> dict[str, Any]:
    sha, dirty = git_state()
    return {
        "host": socket.gethostname(),
        "os": pyplatform.platform(),
        "python": sys.version.split()[0],
        "cpu": cpu_model_name(),
        "cpu_count": os.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "torch_threads": torch.get_num_threads(),
        "host_allocator": platform.host_allocator,
        "device": str(platform.device),
        "device_name": platform.device_name,
        "platform": platform.name,
        "platform_fingerprint": platform.fingerprint(),
        "accelerator": accelerator_info(platform),
        "world_size": world_size,
        "nodes": node_count(),
        "ranks_per_node": world_size // node_count(),
        "libraries": library_versions(),
        "git_sha": sha,
        "git_dirty": dirty,
        "config_hash": config_hash,
    }
