"""Benchmarks. One sub-package per workload; its ``__init__`` declares it (``workloads.base.declare``:
name, description, the module that implements it) and that module binds its classes with
``workloads.base.register``.

``discover()`` imports every sub-package's light ``__init__`` once, so adding a workload is one
folder plus one config file under ``conf/workload/``; nothing else in the project names it. A
workload's own code (and TorchRec, for some) is imported only when it is configured or built.
"""

from __future__ import annotations

import importlib
import pkgutil

from workloads.base import REGISTRY, WorkloadSpec


def discover() -> dict[str, WorkloadSpec]:
    """Import all workload packages and return the registry (name → spec)."""
    for module in pkgutil.iter_modules(__path__):
        if module.ispkg:
            importlib.import_module(f"{__name__}.{module.name}")
    return REGISTRY


__all__ = ["REGISTRY", "WorkloadSpec", "discover"]
