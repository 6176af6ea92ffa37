"""The sweep table: one row per (collective, size) measured, the stable format other tools read.

Written by ``workload=collectives`` into its run folder (so into the MLflow run's artifacts) as
``collectives_<collective>.csv`` and ``.json``, with a plot ``.png``. The what-if predictor reads it
back with :func:`read_sweep_table`. Format ``cobench.collectives.sweep`` version 1 — columns, in order:

================  ============================================================================
collective        one of ``workloads.collectives.ops.COLLECTIVES``
world_size        ranks in the process group
backend           torch.distributed backend (gloo, nccl, xccl …)
device            device type the buffers lived on (cpu, cuda …)
dtype             element type (float32, bfloat16 …)
bytes             S, the operation's size in bytes (nccl-tests' convention, ``ops`` docstring)
time_us_p50       median time of one operation, µs; each sample is the slowest rank's time
time_us_p99       99th percentile of the same samples, µs
algbw_gbps        S ÷ time_us_p50, GB/s (10⁹ bytes per second)
busbw_gbps        algbw_gbps × the collective's bus factor
samples           timed samples behind the percentiles
================  ============================================================================

A new column is added at the end and bumps nothing; renaming or removing one bumps the version.
"""

from __future__ import annotations

import csv
import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

FORMAT = "cobench.collectives.sweep"
VERSION = 1


@dataclass(frozen=True)
class SweepRow:
    collective: str
    world_size: int
    backend: str
    device: str
    dtype: str
    bytes: int
    time_us_p50: float
    time_us_p99: float
    algbw_gbps: float
    busbw_gbps: float
    samples: int


COLUMNS = tuple(f.name for f in fields(SweepRow))


def write_sweep_table(rows: list[SweepRow], stem: Path, meta: dict[str, Any]) -> list[Path]:
    """``<stem>.csv``, ``<stem>.json`` (rows + ``meta``: device name, start-up time …) and ``<stem>.png``."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    csv_path, json_path, png_path = stem.with_suffix(".csv"), stem.with_suffix(".json"), stem.with_suffix(".png")
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(asdict(row) for row in rows)
    json_path.write_text(json.dumps({"format": FORMAT, "version": VERSION, "columns": list(COLUMNS),
                                     "meta": meta, "rows": [asdict(row) for row in rows]}, indent=2))
    _plot(rows, png_path)
    return [csv_path, json_path, png_path]


def read_sweep_table(path: Path) -> list[SweepRow]:
    """Rows of a sweep table written by :func:`write_sweep_table` (its ``.json`` or ``.csv``)."""
    path = Path(path)
    if path.suffix == ".json":
        doc = json.loads(path.read_text())
        if doc.get("format") != FORMAT or doc.get("version") != VERSION:
            raise ValueError(f"{path}: not a {FORMAT} v{VERSION} table (format {doc.get('format')!r}, "
                             f"version {doc.get('version')!r})")
        records = doc["rows"]
    else:
        with path.open(newline="") as f:
            records = list(csv.DictReader(f))
        if not records or list(records[0])[:len(COLUMNS)] != list(COLUMNS):
            raise ValueError(f"{path}: expected the columns {', '.join(COLUMNS)}")
    types = {f.name: f.type for f in fields(SweepRow)}
    cast = {"int": int, "float": float, "str": str}
    return [SweepRow(**{k: cast[types[k]](r[k]) for k in COLUMNS}) for r in records]


def _plot(rows: list[SweepRow], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [r.bytes for r in rows]
    fig, (bw, lat) = plt.subplots(1, 2, figsize=(9, 3.4))
    bw.plot(sizes, [r.busbw_gbps for r in rows], marker="o", label="busbw")
    bw.plot(sizes, [r.algbw_gbps for r in rows], marker=".", linestyle="--", label="algbw")
    bw.set(xscale="log", xlabel="bytes", ylabel="GB/s", title="bandwidth (p50)")
    bw.legend(fontsize="small")
    lat.plot(sizes, [r.time_us_p50 for r in rows], marker="o", label="p50")
    lat.plot(sizes, [r.time_us_p99 for r in rows], marker=".", linestyle="--", label="p99")
    lat.set(xscale="log", yscale="log", xlabel="bytes", ylabel="µs", title="time per operation")
    lat.legend(fontsize="small")
    if rows:
        r = rows[0]
        fig.suptitle(f"{r.collective}, {r.world_size} ranks, {r.backend}/{r.device}, {r.dtype}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
