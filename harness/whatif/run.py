"""A what-if prediction from a trace bundle, end to end: what ``cobench trace predict`` and ``calibrate`` run.

:func:`predict_bundle` reads the bundle's graph, parses the changes, measures (or loads) this host's cost
curves with host memory as the capture had it, and predicts the step — at W data-parallel ranks with the
per-rank curves, the all-reduce's cost and the measured costs of :mod:`.costs`. :func:`export_prediction_chakra`
writes the edited graph one rank runs as a Chakra trace; :func:`calibrate_platform` measures the curves a
prediction for this platform made elsewhere takes (``--target-calibration``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.platform import configure_host_allocator, host_allocator_in_effect
from harness.whatif.cache import cache_dir
from harness.whatif.chakra_export import edited_ops, export_edited_chakra
from harness.whatif.changes import WORLD_KEYS, Changes, parse_changes
from harness.whatif.costmodel import Calibration, calibrate, load_or_calibrate, read_calibration
from harness.whatif.costs import has_sharded_stage, read_stage_timing, read_sync_timing, stage_cost, sync_cost
from harness.whatif.dataparallel import (
    ASSUMED_BUSBW_GBPS,
    ASSUMED_LATENCY_US,
    AllReduceCost,
    allreduce_cost,
    bucket_sizes,
    predict_data_parallel,
    rank_change,
    stage_ops,
    threads_per_rank,
)
from harness.whatif.graph import Graph, load_graph
from harness.whatif.predict import Prediction, predict


@dataclass
class PredictOptions:
    """Where a prediction's inputs come from (``cobench trace predict``'s flags); None: made or kept here."""

    calibration: Path | None = None  # this platform's curves (default: the bundle's what-if cache)
    target_calibration: Path | None = None  # another platform's curves: predict for it
    collectives: Path | None = None  # the collectives benchmark's all_reduce sweep table
    assume_busbw_gbps: float = ASSUMED_BUSBW_GBPS  # without a table
    assume_latency_us: float = ASSUMED_LATENCY_US
    sharded_stage: Path | None = None  # a sharded-stage timing made on the target
    gradient_sync: Path | None = None  # a gradient-sync timing made on the target
    sync_from: str = "skeleton"  # "table": only the all-reduce after backward, no torchrun launches


@dataclass
class BundlePrediction:
    """A prediction and what made it: the graph, the parsed changes, the curves, the all-reduce's cost; ``record``
    is the prediction's JSON (``--json``), with what was added to it since."""

    graph: Graph
    changes: Changes
    calibration: Calibration
    rank_calibration: Calibration | None
    allreduce: AllReduceCost | None
    result: Prediction
    record: dict[str, Any]

    @property
    def world(self) -> int | None:
        """The data-parallel degree predicted (None: as captured)."""
        return self.changes.world_size


def predict_bundle(bundle: Path, changes: list[str], options: PredictOptions) -> BundlePrediction:
    """``bundle``'s step under ``changes`` (``key=N`` items: layers, batch, sequence, ``world_size``)."""
    check_input_files(changes, options)
    graph = load_graph(bundle)
    parsed = parse_changes(graph, changes)
    calibration = _curves(bundle, graph, parsed, options)
    rank_calibration, allreduce = None, None
    if parsed.world_size is not None:
        allreduce = allreduce_cost(parsed.world_size, options.collectives, options.assume_busbw_gbps,
                                   options.assume_latency_us)
        rank_calibration = _rank_curves(bundle, graph, parsed, calibration, options)
        result = _predict_ranks(bundle, graph, parsed, calibration, rank_calibration, allreduce, options)
    else:
        result = predict(graph, parsed.change, calibration)
    record = result.to_json()
    record["inputs"]["changes"] = list(parsed.items)
    record["inputs"]["host_allocator"] = host_allocator_in_effect()  # the curves' (the capture's, see _curves)
    return BundlePrediction(graph, parsed, calibration, rank_calibration, allreduce, result, record)


def check_input_files(changes: list[str], options: PredictOptions) -> None:
    """Each file a flag names, read before the bundle's graph is (loading it takes seconds): one that does not
    exist, or is not what its flag takes, is refused at once. What a file must agree with (the changes, the
    predicted step) is checked where it is used."""
    world = next((value for key, _, value in (c.partition("=") for c in changes) if key in WORLD_KEYS), "W")
    if options.collectives is not None:
        if not options.collectives.exists():
            raise ValueError(f"--collectives {options.collectives} does not exist: it is the collectives benchmark's "
                             "sweep table (collectives_all_reduce.json in that run's folder)")
        from workloads.collectives.table import read_sweep_table

        read_sweep_table(options.collectives)
    if options.target_calibration is not None:
        if not options.target_calibration.exists():
            raise ValueError(f"--target-calibration {options.target_calibration} does not exist: make it on the "
                             "target with `cobench trace calibrate --out FILE`")
        read_calibration(options.target_calibration)
    if options.sharded_stage is not None:
        read_stage_timing(options.sharded_stage, world)
    if options.gradient_sync is not None:
        read_sync_timing(options.gradient_sync, world)


