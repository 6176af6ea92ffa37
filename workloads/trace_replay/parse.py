"""A bundle's traces read once into typed records: the execution trace's nodes and the Kineto events.

One rank's bundle (:mod:`workloads.trace_bundle`) holds an execution trace (ET: every op and
record-function scope as a node of a tree, with its inputs and outputs), the Kineto trace of the
same steps (each op's time, joined to its node on the record-function id, and the allocator's
events), and optionally a Kineto trace of steps run under Kineto alone (the host time between ops,
each op's time without the ET observer's cost). :func:`read_bundle` reads each file once; spec
generation (:mod:`.extract`, :mod:`.spec`) and what-if (:mod:`harness.whatif.graph`) both start
from its :class:`BundleTrace`.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, NamedTuple

from workloads.trace_bundle import (
    ET_FILE,
    ET_RESOURCES,
    KINETO_FILE,
    KINETO_TIMING_FILE,
    STEP_ANNOTATION,
    BundleMeta,
    TraceError,
    check_et_schema,
    read_json,
    read_meta,
)
from workloads.trace_replay.ops import list_types

MAX_TENSOR_DATA_BYTES = 16 * 2**20  # larger recorded integer inputs fall back to their value range


@dataclass
class Node:
    """One execution-trace node: an op (it has a schema) or a record-function scope."""

    id: int
    name: str
    parent: int
    schema: str
    rf_id: int | None
    tid: int
    inputs: dict[str, list]
    outputs: dict[str, list]
    tensor_range: dict[str, list]
    seq_id: int | None = None  # autograd sequence number: a backward node carries its forward op's


class KinetoEvent(NamedTuple):
    """A complete (``ph: X``) Kineto event: an op, a step annotation or another scope. (A tuple: a profiled
    block holds tens of thousands, and a frozen dataclass took four times as long to make.)"""

    name: str
    cat: str
    ts: float  # µs
    dur: float  # µs
    tid: Any
    rf_id: int | None  # the record-function id joining it to its ET node
    # an op's scalar inputs as the profiler wrote them (``Concrete Inputs``, recorded with shapes; '' for the rest):
    # at full precision, where the execution trace writes a float with six decimals (see ``precise_doubles``)
    concrete: tuple[str, ...] | None = None


@dataclass(frozen=True)
class MemoryEvent:
    """An allocator event of a ``profile_memory`` trace: ``nbytes`` > 0 allocates at ``addr``, < 0 frees.
    ``device_type``: the allocator's device (``c10::DeviceType``: 0 the CPU, whose allocator reports the
    bytes asked for; a device's caching allocator reports the block it handed out, rounded up)."""

    ts: float
    addr: int
    nbytes: int
    device_type: int = 0


@dataclass
class KinetoTrace:
    """A Kineto trace's events, each list in file order."""

    events: list[KinetoEvent]  # every complete event
    memory: list[MemoryEvent]

    @cached_property  # made once: a trace's events do not change once read, and its steps are looked up one by one
    def steps(self) -> list[KinetoEvent]:
        """The step annotations (``cobench_step#<k>``)."""
        return [e for e in self.events if e.cat == "user_annotation" and e.name.startswith(STEP_ANNOTATION)]

    @cached_property
    def cpu_ops(self) -> list[KinetoEvent]:
        return [e for e in self.events if e.cat == "cpu_op"]

    def by_rf_id(self) -> dict[int, KinetoEvent]:
        """Events by record-function id (a later event with the same id wins)."""
        return {e.rf_id: e for e in self.events if e.rf_id is not None}


@dataclass
class BundleTrace:
    """One rank's bundle, read: its metadata, ET nodes, traced steps' Kineto trace and Kineto-alone steps'."""

    path: Path
    meta: BundleMeta
    nodes: dict[int, Node]
    kineto: KinetoTrace
    timing: KinetoTrace | None  # None: the bundle has no Kineto-alone steps


def step_index(event: KinetoEvent) -> int:
    """The captured step a step annotation marks."""
    return int(event.name[len(STEP_ANNOTATION):])


def _attrs(raw: dict[str, Any]) -> dict[str, Any]:
    return {a["name"]: a.get("value") for a in raw.get("attrs", []) if isinstance(a, dict) and "name" in a}


def _node(raw: dict[str, Any]) -> Node:
    attrs = _attrs(raw)
    ranges = attrs.get("tensor_range") or ""
    seq = attrs.get("seq_id", -1)
    return Node(
        id=int(raw["id"]),
        name=str(raw["name"]),
        parent=int(raw.get("ctrl_deps", 0)),
        schema=str(attrs.get("op_schema") or ""),
        rf_id=int(attrs["rf_id"]) if attrs.get("rf_id") is not None else None,
        tid=int(attrs.get("tid", 0)),
        inputs=raw.get("inputs") or {},
        outputs=raw.get("outputs") or {},
        tensor_range=json.loads(ranges) if ranges else {},
        seq_id=int(seq) if seq is not None and seq >= 0 else None,
    )


