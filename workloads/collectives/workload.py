"""``workload=collectives``: one collective swept over message sizes, nccl-tests style.

One run measures one collective in one dtype (its MLflow run is tagged ``collective``), so runs of
the same collective line up across platforms in ``cobench compare`` by config hash;
``conf/suite/collectives.yaml`` runs them all. How it fits the step-based runner: one harness step
is one pass over the size sweep; at each size the ranks meet at a barrier, then
``ops_per_sample`` back-to-back operations are timed (device-synchronised) and divided. Steps the
harness counts as warm-up (``skip_steps``) are not in the statistics; every step's results are
checked outside the timed window. A sample's time is the slowest rank's (a collective is done when
its last rank is), so p50/p99 are the job's.

Process-group start-up: the sweep runs on a fresh group of all ranks (same backend as the world's),
whose creation plus a first barrier through it is timed at set-up (``pg_startup_s``; NCCL builds
its communicator lazily, so the barrier is part of it).
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist

from workloads.base import MLPerfInfo, RunContext, StepResult, WorkloadBase, invalid_config, register, unsupported
from workloads.collectives.config import CollectivesConfig
from workloads.collectives.ops import DTYPES, Buffers, bus_factor, make_buffers, sweep_sizes
from workloads.collectives.table import SweepRow, write_sweep_table


@register("collectives", CollectivesConfig)
class CollectivesWorkload(WorkloadBase):
    """One collective over a size sweep; bandwidths with nccl-tests' bus factors."""

    throughput_unit = "ops/s"

    def __init__(self, config: CollectivesConfig, ctx: RunContext):
        if not ctx.distributed:
            raise unsupported("collective", "a collective needs at least 2 ranks; launch with "
                              "`torchrun --nproc-per-node 2 -m suite.cli run workload=collectives ...`")
        if not 0 <= config.root < ctx.world_size:
            raise invalid_config("root", f"got {config.root}, must be a rank in [0, {ctx.world_size - 1}]")
        self.config, self.ctx = config, ctx
        self.dtype = DTYPES[config.dtype]
        self.sizes = sweep_sizes(config.min_bytes, config.max_bytes, config.factor)
        self.compute_dtype = self.dtype if self.dtype.is_floating_point else torch.float32
        self._steps = 0

    def setup(self) -> None:
        cfg, ctx = self.config, self.ctx
        backend = dist.get_backend(ctx.process_group)
        dist.barrier(group=ctx.process_group)
        start = time.perf_counter()
        self.group = dist.new_group(ranks=list(range(ctx.world_size)), backend=backend)
        dist.barrier(group=self.group, **({"device_ids": [ctx.device.index or 0]} if backend == "nccl" else {}))
        self.pg_startup_s = time.perf_counter() - start
        self.backend = backend
        self.buffers: list[Buffers] = []
        self.moved_bytes: list[int] = []
        for size in self.sizes:
            buffers, moved = make_buffers(cfg.collective, size, self.dtype, self.group, ctx.device, root=cfg.root,
                                          moe_row_elems=cfg.moe_row_elems, moe_skew=cfg.moe_skew, seed=ctx.seed)
            self.buffers.append(buffers)
            self.moved_bytes.append(moved)
        self.samples_s: list[list[float]] = [[] for _ in self.sizes]  # this rank's, per size

    def _synchronize(self) -> None:
        if self.ctx.is_accelerator:
            torch.accelerator.synchronize(self.ctx.device)

    def step(self) -> StepResult:
        n = self.config.ops_per_sample
        for i, buffers in enumerate(self.buffers):
            buffers.reset()
            self._synchronize()
            dist.barrier(group=self.group)
            start = time.perf_counter()
            for _ in range(n):
                buffers.run()
            self._synchronize()
            elapsed = (time.perf_counter() - start) / n
            if self._steps >= self.config.skip_steps:
                self.samples_s[i].append(elapsed)
            if self.config.check:
                if n > 1:  # a reduction applied n times in place: check one fresh operation
                    buffers.reset()
                    buffers.run()
                    self._synchronize()
                buffers.check()
        self._steps += 1
        return StepResult(samples=n * len(self.buffers))

    def _rows(self) -> list[SweepRow]:
        """Every rank's samples, the slowest rank's per sample, into one row per size."""
        # on the run's device: nccl (and xccl, hccl) gather no CPU tensors
        mine = torch.tensor(self.samples_s, dtype=torch.float64, device=self.ctx.device)
        gathered = [torch.empty_like(mine) for _ in range(self.ctx.world_size)]
        dist.all_gather(gathered, mine, group=self.group)
        slowest = torch.stack(gathered).amax(dim=0).cpu().numpy()  # size × sample
        factor = bus_factor(self.config.collective, self.ctx.world_size)
        rows = []
        for size_bytes, samples in zip(self.moved_bytes, slowest, strict=True):
            p50, p99 = (float(np.percentile(samples, q)) for q in (50, 99))
            algbw = size_bytes / p50 / 1e9
            rows.append(SweepRow(self.config.collective, self.ctx.world_size, self.backend, self.ctx.device.type,
                                 self.config.dtype, size_bytes, p50 * 1e6, p99 * 1e6, algbw, algbw * factor,
                                 len(samples)))
        return rows

    def extra_metrics(self) -> dict[str, float]:
        if not self.samples_s[0]:
            raise ValueError(f"invalid config 'workload.skip_steps': {self.config.skip_steps} skips every step "
                             f"that ran ({self._steps}); run more steps or skip fewer")
        rows = self._rows()
        largest, smallest = rows[-1], rows[0]
        if self.ctx.rank == 0:
            stem = self.ctx.work_dir / f"collectives_{self.config.collective}"
            if not stem.with_suffix(".json").exists():  # repetition 0's sweep, as its metrics are
                write_sweep_table(rows, stem, {"device_name": self.ctx.device_name, "pg_startup_s": self.pg_startup_s,
                                               "ops_per_sample": self.config.ops_per_sample,
                                               "moe_skew": self.config.moe_skew})
        return {
            "busbw_gbps": largest.busbw_gbps,
            "algbw_gbps": largest.algbw_gbps,
            "largest_bytes": float(largest.bytes),
            "time_us_p50_largest": largest.time_us_p50,
            "time_us_p99_largest": largest.time_us_p99,
            "latency_us_p50": smallest.time_us_p50,
            "latency_us_p99": smallest.time_us_p99,
            "smallest_bytes": float(smallest.bytes),
            "busbw_gbps_peak": max(r.busbw_gbps for r in rows),
            "pg_startup_s": self.pg_startup_s,
        }

    def run_tags(self) -> dict[str, str]:
        return {"collective": self.config.collective, "dtype": self.config.dtype}

    def mlperf_info(self) -> MLPerfInfo:
        per_step = self.config.ops_per_sample * len(self.sizes)
        return MLPerfInfo("collectives", global_batch_size=per_step, train_samples=per_step, eval_samples=0)

    def teardown(self) -> None:
        group = getattr(self, "group", None)
        if group is not None:
            dist.destroy_process_group(group)
            self.group = None