def _curves(bundle: Path, graph: Graph, parsed: Changes, options: PredictOptions) -> Calibration:
    """This host's curves (``options.calibration``, else the bundle's what-if cache, measured there first); another
    platform's, when given, go on ``parsed.change``."""
    # the curves are measured with host memory as the capture had it (a step's ops and the curves' alike pay
    # for glibc returning freed memory, or neither does)
    configure_host_allocator("steady" if graph.platform.get("host_allocator", "").startswith("steady") else "system")
    calibration = load_or_calibrate(options.calibration or cache_dir(bundle) / "calibration.json")
    if options.target_calibration is not None:  # checked: check_input_files
        parsed.change.calibration = read_calibration(options.target_calibration)
    return calibration


def _rank_curves(bundle: Path, graph: Graph, parsed: Changes, calibration: Calibration,
                 options: PredictOptions) -> Calibration | None:
    """The curves at the threads a rank gets when the ranks share this host's cores (None: as many as captured,
    or another platform's)."""
    threads, rank_threads = threads_per_rank(graph, parsed.world_size)
    if rank_threads == threads or parsed.change.calibration is not None:
        return None
    platform = f"{calibration.platform}-{rank_threads}threads"
    if options.calibration is not None:
        return calibrate(platform, rank_threads)
    return load_or_calibrate(cache_dir(bundle) / f"calibration_{rank_threads}threads.json", platform, rank_threads)


def _predict_ranks(bundle: Path, graph: Graph, parsed: Changes, calibration: Calibration,
                   rank_calibration: Calibration | None, allreduce: AllReduceCost,
                   options: PredictOptions) -> Prediction:
    """The step at ``parsed.world_size`` ranks: a sharded stage's measured time in place of its ops, then DDP's
    gradient synchronisation measured on the skeleton of that step."""
    world, change = parsed.world_size, parsed.change
    other_platform = change.calibration is not None
    sharded = has_sharded_stage(graph.workload)
    stage = stage_cost(bundle, graph, world, list(parsed.items), options.sharded_stage, other_platform) \
        if sharded and world > 1 else None
    result = predict_data_parallel(graph, world, calibration, change, rank_calibration, allreduce, stage, sharded)
    sync = sync_cost(bundle, result.inputs["data_parallel"].get("sync_spec"), world, list(parsed.items),
                     options.gradient_sync, options.sync_from == "table", other_platform)
    if sync is not None:
        result = predict_data_parallel(graph, world, calibration, change, rank_calibration, allreduce, stage,
                                       sharded, sync)
    return result


def export_prediction_chakra(prediction: BundlePrediction, folder: Path) -> Path:
    """The edited graph one rank runs (layers already assigned by the prediction) as ``folder/rank0.et``: at W
    ranks its gradient buckets (sharing out the measured sync by their times, when it was measured) and the
    sharded stage as one node; the path is also put in the prediction's record."""
    graph, world, record = prediction.graph, prediction.world, prediction.record
    change = prediction.changes.change
    local = rank_change(graph, world, change, prediction.rank_calibration) if world and world > 1 else change
    dp = record["inputs"].get("data_parallel", {})
    buckets = [(b, prediction.allreduce.at(b)) for b in bucket_sizes(dp["gradient_bytes"])] \
        if world and world > 1 and prediction.allreduce is not None else []
    if buckets and dp.get("gradient_sync_ms") is not None:  # the measured sync, shared out by the buckets' times
        total = sum(us for _, us in buckets) or 1.0
        buckets = [(b, 1e3 * dp["gradient_sync_ms"] * us / total) for b, us in buckets]
    st = dp.get("sharded_stage")
    path = export_edited_chakra(graph, edited_ops(graph, local, prediction.calibration), folder / "rank0.et", buckets,
                                (stage_ops(graph, st["module"]), 1e3 * st["measured_ms"]) if st else None)
    record["chakra"] = str(path)
    return path


def calibrate_platform(out: Path, platform: str, threads: int | None, host_allocator: str) -> tuple[Calibration, str]:
    """Measure this platform's cost curves with host memory as ``host_allocator`` says (the runs to predict's) and
    write them to ``out``; returns them and the host memory in effect."""
    configure_host_allocator(host_allocator)
    calibration = calibrate(platform, threads)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(calibration.to_json() | {"host_allocator": host_allocator_in_effect()}, indent=1))
    return calibration, host_allocator_in_effect()