def parse_nodes(et: dict[str, Any], path: Path) -> dict[int, Node]:
    """An execution trace's nodes by id; a malformed node is a TraceError naming ``path``."""
    nodes: dict[int, Node] = {}
    for raw in et["nodes"]:
        try:
            node = _node(raw)
        except (KeyError, TypeError, ValueError) as err:
            raise TraceError(f"{path}: malformed execution-trace node {str(raw)[:120]}: {err}") from None
        nodes[node.id] = node
    return nodes


def read_et(path: Path) -> dict[int, Node]:
    """Read and check an execution-trace file: its nodes by id."""
    et = read_json(path, "execution trace")
    check_et_schema(et, path)
    return parse_nodes(et, path)


def _memory_event(event: Any) -> MemoryEvent | None:
    if not (isinstance(event, dict) and event.get("name") == "[memory]" and isinstance(event.get("args"), dict)
            and isinstance(event["args"].get("Bytes"), int) and isinstance(event["args"].get("Addr"), int)
            and isinstance(event.get("ts"), int | float)):
        return None
    device_type = event["args"].get("Device Type", 0)
    return MemoryEvent(float(event["ts"]), event["args"]["Addr"], event["args"]["Bytes"],
                       device_type if isinstance(device_type, int) else 0)


def kineto_trace(raw: Any, path: Path) -> KinetoTrace:
    """A loaded Kineto (chrome) trace as typed events; one that is not such a trace is a TraceError."""
    if not isinstance(raw, dict) or not isinstance(raw.get("traceEvents"), list):
        raise TraceError(f"{path} is not a Kineto/chrome trace: expected an object with 'traceEvents'")
    events, memory = [], []
    for event in raw["traceEvents"]:
        if isinstance(event, dict) and event.get("ph") == "X":
            args = event.get("args") or {}
            rf, concrete = args.get("Record function id"), args.get("Concrete Inputs")
            scalars = tuple(str(c) for c in concrete) if isinstance(concrete, list) and any(concrete) else None
            try:
                events.append(KinetoEvent(str(event.get("name", "")), str(event.get("cat", "")), float(event["ts"]),
                                          float(event["dur"]), event.get("tid"), int(rf) if rf is not None else None,
                                          scalars))
            except (KeyError, TypeError, ValueError) as err:
                raise TraceError(f"{path}: malformed Kineto event {str(event)[:120]}: {err}") from None
        found = _memory_event(event)
        if found is not None:
            memory.append(found)
    return KinetoTrace(events, sorted(memory, key=lambda e: e.ts))


def recorded_kineto(events: list[Any]) -> KinetoTrace | None:
    """A profiler's recorded events (``profile().profiler.kineto_results.events()``) as the typed events its
    exported trace would read as, without writing and parsing that file (a host-time block's export and
    parse took most of a replay's setup): each event's type is its category, its times in µs. The
    record-function id, which joins a file's event to its ET node, is not among them: None. None in all
    where this torch's events do not name their category (``activity_type``, bound to Python only in
    recent torch; 2.13 has it): read the exported file there. Times count from the block's first event,
    as the file's do from its own start: nanoseconds since the epoch as a float in µs keep only a
    quarter of a µs."""
    if events and not isinstance(getattr(events[0], "activity_type", lambda: None)(), str):
        return None
    origin = min((e.start_ns() for e in events), default=0)
    return KinetoTrace([KinetoEvent(e.name(), e.activity_type(), (e.start_ns() - origin) / 1e3, e.duration_ns() / 1e3,
                                    e.start_thread_id(), None) for e in events], [])


def read_kineto(path: Path, what: str = "Kineto trace") -> KinetoTrace:
    """Read a Kineto trace file as typed events."""
    return kineto_trace(read_json(path, what), path)


def read_bundle(bundle: Path) -> BundleTrace:
    """Read one rank's bundle folder: each of its trace files once."""
    timing = bundle / KINETO_TIMING_FILE
    nodes, kineto = read_et(bundle / ET_FILE), read_kineto(bundle / KINETO_FILE)
    repair_nesting(nodes, kineto)
    return BundleTrace(bundle, read_meta(bundle), nodes, kineto,
                       read_kineto(timing, "Kineto timing trace") if timing.is_file() else None)


