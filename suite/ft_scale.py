"""``cobench ft-scale``: effective training time vs cluster size, on paper (runs no model).

Effective training time (ETT) is useful training time ÷ wall time. Failures arrive at
``Λ = N · λ`` per hour of training for a job of ``N`` GPUs with ``λ`` failures per GPU-hour; each
failure costs the job an expected amount of time, counted first-order (failures per hour of useful
training, their costs added)::

    synchronous (whole-job restart from the last checkpoint):
        cost_sync = stall_sync + C / 2          stall_sync: detect + restart every rank + reload
                                                C / 2: work since the last checkpoint, redone on average
        ETT_sync  = (1 − w / C) / (1 + Λ · cost_sync)     w: a blocking checkpoint write (0: async)

    replica-level (FT-HSDP; torchft): R = N / g replica groups of g GPUs
        cost_ft   = stall_ft + recovery_replica / R
                    stall_ft: every replica waits until the dead one is noticed and a new quorum forms;
                    recovery_replica / R: the failed replica's share of the job is idle while it
                    restarts and heals from its peers (the survivors go on); nothing is redone
        ETT_ft    = 1 / (1 + Λ · cost_ft)      (fewer than 2 replica groups: ETT_sync, no peer to heal from)

Two failures overlapping, a failure during a restart and whole-job failures under FT (the lighthouse,
every replica at once) are left out: the model is good while ``Λ · cost`` stays below ~1.

Where the inputs come from (every table says it per input):

- published: ``stall_sync`` 10 min and ``stall_ft`` 3 min at O(100k) GPUs (FT-HSDP, arXiv 2602.00277,
  abstract); ``λ`` 1.97e-5 per GPU-hour (Llama 3: 419 unexpected interruptions in 54 days on 16,384
  GPUs, The Llama 3 Herd of Models §3.3.4).
- what the seed's 44 % → 80 % at 100k needs (:func:`inputs_for_targets`, the command's default): with
  those stalls and 1024-GPU replicas restarting in 10 min, ``λ ≈ 4.8e-5`` per GPU-hour (a failure
  every 12.4 min at 100k GPUs, 2.5× Llama 3's rate) and a checkpoint interval ``C ≈ 11.6 min``.
  With Llama 3's ``λ`` and 30-min checkpoints (``--llama3-rate``) the same stalls give 55 % vs 91 %.
  Any of ``--llama3-rate``, ``--failures-per-gpu-hour``, ``--checkpoint-interval-s`` or
  ``--measured`` turns the fit off: the table then shows those inputs as they are.
- measured (``--measured``): the torchft failure scenario's ``stall_s`` → ``stall_ft``,
  ``recovery_s`` → ``recovery_replica``, and the same failure without torchft's
  ``restart_s`` → ``stall_sync``. Measured on a small model on this machine they are lower bounds
  of what a 100k-GPU job pays (no scheduler, no thousands of hosts to restart), so the table
  labels them.
"""

from __future__ import annotations

import argparse
import csv
import json
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from harness.cli import EXIT_OK

LLAMA3_FAILURES_PER_GPU_HOUR = 419 / (54 * 24 * 16384)  # ≈ 1.97e-5
DEFAULT_SIZES = (1_000, 2_000, 4_000, 8_000, 16_000, 32_000, 64_000, 100_000)
SEED_TARGETS = (0.44, 0.80)  # FT-HSDP at O(100k) GPUs: synchronous vs replica-level recovery


@dataclass(frozen=True)
class ScaleInputs:
    """The model's inputs (seconds, failures per GPU-hour); ``sources`` says where each came from."""

    failures_per_gpu_hour: float = LLAMA3_FAILURES_PER_GPU_HOUR
    stall_sync_s: float = 600.0
    checkpoint_interval_s: float = 1800.0
    checkpoint_write_s: float = 0.0  # blocking part of a checkpoint write; 0 with async checkpointing
    stall_ft_s: float = 180.0
    recovery_replica_s: float = 600.0  # a replica's restart + heal, off the survivors' critical path
    gpus_per_replica: int = 1024
    sources: dict[str, str] = field(default_factory=lambda: {
        "failures_per_gpu_hour": "published: Llama 3, 419 unexpected interruptions / 54 days / 16,384 GPUs",
        "stall_sync_s": "published: FT-HSDP (arXiv 2602.00277), synchronous stall 10 min at O(100k)",
        "checkpoint_interval_s": "assumed: a checkpoint every 30 min",
        "checkpoint_write_s": "assumed: asynchronous checkpointing (no blocking write)",
        "stall_ft_s": "published: FT-HSDP (arXiv 2602.00277), replica-level stall 3 min at O(100k)",
        "recovery_replica_s": "assumed: a replica restarts like a whole job (stall_sync_s)",
        "gpus_per_replica": "assumed: 1024 GPUs per replica group",
    })

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "sources" and not value >= 0:
                raise ValueError(f"ft-scale input {f.name}: got {value}, must be >= 0")
        if self.checkpoint_interval_s <= 0 or self.gpus_per_replica < 1:
            raise ValueError("ft-scale: checkpoint_interval_s must be > 0 and gpus_per_replica >= 1")

    def with_source(self, source: str, **values: float) -> ScaleInputs:
        """These inputs with ``values`` replaced, each labelled ``source``."""
        return replace(self, **values, sources={**self.sources, **{k: source for k in values}})


