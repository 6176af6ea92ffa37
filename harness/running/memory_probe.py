"""The tensor memory one training step of a workload holds at its peak, measured, per rank.

A layout planner predicts what a device must hold (parameters, gradients, optimizer state, activations);
this measures it on the workload's own step, in whatever layout its config names, so the prediction can be
checked (``tests/test_plan.py``). It counts tensors, not processes: PyTorch's
``torch.distributed._tools.mem_tracker.MemTracker`` (a ``TorchDispatchMode``) sees every tensor an op
creates and frees it when its storage dies, and is told about the tensors that exist before the step — the
model's parameters and buffers (:meth:`~workloads.base.WorkloadBase.root_module`) and the optimizer's state
(the workload's ``optimizer`` attribute, where it keeps one). The peak is the largest sum of live storages'
bytes on the device over the step (each rounded up to 512 bytes on CUDA, its caching allocator's granule;
exact elsewhere), split into MemTracker's categories: ``Parameter``, ``Buffer``, ``Gradient``, ``Activation``
(what a module's forward made, including what autograd saves and the forward's temporaries), ``Temp``
(the backward's temporaries), ``Optstate`` and ``Other``. Not counted: what collectives' backends or
kernels allocate outside PyTorch's tensors (gloo's and NCCL's buffers, oneDNN scratch), the allocator's
fragmentation, and the interpreter.

One warm step runs first, untracked, so the optimizer's state exists (the steady state a long run is in);
then ``steps`` steps are tracked and the largest peak is kept. Under ``torchrun`` every rank measures its
own; :func:`measure_step_memory` returns them all, in rank order.

    torchrun --nproc-per-node 2 -m harness.running.memory_probe workload=llama workload.parallelism=fsdp2
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from harness.config import CobenchConfig, compose_config, to_run_config
from harness.distributed import env_dist_info, exit_rank, gather_to_all, shutdown_distributed
from harness.running.runner import set_up_workload


def _tracker() -> Any:
    """A MemTracker that lets a module run its forward more than once a step (gradient accumulation, a pipeline's
    microbatches): MemTracker keeps per-module figures for one call each and refuses a second, before it has
    changed anything; the device's peak, all this probe reads, is kept by its dispatch mode either way."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class RepeatedCalls(MemTracker):
        def _pre_fw_hook(self, module: Any, inputs: Any) -> None:
            try:
                super()._pre_fw_hook(module, inputs)
            except NotImplementedError:
                pass

    return RepeatedCalls()


@dataclass
class StepMemory:
    """One rank's peak of live tensor bytes over the tracked steps, and what held them then."""

    rank: int
    world_size: int
    device: str
    peak_bytes: int
    by_category: dict[str, int]  # MemTracker's categories at the peak (Parameter, Activation, Optstate, ...)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def measure_step_memory(cfg: CobenchConfig, work_dir: Path, steps: int = 1) -> list[StepMemory]:
    """Set up the workload ``cfg`` names (in this process group, when there is one), run one warm step, then
    track ``steps`` more; every rank calls it and gets every rank's :class:`StepMemory`."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    with set_up_workload(cfg, work_dir) as opened:
        workload = opened.workload
        workload.step()  # the optimizer's state now exists
        model = workload.root_module()
        external = [m for m in (model, getattr(workload, "optimizer", None)) if m is not None]
        tracker = _tracker()
        tracker.track_external(*external)
        peak: dict[str, int] = {}
        with tracker:
            for _ in range(steps):
                workload.step()
        for device, categories in tracker.get_tracker_snapshot("peak").items():
            if str(device) == str(opened.ctx.device) or not peak:
                peak = {str(getattr(k, "value", k)): int(v) for k, v in categories.items()}
    total = peak.pop("Total", sum(peak.values()))
    mine = StepMemory(opened.ctx.rank, opened.ctx.world_size, str(opened.ctx.device), total, peak)
    return gather_to_all(mine) if opened.dist.enabled else [mine]


def main(argv: list[str] | None = None) -> int:
    """``python -m harness.running.memory_probe [--steps N] OVERRIDES``: rank 0 prints every rank's peak as JSON."""
    import tempfile

    args = sys.argv[1:] if argv is None else argv
    steps = 1
    if "--steps" in args:
        at = args.index("--steps")
        steps, args = int(args[at + 1]), args[:at] + args[at + 2:]
    cfg = to_run_config(compose_config(["tracking=off", *args]))
    with tempfile.TemporaryDirectory(prefix="cobench-memory-") as tmp:
        measured = measure_step_memory(cfg, Path(tmp), steps)
    if env_dist_info().is_main:
        print(json.dumps([m.to_json() for m in measured]))
    shutdown_distributed()
    return 0


if __name__ == "__main__":
    exit_rank(main())
