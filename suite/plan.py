"""``cobench plan [--json] [--top N] [--verbose] OVERRIDES``: which parallel layouts of a workload fit a machine.

The overrides are composed like a run's (``workload=llama workload.preset=llama3_405b workload.seq_len=8192
platform.devices=512 platform.device_memory_gb=80``); the workload's own planner (declared by its package,
:class:`workloads.base.PlannerSpec`) enumerates the layouts, from the model built on the meta device: nothing
is allocated and no process group is made. ``platform.devices`` left out: the devices here (the accelerators
this host has, else 1); ``platform.device_memory_gb`` left out: the current accelerator's memory, else the
host's RAM, and the output says which.

Exit codes: 0 when at least one layout fits (with or without activation checkpointing); 1 when layouts are
possible but none fits the memory (the closest are printed, with what they would need); 2 for bad input — an
invalid override, a device count below 1, a workload without a planner, or no layout the model and batch allow
on that many devices (why each was refused is printed).
"""

from __future__ import annotations

import argparse
import importlib
import json

from harness.cli import EXIT_OK, CommandFailed

GB = 1e9


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cobench plan", description="List the parallel layouts (data, FSDP, tensor, pipeline, expert) of "
        "platform.devices devices that fit platform.device_memory_gb each, with memory, pipeline bubble and "
        "traffic per device (docs/parallelism.md).")
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. workload=llama "
                        "workload.preset=llama3_8b platform.devices=8 platform.device_memory_gb=80")
    parser.add_argument("--json", action="store_true", help="print the whole plan as JSON")
    parser.add_argument("--top", type=int, default=15, help="fitting layouts shown (default 15)")
    parser.add_argument("--verbose", action="store_true", help="also list the layouts set aside, and why")
    return parser


def local_devices() -> tuple[int, float, str, bool]:
    """The devices here: (count, one device's memory in bytes, where that figure came from, whether a CPU)."""
    import psutil
    import torch

    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if accelerator is None:
        return 1, float(psutil.virtual_memory().total), "this host's RAM", True
    index = torch.accelerator.current_device_index()
    total = torch.accelerator.get_memory_info(index)[1]  # (free, total) bytes
    return torch.accelerator.device_count(), float(total), f"{accelerator.type}:{index}'s memory", False


def run(argv: list[str]) -> int:
    from harness.config import compose_config, to_run_config
    from workloads import discover
    from workloads.base import PLANNERS

    args = _parser().parse_args(argv)
    if args.top < 1:
        raise ValueError(f"--top must be >= 1, got {args.top}")
    cfg = to_run_config(compose_config(["tracking=off", *args.overrides]))
    discover()  # each workload package declares its planner when imported
    name = cfg.workload.name
    if name not in PLANNERS:
        raise ValueError(f"workload {name} has no layout planner; `cobench plan` plans "
                         f"{', '.join(sorted(PLANNERS)) or 'none'}")
    count, memory, source, on_cpu = local_devices()
    if cfg.platform.device == "cpu":
        on_cpu = True
    devices = cfg.platform.devices or count
    if cfg.platform.device_memory_gb is not None:
        memory, source = cfg.platform.device_memory_gb * GB, "platform.device_memory_gb"
        on_cpu = cfg.platform.device == "cpu"
    planner = importlib.import_module(PLANNERS[name].module)
    plan = planner.plan(cfg.workload, devices, memory, source, on_cpu)
    if not plan.candidates:
        reasons = "\n".join(f"  {layout}: {why}" for layout, why in plan.excluded.items())
        raise ValueError(f"no layout of {devices} devices suits this model and batch; each was refused:\n{reasons}")
    print(json.dumps(plan.to_json(), indent=1) if args.json else plan.format(args.top, args.verbose))
    if not plan.fitting:
        raise CommandFailed(f"no layout of {devices} devices fits {memory / GB:.1f} GB per device (closest above)")
    return EXIT_OK
