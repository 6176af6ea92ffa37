"""The layout planner: every layout of ``devices`` ranks for a Llama config, what each needs per device, and
which fit.

A layout is ``dp_replicate × dp_shard × tp × pp`` (× ``ep`` for a mixture of experts) equal to the device
count; each candidate is checked by :func:`workloads.llama.layout.resolve_layout` (heads, layers, batch and
microbatches must divide) and the ones it refuses are set aside with its reason. For the rest,
:func:`workloads.llama.footprint.footprint` gives the bytes of the fullest pipeline stage, the pipeline
bubble and the traffic per step. A layout *fits* when its peak is at most ``(1 - headroom)`` of the device's
memory (the headroom is left to the allocator's fragmentation, the collectives' buffers and kernel
workspaces, none of which the figures count); one that fits only with activation checkpointing is marked so.

Fitting layouts are listed first: those that need no activation checkpointing (it recomputes the forward,
about a third more compute), then by pipeline bubble, then by bytes sent per device per step. Step time is
not predicted: the what-if model predicts from a captured trace of one layout, and has no model of tensor or
pipeline parallel collectives yet.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from workloads.llama.config import LlamaConfig
from workloads.llama.footprint import Footprint, MetaModel, footprint
from workloads.llama.layout import Layout, resolve_layout

GB = 1e9
DEFAULT_HEADROOM = 0.10
COMPUTE_BYTES = {"float32": 4, "bfloat16": 2}


@dataclass(frozen=True)
class Candidate:
    """A layout the model and batch allow, with its footprint and whether it fits."""

    layout: Layout
    footprint: Footprint
    fits: bool  # without activation checkpointing
    fits_with_ac: bool

    @property
    def verdict(self) -> str:
        return "yes" if self.fits else "with AC" if self.fits_with_ac else "no"

    def to_json(self) -> dict[str, Any]:
        layout = {k: getattr(self.layout, k) for k in ("dp_replicate", "dp_shard", "tp", "pp", "ep",
                                                       "pp_schedule", "pp_microbatches", "sequence_parallel")}
        return {"layout": layout, "describe": self.layout.describe(), "fits": self.fits,
                "fits_with_activation_checkpointing": self.fits_with_ac,
                "bytes_per_device": {k: v for k, v in asdict(self.footprint).items() if k != "bubble"},
                "bubble": self.footprint.bubble}


@dataclass
class LayoutPlan:
    """Every layout of ``devices`` ranks: ``candidates`` (sorted, fitting first) and ``excluded`` (layout →
    why :func:`~workloads.llama.layout.resolve_layout` refused it)."""

    preset: str
    devices: int
    device_memory_bytes: float
    memory_source: str  # where the device memory figure came from
    headroom: float
    dtype: str
    batch_size: int
    seq_len: int
    total_params: int
    candidates: list[Candidate] = field(default_factory=list)
    excluded: dict[str, str] = field(default_factory=dict)

    @property
    def usable_bytes(self) -> float:
        return self.device_memory_bytes * (1 - self.headroom)

    @property
    def fitting(self) -> list[Candidate]:
        return [c for c in self.candidates if c.fits or c.fits_with_ac]

    def to_json(self) -> dict[str, Any]:
        return {"preset": self.preset, "devices": self.devices, "device_memory_bytes": self.device_memory_bytes,
                "memory_source": self.memory_source, "headroom": self.headroom, "usable_bytes": self.usable_bytes,
                "dtype": self.dtype, "batch_size": self.batch_size, "seq_len": self.seq_len,
                "total_params": self.total_params, "step_time": "not predicted",
                "candidates": [c.to_json() for c in self.candidates], "excluded": self.excluded}

    def format(self, top: int = 15, verbose: bool = False) -> str:
        """The plan as plain text: a header, the fitting layouts (``top`` of them), the closest ones that do not
        fit, and with ``verbose`` every layout set aside and why."""
        size = max((c.footprint.peak for c in self.candidates), default=GB)
        unit, scale = next((u, v) for u, v in (("GB", GB), ("MB", 1e6), ("kB", 1e3))
                           if size >= v or u == "kB")
        params = (f"{self.total_params / 1e9:.2f} B" if self.total_params >= 1e9 else f"{self.total_params:,}")
        lines = [
            f"{self.preset}: {params} parameters, batch {self.batch_size} × seq {self.seq_len}"
            f", {self.dtype} activations (parameters, gradients and AdamW state float32)",
            f"{self.devices} devices × {self.device_memory_bytes / GB:.1f} GB ({self.memory_source}); "
            f"a layout fits in {self.usable_bytes / GB:.1f} GB, leaving {self.headroom:.0%} to the allocator, "
            "collective buffers and workspaces",
            f"{len(self.candidates)} layouts possible, {sum(c.fits for c in self.candidates)} fit, "
            f"{sum(c.fits_with_ac and not c.fits for c in self.candidates)} more with activation checkpointing (AC)"
            f"; {len(self.excluded)} set aside (--verbose: why); step time: not predicted",
        ]
        fitting = self.fitting
        if fitting:
            lines += ["", f"fitting layouts ({unit} per device; comm: {unit} sent per device per step):",
                      *_table(fitting[:top], scale)]
            if len(fitting) > top:
                lines.append(f"... and {len(fitting) - top} more (--top N)")
        closest = sorted((c for c in self.candidates if not c.fits_with_ac), key=lambda c: c.footprint.peak_ac)[:3]
        if closest:
            lines += ["", "closest layouts that do not fit:", *_table(closest, scale)]
            lines += [f"  {c.layout.describe()}: {_why_not(c, self.usable_bytes)}" for c in closest]
        if verbose and self.excluded:
            lines += ["", "set aside:", *(f"  {name}: {why}" for name, why in self.excluded.items())]
        return "\n".join(lines)


COLUMNS = ("layout", "params", "grads", "optim", "unshard", "act", "act AC", "peak", "peak AC", "fits", "bubble",
           "comm tp", "comm pp", "comm dp")


def _table(rows: list[Candidate], scale: float) -> list[str]:
    """The rows' figures; a ``comm ep`` column where any layout splits experts over ``ep``."""
    with_ep = any(c.layout.ep > 1 for c in rows)
    cells = [COLUMNS + (("comm ep",) if with_ep else ())]
    for c in rows:
        f = c.footprint
        comm = (f.comm_tp, f.comm_pp, f.comm_dp) + ((f.comm_ep,) if with_ep else ())
        cells.append((c.layout.describe(), *(f"{v / scale:.1f}" for v in (
            f.params, f.grads, f.optimizer, f.unsharded, f.activations, f.activations_ac, f.peak, f.peak_ac)),
            c.verdict, f"{f.bubble:.0%}", *(f"{v / scale:.2f}" for v in comm)))
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    return ["  " + "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in
                             enumerate(zip(row, widths, strict=True))) for row in cells]