@dataclass(frozen=True)
class ScalePoint:
    gpus: int
    failures_per_hour: float
    mtbf_min: float
    ett_sync_pct: float
    ett_ft_pct: float
    cost_sync_min: float  # job time lost per failure
    cost_ft_min: float


def ett_sync(inputs: ScaleInputs, gpus: int) -> float:
    """Effective training time (fraction) with whole-job restarts from the last checkpoint."""
    rate_per_s = gpus * inputs.failures_per_gpu_hour / 3600
    cost = inputs.stall_sync_s + inputs.checkpoint_interval_s / 2
    return (1 - inputs.checkpoint_write_s / inputs.checkpoint_interval_s) / (1 + rate_per_s * cost)


def ett_ft(inputs: ScaleInputs, gpus: int) -> float:
    """Effective training time (fraction) with replica-level recovery (FT-HSDP, torchft); a job of
    fewer than two replica groups has no peer to heal from: it restarts like a synchronous one."""
    rate_per_s = gpus * inputs.failures_per_gpu_hour / 3600
    replicas = gpus / inputs.gpus_per_replica
    if replicas < 2:
        return ett_sync(inputs, gpus)
    return 1 / (1 + rate_per_s * (inputs.stall_ft_s + inputs.recovery_replica_s / replicas))


def scale_table(inputs: ScaleInputs, sizes: tuple[int, ...] = DEFAULT_SIZES) -> list[ScalePoint]:
    rows = []
    for gpus in sizes:
        rate = gpus * inputs.failures_per_gpu_hour
        replicas = gpus / inputs.gpus_per_replica
        cost_sync = inputs.stall_sync_s + inputs.checkpoint_interval_s / 2
        cost_ft = inputs.stall_ft_s + inputs.recovery_replica_s / replicas if replicas >= 2 else cost_sync
        rows.append(ScalePoint(gpus, rate, 60 / rate if rate else float("inf"), 100 * ett_sync(inputs, gpus),
                               100 * ett_ft(inputs, gpus), cost_sync / 60, cost_ft / 60))
    return rows


def inputs_for_targets(base: ScaleInputs, gpus: int = 100_000, targets: tuple[float, float] = SEED_TARGETS
                       ) -> ScaleInputs:
    """The failure rate and checkpoint interval that make ``base``'s stalls give ``targets`` (ETT sync,
    ETT ft) at ``gpus``: the rate from the FT side, then the interval from the synchronous side."""
    target_sync, target_ft = targets
    replicas = max(1.0, gpus / base.gpus_per_replica)
    rate_per_s = (1 / target_ft - 1) / (base.stall_ft_s + base.recovery_replica_s / replicas)
    keep = 1 - base.checkpoint_write_s / base.checkpoint_interval_s
    cost_sync = (keep / target_sync - 1) / rate_per_s
    interval = 2 * (cost_sync - base.stall_sync_s)
    if interval <= 0:
        raise ValueError(f"no checkpoint interval reaches ETT {target_sync:.0%}: the synchronous stall alone "
                         f"({base.stall_sync_s:.0f} s) already costs more; lower stall_sync_s")
    fitted = f"fitted: what ETT {target_sync:.0%}/{target_ft:.0%} at {gpus} GPUs needs (inputs_for_targets)"
    return base.with_source(fitted, failures_per_gpu_hour=rate_per_s * 3600 / gpus, checkpoint_interval_s=interval)