def repair_nesting(nodes: dict[int, Node], kineto: KinetoTrace) -> int:
    """Re-attach each node whose recorded parent did not contain it to the node that did; returns how many moved.

    The observer nests a node under whatever record function its thread has open. An asynchronous
    collective's record (``gloo:all_to_all``) opens on the calling thread and closes on the library's
    worker, and the calling thread's stack can then keep the op it ran next open: every later node
    nests under an op that had returned (TorchRec's all-to-alls, now and then, on one rank of two),
    and an op under another op is not replayed on its own. Where both have Kineto events, a parent
    that ended before its child began, or ran on another thread, is not its parent: the walk goes up to one that
    contained it. The stack can also be off by one the other way, or name a record missing from the trace
    altogether (DDP's bucket all-reduces: one rank's ops unlike the other's in 10 of 30 two-rank captures of a small
    DDP program, none after this): an inner op of a matrix multiply recorded beside it, replayed as an op of its own,
    and the step's last ops under a parent not in the trace, no step's (that rank's replay lost its optimizer's
    step). So a node goes to the node of its thread, entered before it, whose event contains its own most tightly,
    where that one is tighter than the parent it has.
    """
    events = kineto.by_rf_id()
    recorded = {node.id: node.parent for node in nodes.values()}  # walked as recorded, not as repaired
    tightest = _tightest_containers(nodes, events)
    moved = 0
    for node in nodes.values():
        event = events.get(node.rf_id) if node.rf_id is not None else None
        if event is None:
            continue
        parent, seen = nodes.get(recorded[node.id]), {node.id}
        while parent is not None and parent.id not in seen and recorded[parent.id] != parent.id:
            seen.add(parent.id)
            outer = events.get(parent.rf_id) if parent.rf_id is not None else None
            if outer is None or (outer.tid == event.tid and outer.ts + outer.dur >= event.ts):
                break
            parent = nodes.get(recorded[parent.id])
        outer = events.get(parent.rf_id) if parent is not None and parent.rf_id is not None else None
        inner = tightest.get(node.id)
        if inner is not None and (parent is None or (outer is not None and inner[1] < outer.dur)):
            parent = nodes[inner[0]]
        if parent is not None and parent.id != node.parent:
            node.parent = parent.id
            moved += 1
    return moved


def _tightest_containers(nodes: dict[int, Node], events: dict[int, KinetoEvent]) -> dict[int, tuple[int, float]]:
    """Each node with a Kineto event → the node on its thread (the trace's and Kineto's), entered before it (the
    observer numbers nodes as they begin), whose event lasts longer and contains its own most tightly, with that
    event's duration. One sweep per thread: a thread's events nest."""
    threads: dict[tuple[Any, int], list[tuple[float, float, int, float]]] = {}
    for node in nodes.values():
        if node.rf_id is not None and (event := events.get(node.rf_id)) is not None:
            threads.setdefault((event.tid, node.tid), []).append((event.ts, -(event.ts + event.dur), node.id,
                                                                  event.dur))
    found: dict[int, tuple[int, float]] = {}
    for timed in threads.values():
        timed.sort()
        containing: list[tuple[int, float, float]] = []  # (id, end, duration): the events open at this one's start
        for _, negative_end, node_id, dur in timed:
            while containing and containing[-1][1] < -negative_end:
                containing.pop()
            for other, _, other_dur in reversed(containing):
                if other < node_id and other_dur > dur:
                    found[node_id] = (other, other_dur)
                    break
            containing.append((node_id, -negative_end, dur))
    return found


def is_tensor_ref(value: Any) -> bool:
    """Whether an ET value is a tensor reference: [tensor id, storage id, offset, numel, itemsize, device]."""
    return (isinstance(value, list) and len(value) == 6 and all(isinstance(v, int) for v in value[:5])
            and isinstance(value[5], str))


def tensor_refs(values: Iterable[Any]) -> Iterator[list]:
    """Every tensor value ``[tensor_id, storage_id, offset, numel, itemsize, device]``, lists included."""
    for value in values:
        if is_tensor_ref(value):
            yield value
        elif isinstance(value, list):
            yield from tensor_refs(value)


def recorded_tensor_data(bundle: Path, node: Node) -> dict[str, str]:
    """Tensor-input index → base64 of the raw integer data the ET observer saved for this op, if any.

    torch 2.13's observer copies ``numel × itemsize`` bytes from ``storage + offset`` with the offset
    in elements, not bytes: the data of a view that starts past its storage's first element is wrong,
    so it is dropped (the replay falls back to the recorded value range there).
    """
    resources = bundle / ET_RESOURCES
    data: dict[str, str] = {}
    if not resources.is_dir():
        return data
    index = -1
    for value, et_type in zip(node.inputs.get("values", []), node.inputs.get("types", []), strict=False):
        items = [(value, et_type)]
        if et_type.startswith("GenericList[") and isinstance(value, list):
            items = list(zip(value, list_types(et_type), strict=False))
        for item, item_type in items:
            if not item_type.startswith("Tensor("):
                continue
            index += 1
            path = resources / f"nid_{node.id}_tid_{index}.dat"
            if not (is_tensor_ref(item) and item[2] == 0 and path.is_file()):
                continue
            if 0 < path.stat().st_size <= MAX_TENSOR_DATA_BYTES:
                data[str(index)] = base64.b64encode(path.read_bytes()).decode("ascii")
    return data