def _why_not(c: Candidate, usable: float) -> str:
    f = c.footprint
    static = f.params + f.grads + f.optimizer + f.buffers
    return (f"peak {f.peak_ac / GB:.1f} GB with AC ({f.peak / GB:.1f} without) > {usable / GB:.1f} GB usable: "
            f"parameters, gradients and optimizer {static / GB:.1f}, unsharded by FSDP {f.unsharded / GB:.1f}, "
            f"activations {f.activations_ac / GB:.1f} with AC (stage {f.stage})")


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def plan_layouts(config: LlamaConfig, devices: int, device_memory_bytes: float, memory_source: str,
                 dtype: str = "bfloat16", headroom: float = DEFAULT_HEADROOM,
                 device_kind: str = "accelerator") -> LayoutPlan:
    """Every ``dp_replicate × dp_shard × tp × pp`` (× ep) layout of ``devices`` for ``config`` (its preset, batch,
    sequence length, gradient accumulation and ``workload.parallel`` schedule settings), sorted (module doc).

    ``dtype`` is the activations' (``float32``, or ``bfloat16`` autocast); ``device_kind`` (``cpu`` or
    ``accelerator``) sets the loss's chunk size. Raises ValueError for a bad device count or memory figure."""
    if devices < 1:
        raise ValueError(f"invalid config 'platform.devices': got {devices}, must be >= 1")
    if not device_memory_bytes > 0:
        raise ValueError(f"invalid config 'platform.device_memory_gb': got {device_memory_bytes / GB}, must be > 0")
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom must be in [0, 1), got {headroom}")
    args = config.model_args()
    model = MetaModel.build(args)
    plan = LayoutPlan(config.preset, devices, device_memory_bytes, memory_source, headroom, dtype, config.batch_size,
                      config.seq_len, model.total_params())
    experts = _divisors(args.n_routed_experts) if args.n_routed_experts else [1]
    sizes = _divisors(devices)
    for tp, pp, replicate, ep in itertools.product(sizes, sizes, sizes, experts):
        if devices % (tp * pp * replicate):
            continue
        parallel = replace(config.parallel, dp_replicate=replicate, dp_shard=devices // (tp * pp * replicate),
                           tp=tp, pp=pp, ep=ep)
        name = f"dp_replicate {replicate} × dp_shard {parallel.dp_shard} × tp {tp} × pp {pp}" + (
            f" × ep {ep}" if args.n_routed_experts else "")
        try:
            layout = resolve_layout(parallel, devices, args, config.batch_size, config.seq_len, config.grad_accum_steps)
        except ValueError as err:
            plan.excluded[name] = str(err).removeprefix("invalid config ")
            continue
        local = config.batch_size // layout.dp
        if layout.pp == 1 and local % config.grad_accum_steps:  # the workload's own check
            plan.excluded[name] = (f"'grad_accum_steps': the per-rank batch {local} is not divisible by "
                                   f"{config.grad_accum_steps}")
            continue
        foot = footprint(model, layout, config.batch_size, config.seq_len, COMPUTE_BYTES[dtype],
                         config.grad_accum_steps, device_kind)
        plan.candidates.append(Candidate(layout, foot, foot.peak <= plan.usable_bytes,
                                         foot.peak_ac <= plan.usable_bytes))
    plan.candidates.sort(key=lambda c: (not c.fits, not c.fits_with_ac, c.footprint.bubble,
                                        c.footprint.comm_tp + c.footprint.comm_pp + c.footprint.comm_dp
                                        + c.footprint.comm_ep))
    return plan


def plan(config: LlamaConfig, devices: int, device_memory_bytes: float, memory_source: str,
         on_cpu: bool) -> LayoutPlan:
    """``cobench plan workload=llama``'s entry (:class:`workloads.base.PlannerSpec`): the activations' dtype is
    ``workload.dtype``, its ``auto`` being float32 on CPUs and bfloat16 autocast on accelerators, as a run's."""
    dtype = config.dtype if config.dtype != "auto" else "float32" if on_cpu else "bfloat16"
    return plan_layouts(config, devices, device_memory_bytes, memory_source, dtype,
                        device_kind="cpu" if on_cpu else "accelerator")


__all__ = ["DEFAULT_HEADROOM", "Candidate", "LayoutPlan", "plan", "plan_layouts"]
