"""The edited graph as a Chakra execution trace, so a simulator (ASTRA-sim) can take a what-if further.

Nodes are the graph's ops after the edit — a layer-count change clones the last layer's ops (forward
and backward runs alike, each copy's data dependencies on its own copy; what followed the layer then
reads the last copy) or drops the layers past the new count; batch, sequence and platform edits give
every op its re-timed duration — plus, at more than one data-parallel rank, the gradient all-reduce as
one ``COMM_COLL_NODE`` per DDP bucket after the last backward op. Each node has its duration, host-order
control dependency on the op before it and its data dependencies; the host time before an op is its
``host_gap_micros`` attribute (Chakra has no host-gap node). Written with mlc-chakra's own protobuf
schema (``et_def_pb2``), readable with :func:`workloads.trace_replay.chakra.read_chakra`.
"""

from __future__ import annotations

import math
from pathlib import Path

from harness.whatif.costmodel import Calibration
from harness.whatif.graph import Graph, Op
from harness.whatif.predict import Change, dimension_factors, retimed
from workloads.trace_bundle import TraceError

CHAKRA_VERSION = "0.0.4"  # the schema version mlc-chakra's PyTorch converter writes


def edited_ops(graph: Graph, change: Change, calibration: Calibration) -> list[tuple[Op, float, int]]:
    """The edited step as (op, duration µs, copy) in host order: copy 0 is the captured op, copy k > 0
    the k-th clone of a last-layer op (layers assigned first: :meth:`Graph.assign_layers`)."""
    resize, _ = dimension_factors(graph, change)
    durations = {op.id: (retimed(op, resize, calibration, change.calibration)
                         if (resize or change.calibration) else op.dur_us) for op in graph.ops}
    if change.layers is None:
        return [(op, durations[op.id], 0) for op in graph.ops]
    layers = 1 + max((op.layer[1] for op in graph.ops if op.layer is not None), default=-1)
    if layers < 1:
        raise ValueError("the graph has no layers assigned: call Graph.assign_layers first")
    scale = change.layers / layers
    out: list[tuple[Op, float, int]] = []
    run: list[Op] = []

    def flush() -> None:
        for k in range(1, change.layers - layers + 1):
            out.extend((op, durations[op.id], k) for op in run)
        run.clear()

    for op in graph.ops:
        if op.layer is not None and op.layer[1] >= change.layers:
            continue  # fewer layers: the ones past the new count are gone
        is_last = op.layer is not None and op.layer[1] == layers - 1
        if run and not is_last:
            flush()
        dur = durations[op.id]
        if op.layer is None and op.layer_share < 1.0:
            dur *= (1.0 - op.layer_share) + op.layer_share * scale
        out.append((op, dur, 0))
        if is_last and change.layers > layers:
            run.append(op)
    flush()
    return out


def export_edited_chakra(graph: Graph, ops: list[tuple[Op, float, int]], out: Path,
                         allreduce_buckets_us: list[tuple[int, float]] | None = None,
                         sharded_stage: tuple[frozenset[int], float] | None = None) -> Path:
    """Write ``ops`` (from :func:`edited_ops`) and the all-reduce buckets ((bytes, µs) each) as one
    rank's Chakra trace ``out`` (every data-parallel rank runs the same one). ``sharded_stage`` (its op ids,
    its measured µs): those ops become one node where the first of them ran, carrying the stage's time."""
    try:
        from chakra.schema.protobuf.et_def_pb2 import (
            ALL_REDUCE,
            COMM_COLL_NODE,
            COMP_NODE,
            AttributeProto,
            GlobalMetadata,
            Node,
        )
        from chakra.src.third_party.utils.protolib import encodeMessage
    except ImportError:
        raise TraceError("Chakra export needs the optional mlc-chakra package: pip install -e '.[chakra]' "
                         "(or pip install mlc-chakra)") from None
    out.parent.mkdir(parents=True, exist_ok=True)
    ids: dict[tuple[int, int], int] = {}  # (op id, copy) → node id
    latest: dict[int, int] = {}  # op id → the node id of its latest copy (what later ops read)
    nodes = []
    previous = None
    stage_ids, stage_us = sharded_stage or (frozenset(), 0.0)
    stage_node = None
    for op, dur, copy in ops:
        i = len(nodes) + 1
        if op.id in stage_ids:
            if stage_node is None:  # the stage, as measured alone at W ranks, where its first op ran
                stage_node = Node(id=i, name="sharded embedding stage (TorchRec DMP, measured at W ranks)",
                                  type=COMP_NODE, duration_micros=max(0, round(stage_us)))
                if previous is not None:
                    stage_node.ctrl_deps.append(previous)
                stage_node.attr.extend([AttributeProto(name="is_cpu_op",
                                                       bool_val=graph.platform.get("device_type") == "cpu"),
                                        AttributeProto(name="op_category", string_val="sharded_stage")])
                nodes.append(stage_node)
                previous = i
            latest[op.id] = stage_node.id
            continue
        node = Node(id=i, name=op.name if copy == 0 else f"{op.name} (layer clone {copy})", type=COMP_NODE,
                    duration_micros=max(0, round(dur)))
        if previous is not None:
            node.ctrl_deps.append(previous)
        deps = {ids.get((d, copy)) if copy and (d, copy) in ids else latest.get(d) for d in op.deps}
        node.data_deps.extend(sorted(d for d in deps if d is not None and d != i))
        tensor_bytes = sum(math.prod(u.shape) * u.itemsize for u in [*op.inputs, *op.outputs])
        node.attr.extend([AttributeProto(name="is_cpu_op", bool_val=graph.platform.get("device_type") == "cpu"),
                          AttributeProto(name="op_category", string_val=op.category),
                          AttributeProto(name="tensor_size", uint64_val=int(tensor_bytes)),
                          AttributeProto(name="host_gap_micros", double_val=float(op.gap_us))])
        ids[(op.id, copy)] = i
        latest[op.id] = i
        nodes.append(node)
        previous = i
    for nbytes, us in allreduce_buckets_us or []:
        i = len(nodes) + 1
        node = Node(id=i, name="all_reduce (DDP gradient bucket)", type=COMM_COLL_NODE,
                    duration_micros=max(0, round(us)))
        node.ctrl_deps.append(previous)
        node.attr.extend([AttributeProto(name="is_cpu_op", bool_val=False),
                          AttributeProto(name="comm_type", int64_val=ALL_REDUCE),
                          AttributeProto(name="comm_size", int64_val=int(nbytes))])
        nodes.append(node)
        previous = i
    metadata = GlobalMetadata(version=CHAKRA_VERSION)
    metadata.attr.append(AttributeProto(name="cobench_source", string_val=f"what-if edit of a {graph.workload} "
                                                                          "capture"))
    with out.open("wb") as stream:
        encodeMessage(stream, metadata)
        for node in nodes:
            encodeMessage(stream, node)
    return out