def measured_inputs(base: ScaleInputs, paths: list[Path]) -> ScaleInputs:
    """``base`` with what failure-scenario runs measured (their ``metrics.json``): ``stall_s`` and
    ``recovery_s`` of a torchft run, ``restart_s`` of a run without it."""
    inputs = base
    for path in paths:
        record = json.loads(Path(path).read_text())
        metrics = record.get("metrics", record)
        found = {}
        if "recovery_s" in metrics and "stall_s" in metrics:
            found.update(stall_ft_s=metrics["stall_s"], recovery_replica_s=metrics["recovery_s"])
        if "baseline_restart_s" in metrics:
            found.update(stall_sync_s=metrics["baseline_restart_s"])
        if not found:
            raise ValueError(f"{path}: no failure-scenario figures (stall_s, recovery_s, baseline_restart_s); "
                             f"pass the metrics.json of a `cobench run ... ft=torchft` run")
        inputs = inputs.with_source(f"measured: {path} (small model, this machine: a lower bound at scale)",
                                    **found)
    return inputs


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cobench ft-scale", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in fields(ScaleInputs):
        if f.name != "sources":
            parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=None,
                                help=f"(default {f.default})")
    parser.add_argument("--llama3-rate", action="store_true",
                        help=f"Llama 3's published failure rate ({LLAMA3_FAILURES_PER_GPU_HOUR:.3g} per GPU-hour) "
                             "and 30-min checkpoints, instead of fitting the seed's 44 %% / 80 %% at 100k GPUs")
    parser.add_argument("--measured", type=Path, action="append", default=[],
                        help="metrics.json of a failure-scenario run: its figures replace the defaults")
    parser.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="GPU counts, comma-separated")
    parser.add_argument("--out", type=Path, help="write ft_scale.csv and ft_scale.json here")
    return parser


def run(argv: list[str]) -> int:
    ns = _parser().parse_args(argv)
    inputs = ScaleInputs()
    given = {f.name: getattr(ns, f.name) for f in fields(ScaleInputs) if f.name != "sources"}
    given = {k: v for k, v in given.items() if v is not None}
    if given:
        inputs = inputs.with_source("given on the command line", **given)
    inputs = measured_inputs(inputs, ns.measured)
    fit = not (ns.llama3_rate or ns.measured or {"failures_per_gpu_hour", "checkpoint_interval_s"} & set(given))
    if fit:  # the seed's 44 % / 80 % at 100k GPUs: which failure rate and checkpoint interval it takes
        inputs = inputs_for_targets(inputs)
    try:
        sizes = tuple(int(s) for s in ns.sizes.split(","))
    except ValueError as err:
        raise ValueError(f"--sizes {ns.sizes!r}: expected GPU counts separated by commas") from err
    rows = scale_table(inputs, sizes)
    _print(rows, inputs)
    if ns.out:
        ns.out.mkdir(parents=True, exist_ok=True)
        with (ns.out / "ft_scale.csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=[x.name for x in fields(ScalePoint)])
            writer.writeheader()
            writer.writerows(asdict(r) for r in rows)
        (ns.out / "ft_scale.json").write_text(json.dumps({"inputs": asdict(inputs), "rows": [asdict(r) for r in rows],
                                                          "written": time.strftime("%Y-%m-%dT%H:%M:%S")}, indent=2))
        print(f"written: {ns.out}/ft_scale.{{csv,json}}")
    return EXIT_OK


def _print(rows: list[ScalePoint], inputs: ScaleInputs) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console() if Console().is_terminal else Console(width=140)
    table = Table(title="effective training time vs cluster size (model: suite/ft_scale.py)", title_justify="left")
    for column in ("GPUs", "failures/h", "MTBF min", "ETT sync", "ETT replica-level", "cost/failure sync min",
                   "cost/failure ft min"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(f"{r.gpus:,}", f"{r.failures_per_hour:.3g}", f"{r.mtbf_min:.1f}", f"{r.ett_sync_pct:.1f} %",
                      f"{r.ett_ft_pct:.1f} %", f"{r.cost_sync_min:.2f}", f"{r.cost_ft_min:.2f}")
    console.print(table)
    inputs_table = Table(title="inputs", title_justify="left")
    for column in ("input", "value", "source"):
        inputs_table.add_column(column)
    for f in fields(ScaleInputs):
        if f.name != "sources":
            inputs_table.add_row(f.name, f"{getattr(inputs, f.name):.4g}", inputs.sources.get(f.name, ""))
    console.print(inputs_table)
