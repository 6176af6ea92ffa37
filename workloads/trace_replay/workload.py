"""``workload=generated``: replay a generated benchmark spec through the harness.

Each step replays one captured step (cycling through the captured steps), so the harness times,
logs and compares it like any reference workload. After the timed steps, one more pass times each
op alone for the per-op and per-category comparison, and the fidelity record is written to the
run folder as ``fidelity.json`` (an MLflow artifact, like everything there).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

from workloads.base import MLPerfInfo, RunContext, StepResult, WorkloadBase, invalid_config, register
from workloads.device import max_memory_allocated
from workloads.trace_bundle import TraceError, rank_dirs, read_meta
from workloads.trace_replay.config import GeneratedConfig
from workloads.trace_replay.fidelity import FIDELITY_FILE, compute_fidelity, nonfinite_note
from workloads.trace_replay.host_cost import Rounds
from workloads.trace_replay.memory import available_memory_bytes
from workloads.trace_replay.probe import find_crashing_ops
from workloads.trace_replay.records import SpecRecord
from workloads.trace_replay.replay import Replayer
from workloads.trace_replay.safety import check_spec
from workloads.trace_replay.spec import generate_spec, load_spec, write_spec

# What decides "same platform as the capture": a replay elsewhere is a portability run.
_PLATFORM_KEYS = ("device_type", "device_name", "num_threads", "world_size")


def _process_peak_bytes(device: torch.device) -> int:
    if device.type != "cpu":
        return max_memory_allocated(device)
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


@register("generated", GeneratedConfig)
class GeneratedWorkload(WorkloadBase):
    """Replays the ops of a captured program with synthetic tensors, and measures its fidelity."""

    throughput_unit = "iterations/s"

    def __init__(self, config: GeneratedConfig, ctx: RunContext):
        if not config.spec:
            raise invalid_config("spec", "required: the spec file from `cobench trace generate BUNDLE`")
        self.config, self.ctx = config, ctx
        if not config.calibration_s >= 0:
            raise invalid_config("calibration_s", f"{config.calibration_s} is not a number of seconds >= 0 "
                                                  f"(0: the calibrations' 24 rounds alone)")
        if config.memory_limit_mb < 0:
            raise invalid_config("memory_limit_mb",
                                 f"{config.memory_limit_mb} is negative (0: the device's available memory)")
        try:
            raw = load_spec(config.spec)
        except TraceError as err:
            raise invalid_config("spec", str(err)) from None
        ranks = len(raw["ranks"])
        if ranks > 1 and ranks != ctx.world_size:
            raise invalid_config("spec", f"{config.spec} was captured on {ranks} ranks; replay it on {ranks} "
                                 f"(torchrun --nproc-per-node {ranks}), not {ctx.world_size}")
        self.rank_index = ctx.rank if ranks > 1 else 0
        limit = int(config.memory_limit_mb * 2**20) or available_memory_bytes(ctx.device)
        try:
            checked = check_spec(raw, config.spec, trust=config.trust_spec, memory_limit_bytes=limit,
                                 rank=self.rank_index)
        except TraceError as err:
            raise invalid_config("spec", str(err)) from None
        self.spec = SpecRecord.from_json(raw)  # checked: typed from here on
        self.trusted_ops = checked.trusted_ops
        if self.trusted_ops and ctx.rank == 0:
            listed = "; ".join(f"{name}: {why}" for name, why in sorted(self.trusted_ops.items()))
            warnings.warn(f"workload.trust_spec=true: replaying {config.spec} WITH ops the replay policy refuses: "
                          f"{listed}. They can reach outside the replay's tensors.", stacklevel=2)
        self.reference_ms: list[float] | None = None
        self.reference_platform: dict[str, Any] | None = None
        self.reference_peak_bytes = 0
        if config.reference_bundle:
            try:
                dirs = rank_dirs(Path(config.reference_bundle))
                meta = read_meta(dirs[min(ctx.rank, len(dirs) - 1)])
            except TraceError as err:
                raise invalid_config("reference_bundle", str(err)) from None
            self.reference_ms = [1e3 * t for t in meta.step_times_s]
            self.reference_platform = meta.platform
            self.reference_peak_bytes = meta.peak_memory_bytes
        self.replayer: Replayer | None = None
        self.step_times_s: list[float] = []
        self.record: dict[str, Any] = {}  # the fidelity record extra_metrics() made (rank 0 also writes it)

    @classmethod
    def from_bundle(cls, bundle: Path, ctx: RunContext, **options: Any) -> GeneratedWorkload:
        """Generate the spec of a capture (``<bundle>/spec.json``, written by rank 0) and replay it."""
        spec_path = Path(bundle) / "spec.json"
        if ctx.rank == 0:
            write_spec(generate_spec(bundle), spec_path)
        if ctx.distributed:
            torch.distributed.barrier(group=ctx.process_group)
        return cls(GeneratedConfig(spec=str(spec_path), **options), ctx)

    @property
    def platform(self) -> dict[str, Any]:
        return {"device_type": self.ctx.device.type, "device_name": self.ctx.device_name,
                "num_threads": torch.get_num_threads(), "world_size": self.ctx.world_size}

    @property
    def portability(self) -> bool:
        source = self.spec.source.platform
        return any(source.get(k) != self.platform[k] for k in _PLATFORM_KEYS if k in source)

    def setup(self) -> None:
        rank_spec = self.spec.ranks[self.rank_index]
        self.replayer = Replayer(rank_spec, self.ctx.device, repeat=self.spec.repeat,
                                 process_group=self.ctx.process_group, seed=self.ctx.seed + self.ctx.rank,
                                 host_gaps=self.config.host_gaps and self.spec.full_step,
                                 trust=self.config.trust_spec, record_history=self.config.record_history)
        if self.config.probe and not self.ctx.distributed and self.ctx.device.type == "cpu":
            # a crash probe needs the ops to run alone: not with collectives, not on a shared device
            self.replayer.exclude(find_crashing_ops(self.config.spec, self.rank_index, trust=self.config.trust_spec))
        self.replayer.materialize()
        self.replayer.dry_run()
        times = self.spec.source.step_times_ms[min(self.rank_index, len(self.spec.source.step_times_ms) - 1)] \
            if self.spec.source.step_times_ms else []
        self.replayer.calibrate_host_cost(self._synchronize, Rounds(step_us=1e3 * statistics.median(times) if times
                                                                    else 0.0, budget_s=self.config.calibration_s))
        self.replayer.restore_values()  # measured steps start where the program was

    def restore_values(self) -> None:
        """The carried floating state back as it was made (see :meth:`.Replayer.restore_values`)."""
        assert self.replayer is not None, "setup() first"
        self.replayer.restore_values()

    def _synchronize(self) -> None:
        if self.ctx.device.type != "cpu":
            torch.accelerator.synchronize(self.ctx.device)

    def step(self) -> StepResult:
        assert self.replayer is not None, "setup() first"
        self.replayer.run_step()
        return StepResult(samples=1)

    def between_steps(self) -> None:
        """On the CPU, once every captured step has run, the carried state back as it was made (:meth:`.Replayer.
        restore_values`), outside the steps' timing: run again and again on the same batches, it drifts where
        the program's does not, and a CPU's kernels slow down on the subnormal floats it may sink into. On an
        accelerator the copy would drain the stream between two timed steps."""
        assert self.replayer is not None, "setup() first"
        if self.ctx.device.type == "cpu" and self.replayer.next_step == 0:
            self.replayer.restore_values()

    def observe_step_times(self, step_times_s: list[float]) -> None:
        self.step_times_s = list(step_times_s)

    def mlperf_info(self) -> MLPerfInfo:
        return MLPerfInfo(benchmark="generated", global_batch_size=self.ctx.world_size, train_samples=0,
                          eval_samples=0)

    def run_tags(self) -> dict[str, str]:
        source = self.spec.source
        platform = source.platform
        return {
            "source_workload": source.workload,
            "source_run_id": source.run_id,
            "source_platform": f"{platform.get('device_type', '?')}:{platform.get('device_name', '?')}"
                               f":{platform.get('num_threads', '?')}t:{platform.get('world_size', '?')}r",
            "portability": str(self.portability).lower(),
            "generated_spec": str(Path(self.config.spec).resolve()),
            "trusted_unsafe_ops": ",".join(sorted(self.trusted_ops)) or "none",
        }

    def extra_metrics(self) -> dict[str, float]:
        assert self.replayer is not None
        op_times: dict[int, list[float]] = {}
        if self.config.op_timing:
            op_times = self.replayer.time_ops(self._synchronize)
        record = compute_fidelity(
            self.spec, self.rank_index, self.step_times_s, op_times, self.replayer.errors,
            reference_times_ms=self.reference_ms, replay_peak_memory_bytes=_process_peak_bytes(self.ctx.device),
            replay_device_type=self.ctx.device.type, reference_peak_memory_bytes=self.reference_peak_bytes,
            reference_device_type=(self.reference_platform or {}).get("device_type"),
            portability=self.portability, host_gaps=self.replayer.host_gaps, divergent=self.replayer.divergent,
        )
        record["metrics"]["replay_static_mb"] = self.replayer.static_bytes / 2**20
        ported = [op for op in self.replayer.ops if op.ported and op.index not in self.replayer.errors]
        record["metrics"]["ops_ported"] = float(len(ported))
        record["ported_ops"] = [{"index": op.index, "name": op.name, "via": op.ported} for op in ported]
        if self.replayer.host_gaps:
            record["metrics"]["replay_host_us_per_op"] = 1e6 * self.replayer.call_s
            record["metrics"]["replay_autograd_us_per_op"] = 1e6 * self.replayer.autograd_s
            # the share of the ops that recorded autograd history in the program that record it here too
            grad_ops = self.replayer.grad_ops_per_step
            record["metrics"]["replay_recorded_history_pct"] = \
                100.0 * (1 - self.replayer.spent_grad_ops_per_step / grad_ops) if grad_ops else 0.0
            record["metrics"]["replay_outside_us_per_op"] = 1e6 * self.replayer.runner.outside_s
            for name, ran in self.replayer.calibration_rounds.items():  # calls, autograd
                record["metrics"][f"replay_{name}_calibration_rounds"] = float(ran)
            if self.replayer.gap_excess_samples_s:  # what the call cost gained between gaps over back to back
                record["metrics"]["replay_gap_excess_us_per_op"] = \
                    1e6 * statistics.median(self.replayer.gap_excess_samples_s)
                record["metrics"]["replay_gap_excess_applied_us_per_op"] = 1e6 * self.replayer.gap_excess_applied_s
            if (speed := self.replayer.runner.speed) is not None and speed.scales:
                # how much longer than at capture this host ran host work while the steps ran (median, spread)
                record["metrics"]["replay_host_speed_scale_p50"] = statistics.median(speed.scales)
                record["metrics"]["replay_host_speed_scale_min"] = min(speed.scales)
                record["metrics"]["replay_host_speed_scale_max"] = max(speed.scales)
                record["metrics"]["replay_host_speed_elasticity"] = speed.elasticity
            if overrun := self.replayer.runner.overrun_s:
                record["metrics"]["replay_host_overrun_ms_p50"] = 1e3 * statistics.median(overrun)
            ratio, why = self.replayer.op_time_ratio()
            if ratio is not None:
                record["metrics"]["replay_op_time_ratio"] = ratio
            else:
                record["op_time_ratio_unmeasured"] = why
            if self.replayer.autograd_unmeasured:
                record["autograd_unmeasured"] = self.replayer.autograd_unmeasured
            if self.replayer.runner.history_stopped:
                record["history_stopped"] = self.replayer.runner.history_stopped
        nonfinite = self.replayer.nonfinite_tensors()
        record["metrics"]["replay_nonfinite_tensors"] = float(nonfinite)
        record["nonfinite"] = nonfinite_note(nonfinite)
        record["replay_platform"] = self.platform
        self.record = record
        if self.reference_platform is not None:
            record["reference_platform"] = self.reference_platform
        if self.ctx.rank == 0 and record["unfaithful"]:
            print(f"warning: the replay is not the program: {record['unfaithful']}", file=sys.stderr)
        if self.ctx.rank == 0 and record["unrepresentative"]:
            print(f"warning: not the program's steps: {record['unrepresentative']}", file=sys.stderr)
        if self.ctx.rank == 0 and record["nonfinite"]:
            print(f"warning: {record['nonfinite']}", file=sys.stderr)
        if self.ctx.rank == 0:
            path = self.ctx.work_dir / FIDELITY_FILE
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(record, indent=2))
            os.replace(tmp, path)
        return {k: float(v) for k, v in record["metrics"].items()}
