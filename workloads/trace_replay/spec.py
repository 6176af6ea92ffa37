"""Bundle → portable benchmark spec (one JSON file), and the spec's reader.

Which ops a spec holds: the *top-level* operators of each captured step — operators with a schema
(``aten::``, ``c10d::``, ``fbgemm::`` …) none of whose ancestors is itself such an operator. Their
children run inside them, so replaying them too would count their time twice. Record-function
scopes (the step marker, ``## forward ##``, module names, ``autograd::engine::evaluate_function:
…``, ``Optimizer.step#…``) are kept as each op's scope path, for selection. Ops of threads that run
no framework work (e.g. a communication library's worker thread, whose copies are part of a
collective) are left out; a backward thread (autograd engine) is kept.

Each op keeps its schema, the ET's inputs/outputs (values, shapes, types, strides: storage ids and
offsets, so views share storage on replay), the integer value ranges the ET recorded, its data
dependencies, its category and its original duration joined from Kineto on ``rf_id``.
"""

from __future__ import annotations

import base64
import bisect
import hashlib
import json
import math
import re
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from workloads.trace_bundle import (
    ET_FILE,
    ET_RESOURCES,
    KINETO_FILE,
    KINETO_TIMING_FILE,
    STEP_ANNOTATION,
    VALUES_FILE,
    BundleMeta,
    TraceError,
    check_et_schema,
    rank_dirs,
    read_json,
    read_meta,
)
from workloads.trace_replay.ops import list_types

SPEC_SCHEMA = "cobench-generated-spec/1"
MAX_TENSOR_DATA_BYTES = 16 * 2**20  # larger recorded integer inputs fall back to their value range
_THREAD_ROOT = "[pytorch|profiler|execution_trace|thread]"
_PROCESS_ROOT = "[pytorch|profiler|execution_trace|process]"

# Op categories for the time breakdown; the first pattern that matches the op's name wins.
CATEGORIES: list[tuple[str, str]] = [
    ("comm", r"^(c10d|_c10d_functional|c10d_functional)::"),
    ("attention", r"attention|_flash_|_efficient_attention|_cudnn_attention"),
    ("embedding", r"embedding|^fbgemm::.*(split_embedding|tbe|lookup)"),
    ("gemm", r"::(mm|addmm|bmm|baddbmm|matmul|linear|_scaled_mm|convolution|conv\w*|_addmm_activation)$"),
    ("gemm", r"^fbgemm::jagged_(dense|jagged)_bmm(_forward)?$"),  # a GEMM per sample over jagged rows
    ("optimizer", r"::(_foreach_\w+|_fused_adam\w*|_fused_sgd\w*|_fused_adagrad\w*|addcdiv_|addcmul_|lerp_)$"),
    ("reduction", r"::(sum|mean|norm|linalg_vector_norm|var|var_mean|std|max|min|amax|amin|argmax|softmax|"
                  r"_softmax|log_softmax|_log_softmax|\w*_backward_data|nll_loss\w*|cross_entropy\w*|"
                  r"cumsum|prod|all|any|topk|sort)$"),
    ("memory", r"::(copy_|clone|empty\w*|zeros\w*|ones\w*|full\w*|fill_|zero_|cat|stack|_to_copy|to|contiguous|"
               r"new_\w+|index_put_?|index_add_?|scatter\w*|gather|index_select|index|masked_fill_?|"
               r"where|pad|constant_pad_nd|split_with_sizes_copy|_foreach_copy_|resize_|set_)$"),
    ("view", r"::(view|_unsafe_view|reshape|as_strided|transpose|permute|slice|select|expand|t|unsqueeze|squeeze|"
             r"flatten|unflatten|narrow|split|split_with_sizes|chunk|unbind|detach|alias|view_as|expand_as|"
             r"_reshape_alias|unfold|movedim|numpy_T|lift_fresh)$"),
]


def op_category(name: str) -> str:
    for category, pattern in CATEGORIES:
        if re.search(pattern, name):
            return category
    return "elementwise" if name.startswith("aten::") else "other"


@dataclass
class GenerateOptions:
    """How to cut a spec out of a bundle (each option is documented in docs/traces.md)."""

    scope: str | None = None  # regex: keep ops with a matching scope (module, annotation) on their path
    op: str | None = None  # regex: keep ops whose name matches (e.g. "aten::(mm|addmm)")
    exclude_op: str | None = None  # regex: drop ops whose name matches
    steps: list[int] | None = None  # captured step indices to keep (default: all)
    window_ms: tuple[float, float] | None = None  # keep ops starting in [a, b) ms after their step began
    repeat: int = 1  # replay the selected ops this many times per step (scales the work)
    obfuscate: bool = False  # hash scope names, drop host/config details; op names stay (they must run)

    def __post_init__(self) -> None:
        for key in ("scope", "op", "exclude_op"):
            pattern = getattr(self, key)
            if pattern is not None:
                try:
                    re.compile(pattern)
                except re.error as err:
                    message = f"{pattern!r} is not a regular expression ({err})"
                    raise ValueError(f"invalid option '{key}': {message}") from None
        if self.repeat < 1:
            raise ValueError(f"invalid option 'repeat': got {self.repeat}, must be >= 1")
        if self.window_ms is not None and not self.window_ms[0] < self.window_ms[1]:
            raise ValueError(f"invalid option 'window_ms': {self.window_ms} must be (start, end) with start < end")


@dataclass
class Node:
    id: int
    name: str
    parent: int
    schema: str
    rf_id: int | None
    tid: int
    inputs: dict[str, list]
    outputs: dict[str, list]
    tensor_range: dict[str, list]


def _attrs(raw: dict[str, Any]) -> dict[str, Any]:
    return {a["name"]: a.get("value") for a in raw.get("attrs", []) if isinstance(a, dict) and "name" in a}


def parse_nodes(et: dict[str, Any], path: Path) -> dict[int, Node]:
    nodes: dict[int, Node] = {}
    for raw in et["nodes"]:
        try:
            attrs = _attrs(raw)
            ranges = attrs.get("tensor_range") or ""
            nodes[int(raw["id"])] = Node(
                id=int(raw["id"]),
                name=str(raw["name"]),
                parent=int(raw.get("ctrl_deps", 0)),
                schema=str(attrs.get("op_schema") or ""),
                rf_id=int(attrs["rf_id"]) if attrs.get("rf_id") is not None else None,
                tid=int(attrs.get("tid", 0)),
                inputs=raw.get("inputs") or {},
                outputs=raw.get("outputs") or {},
                tensor_range=json.loads(ranges) if ranges else {},
            )
        except (KeyError, TypeError, ValueError) as err:
            raise TraceError(f"{path}: malformed execution-trace node {str(raw)[:120]}: {err}") from None
    return nodes


def _kineto_events(kineto: Any, path: Path) -> tuple[dict[int, dict], list[dict]]:
    """Kineto ops by record-function id, and the step annotations."""
    if not isinstance(kineto, dict) or not isinstance(kineto.get("traceEvents"), list):
        raise TraceError(f"{path} is not a Kineto/chrome trace: expected an object with 'traceEvents'")
    by_rf: dict[int, dict] = {}
    steps: list[dict] = []
    for event in kineto["traceEvents"]:
        if not isinstance(event, dict) or event.get("ph") != "X":
            continue
        args = event.get("args") or {}
        rf = args.get("Record function id")
        if rf is not None:
            by_rf[int(rf)] = event
        if event.get("cat") == "user_annotation" and str(event.get("name", "")).startswith(STEP_ANNOTATION):
            steps.append(event)
    return by_rf, steps


def _ancestors(node: Node, nodes: dict[int, Node]) -> list[Node]:
    chain, seen = [], set()
    current = nodes.get(node.parent)
    while current is not None and current.id not in seen and current.id != node.id:
        seen.add(current.id)
        chain.append(current)
        if current.parent == current.id:
            break
        current = nodes.get(current.parent)
    return chain


def _framework_threads(nodes: dict[int, Node]) -> set[int]:
    """ET thread roots whose subtrees hold a step marker or autograd-engine work."""
    keep = set()
    for node in nodes.values():
        if node.name.startswith(STEP_ANNOTATION) or node.name.startswith("autograd::engine::"):
            roots = [a for a in _ancestors(node, nodes) if a.name == _THREAD_ROOT]
            keep.update(r.id for r in roots)
    return keep


def _keys(io: dict[str, list]) -> set[tuple]:
    """(tensor id, storage id, offset, shape) of every tensor an op reads or writes (the observer's ids
    come from object addresses, which are reused after frees: the id alone is not an identity)."""
    keys = set()
    for value, shape in zip(io.get("values", []), io.get("shapes", []), strict=False):
        if is_tensor_ref(value):
            keys.add((value[0], value[1], value[2], json.dumps(shape)))
        elif isinstance(value, list) and isinstance(shape, list):
            keys.update((v[0], v[1], v[2], json.dumps(sh)) for v, sh in zip(value, shape, strict=False)
                        if is_tensor_ref(v))
    return keys


def _is_composite(schema: str) -> bool:
    """Is this op implemented entirely by the ops it calls (CompositeImplicitAutograd)?"""
    qualified = schema.split("(", 1)[0]
    try:
        return bool(torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CompositeImplicitAutograd"))
    except RuntimeError:  # not registered in this process (e.g. a library not loaded): keep it whole
        return False


def _replay_level(nodes: dict[int, Node]) -> list[Node]:
    """The ops to replay: top-level ops, except that a composite op (one whose work is all done by the
    ops it calls) whose inner ops make a tensor a later op reads (e.g. attention's log-sum-exp, saved
    for backward) is replaced by its inner ops, so the replay makes that tensor instead of inventing it."""
    children: dict[int, list[Node]] = {}
    for node in nodes.values():
        if node.parent != node.id:
            children.setdefault(node.parent, []).append(node)
    readers: dict[tuple, list[int]] = {}
    for node in nodes.values():
        if node.schema:
            for key in _keys(node.inputs):
                readers.setdefault(key, []).append(node.id)

    def ops_below(node: Node) -> list[Node]:
        """The nearest ops with a schema under ``node`` (through record-function scopes)."""
        found = []
        for child in sorted(children.get(node.id, []), key=lambda n: n.id):
            found.extend([child] if child.schema else ops_below(child))
        return found

    def subtree(node: Node) -> list[Node]:
        out, stack = [], list(children.get(node.id, []))
        while stack:
            current = stack.pop()
            out.append(current)
            stack.extend(children.get(current.id, []))
        return out

    def escapes(node: Node) -> bool:
        if not _is_composite(node.schema):
            return False  # it has a kernel of its own: expanding it would drop that work
        inner = subtree(node)
        if not inner:
            return False
        last = max(n.id for n in inner)
        made_inside = set().union(*(_keys(n.outputs) for n in inner if n.schema)) - _keys(node.outputs)
        return any(reader > last for key in made_inside for reader in readers.get(key, ()))

    roots = [n for n in nodes.values() if n.schema and not any(a.schema for a in _ancestors(n, nodes))]
    level, work = [], sorted(roots, key=lambda n: n.id)
    while work:
        node = work.pop(0)
        below = ops_below(node) if escapes(node) else []
        if below:
            work = below + work
        else:
            level.append(node)
    return level


def _tensor_data(resources: Path, node: Node) -> dict[str, str]:
    """Tensor-input index → base64 of the raw integer data the ET observer saved for this op, if any.

    torch 2.13's observer copies ``numel × itemsize`` bytes from ``storage + offset`` with the offset
    in elements, not bytes: the data of a view that starts past its storage's first element is wrong,
    so it is dropped (the replay falls back to the recorded value range there).
    """
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


def _step_of(node: Node, ancestors: list[Node], event: dict | None, step_events: list[dict]) -> int | None:
    for a in ancestors:
        if a.name.startswith(STEP_ANNOTATION):
            return int(a.name[len(STEP_ANNOTATION):])
    if event is not None:  # another thread (e.g. CUDA's backward thread): place it by time
        ts = float(event["ts"])
        for s in step_events:
            if float(s["ts"]) <= ts < float(s["ts"]) + float(s["dur"]):
                return int(str(s["name"])[len(STEP_ANNOTATION):])
    return None


def _tensor_refs(values: Iterable[Any]) -> Iterable[list]:
    """Every tensor value ``[tensor_id, storage_id, offset, numel, itemsize, device]``, lists included."""
    for value in values:
        if is_tensor_ref(value):
            yield value
        elif isinstance(value, list):
            yield from _tensor_refs(value)


def is_tensor_ref(value: Any) -> bool:
    """Whether an ET value is a tensor reference: [tensor id, storage id, offset, numel, itemsize, device]."""
    return (isinstance(value, list) and len(value) == 6 and all(isinstance(v, int) for v in value[:5])
            and isinstance(value[5], str))


def extract_rank(bundle: Path) -> tuple[BundleMeta, list[dict[str, Any]], list[dict[str, Any]]]:
    """One rank's bundle → (meta, ops, steps), ops in execution order."""
    meta = read_meta(bundle)
    et_path, kineto_path = bundle / ET_FILE, bundle / KINETO_FILE
    et = read_json(et_path, "execution trace")
    check_et_schema(et, et_path)
    nodes = parse_nodes(et, et_path)
    kineto = read_json(kineto_path, "Kineto trace")
    by_rf, step_events = _kineto_events(kineto, kineto_path)
    if not any(n.name.startswith(STEP_ANNOTATION) for n in nodes.values()):
        raise TraceError(f"{et_path}: no captured steps (no '{STEP_ANNOTATION}<i>' markers); capture with "
                         f"harness.capture.capture() or `cobench trace capture`")
    threads = _framework_threads(nodes)
    ops = []
    for node in _replay_level(nodes):
        ancestors = _ancestors(node, nodes)
        if not any(a.id in threads for a in ancestors):
            continue  # a library worker thread's ops (part of a collective), not framework work
        event = by_rf.get(node.rf_id) if node.rf_id is not None else None
        step = _step_of(node, ancestors, event, step_events)
        if step is None:
            continue
        scopes = [a.name for a in reversed(ancestors)
                  if a.name not in (_THREAD_ROOT, _PROCESS_ROOT) and not a.name.startswith(STEP_ANNOTATION)]
        ops.append({
            "id": node.id,
            "name": node.name,
            "schema": node.schema,
            "step": step,
            "tid": node.tid,
            "scopes": scopes,
            "category": op_category(node.name),
            "inputs": node.inputs,
            "outputs": node.outputs,
            "tensor_range": node.tensor_range,
            "tensor_data": _tensor_data(bundle / ET_RESOURCES, node),
            "ts_us": float(event["ts"]) if event else None,
            "dur_us": float(event["dur"]) if event else None,
        })
    ops.sort(key=lambda o: (o["step"], o["ts_us"] if o["ts_us"] is not None else math.inf, o["id"]))
    steps = [{"index": int(str(e["name"])[len(STEP_ANNOTATION):]), "ts_us": float(e["ts"]),
              "traced_ms": float(e["dur"]) / 1e3} for e in sorted(step_events, key=lambda e: float(e["ts"]))]
    if not ops:
        raise TraceError(f"{et_path}: the captured steps contain no operators with a schema")
    _mark_source_releases(ops, kineto)
    timing_path = bundle / KINETO_TIMING_FILE
    gap, samples = None, []
    if timing_path.is_file():
        # plain steps of the same minutes as the Kineto ones where the bundle has them (older
        # bundles: the baseline's, taken before the traced phase)
        plain = meta.timing_plain_step_times_s or meta.step_times_s
        names = {op["name"] for op in ops}
        samples = list(kineto_host_gaps(read_json(timing_path, "Kineto timing trace"), timing_path,
                                        _plain_by_round(meta, plain), names.__contains__).values())
        gap = statistics.median(samples) if samples else None
    _place_host_gaps(ops, steps, gap)
    for step in steps:  # what the estimate rests on: a judgement resamples it (harness.judge)
        step["host_gap_samples_us"] = samples
    return meta, ops, steps


def _plain_by_round(meta: BundleMeta, plain: list[float]) -> dict[int | None, float]:
    """Each Kineto-alone step's plain reference (µs): the median of its own round's plain steps where the
    bundle records its rounds (a machine drifting between rounds then moves both alike), else of all."""
    timing, rounds = meta.timing_step_times_s, meta.timing_rounds
    every: dict[int | None, float] = {None: 1e6 * statistics.median(plain)}
    if rounds < 1 or not timing or len(timing) % rounds or len(plain) % rounds or plain is not \
            meta.timing_plain_step_times_s:
        return every
    measured, per_round = len(timing) // rounds, len(plain) // rounds
    return every | {i: 1e6 * statistics.median(plain[(i // measured) * per_round:(i // measured + 1) * per_round])
                    for i in range(len(timing))}


BORN_MIN_BYTES = 1024  # smaller buffers a program makes outside any op are held by the replay throughout


def _mark_source_releases(ops: list[dict[str, Any]], kineto: dict[str, Any]) -> None:
    """``allocated`` on each op: its new output storages seen allocated; ``released``: the storages the
    program freed after it and before the next op.

    From the allocator's events in the traced steps' Kineto trace (``profile_memory``): an allocation
    inside an op whose size is one of its new output storages' is that storage; the free at the
    same address, later, is placed after the last op that began before it. A program holds memory
    longer than its last use says (a backward formula's intermediates live until it returns, Python
    names until they are rebound): the replay frees each buffer when the program did, so the peak is
    the program's. Bundles captured without memory events get no ``released`` (the replay frees at
    last use).

    ``born`` on an op: storages the program allocated after it and before the next op, outside every
    replayed op (a compiled graph's own buffers: inductor allocates them without an op), that a later
    op of the step reads before any op writes them. Without it the replay would hold such a buffer
    (e.g. an activation a compiled forward saves for its backward) from the start as if it lived
    across steps; with it the replay makes the buffer when the program did. An allocation is matched
    to the first storage of its exact size that the step reads without having made or read it, and
    kept only if the program freed it within the traced steps and after that read (a temporary of the
    same size freed at once is not it; what lives on is state). Below
    :data:`BORN_MIN_BYTES` (scalars wrapped from Python numbers) the memory is immaterial and making it
    each step would cost the replay host time the program did not spend: those stay held throughout.
    """
    memory = sorted((e for e in kineto.get("traceEvents", []) if isinstance(e, dict) and e.get("name") == "[memory]"
                     and isinstance(e.get("args"), dict) and isinstance(e["args"].get("Bytes"), int)
                     and isinstance(e["args"].get("Addr"), int) and isinstance(e.get("ts"), int | float)),
                    key=lambda e: float(e["ts"]))
    timed = [op for op in ops if op["ts_us"] is not None and op["dur_us"] is not None]
    if not memory or not timed:
        return
    starts = [op["ts_us"] for op in timed]
    seen: set[int] = set()  # storages that existed before an op in its step: its inputs, earlier outputs
    fresh: list[dict[int, int]] = []  # per timed op: new output storage → bytes
    orphans: list[tuple[int, int, int]] = []  # (first reader, storage, bytes): read before made or read in a step
    for k, op in enumerate(timed):
        if k and op["step"] != timed[k - 1]["step"]:
            seen.clear()
        read: dict[int, int] = {}
        for ref in _tensor_refs(op["inputs"].get("values", [])):
            if ref[1] not in seen and ref[3] > 0:
                read[ref[1]] = max(read.get(ref[1], 0), (ref[2] + ref[3]) * ref[4])
        orphans.extend((k, sid, size) for sid, size in read.items())
        seen.update(ref[1] for ref in _tensor_refs(op["inputs"].get("values", [])))
        new: dict[int, int] = {}
        for ref in _tensor_refs(op["outputs"].get("values", [])):
            if ref[1] not in seen and ref[3] > 0:
                new[ref[1]] = max(new.get(ref[1], 0), (ref[2] + ref[3]) * ref[4])
            seen.add(ref[1])
        fresh.append(new)
    for op in ops:
        op["allocated"], op["released"], op["born"] = [], [], []
    owner: dict[int, int] = {}  # address → the storage allocated there, while it lives
    unconfirmed: dict[int, tuple[dict[str, Any], tuple[int, int, int]]] = {}  # address → (op, orphan) made between ops
    for event in memory:
        ts, addr, nbytes = float(event["ts"]), event["args"]["Addr"], event["args"]["Bytes"]
        at = bisect.bisect_right(starts, ts) - 1  # the last op that began before the event
        if at < 0:
            continue
        if nbytes > 0:
            op = timed[at]
            if ts <= op["ts_us"] + op["dur_us"]:
                storage = next((sid for sid, size in fresh[at].items() if size == nbytes), None)
                if storage is not None:
                    del fresh[at][storage]
                    owner[addr] = storage
                    op["allocated"].append(storage)
                continue
            # between ops: the first storage of this size the step reads later without having made it
            match = None if nbytes < BORN_MIN_BYTES else next((i for i, (reader, _, size) in enumerate(orphans)
                          if reader > at and size == nbytes and timed[reader]["step"] == op["step"]), None)
            if match is not None:
                unconfirmed[addr] = (op, orphans.pop(match))
        elif nbytes < 0 and addr in unconfirmed:
            made, orphan = unconfirmed.pop(addr)
            if at >= orphan[0]:  # alive when read and freed within the steps: the step's buffer, not state
                made["born"].append(orphan[1])
                timed[at]["released"].append(orphan[1])
            else:  # a temporary of that size, gone before the read: the storage may still match a later one
                bisect.insort(orphans, orphan)
        elif nbytes < 0 and addr in owner:
            timed[at]["released"].append(owner.pop(addr))


def kineto_host_gaps(timing: Any, path: Path, plain_us: dict[int | None, float],
                     replayed: Callable[[str], bool] | None = None) -> dict[int, float]:
    """Host time outside the replayed ops per annotated step (``cobench_step#<k>`` → µs), profiler removed.

    Under Kineto a step's main thread is either inside an op the replay runs (the top-most event whose
    name ``replayed`` accepts; every op when None) or not: Python, and framework work that is not an
    op of its own, such as the autograd engine's ``evaluate_function`` wrappers around backward ops
    (their self time is the program's host time: the replay calls the ops inside them directly).
    The profiler's own cost is about the same for every op event, c = (Kineto step − plain step) ÷
    the step's op events, and it lands outside the event it records (the timestamps are taken inside
    its callbacks): each event that is not inside a replayed op adds c to the host time; nested
    events add theirs inside their parent. The program's own host time is therefore the time outside
    replayed ops − those events × c. ``plain_us`` gives the uninstrumented step time per step index
    (the ``None`` key for every step).
    """
    if not isinstance(timing, dict) or not isinstance(timing.get("traceEvents"), list):
        raise TraceError(f"{path} is not a Kineto/chrome trace: expected an object with 'traceEvents'")
    events = [e for e in timing["traceEvents"] if isinstance(e, dict) and e.get("ph") == "X"]
    steps = [e for e in events if e.get("cat") == "user_annotation"
             and str(e.get("name", "")).startswith(STEP_ANNOTATION)]
    # parents before their children: by start, the longer first
    ops = sorted((e for e in events if e.get("cat") == "cpu_op"), key=lambda e: (float(e["ts"]), -float(e["dur"])))
    gaps: dict[int, float] = {}
    for step in steps:
        index = int(str(step["name"])[len(STEP_ANNOTATION):])
        plain = plain_us.get(index, plain_us.get(None))
        start, dur, tid = float(step["ts"]), float(step["dur"]), step.get("tid")
        busy, covered_until, outside, every = 0.0, start, 0, 0
        for e in ops:
            ts = float(e["ts"])
            if ts < start or ts >= start + dur:
                continue
            every += 1
            if e.get("tid") != tid or ts < covered_until:
                continue  # another thread's, or inside a replayed op already counted
            outside += 1
            if replayed is None or replayed(str(e.get("name", ""))):
                busy += float(e["dur"])
                covered_until = ts + float(e["dur"])
        if dur > 0 and every and plain is not None:
            per_event = max(0.0, dur - plain) / every
            gaps[index] = max(0.0, dur - busy - outside * per_event)
    return gaps


def _place_host_gaps(ops: list[dict], steps: list[dict], per_step_us: float | None) -> None:
    """Spread the measured host time per step over the gaps between ops (``gap_us`` before each op,
    ``tail_gap_us`` after a step's last), in proportion to the gaps the traced steps show."""
    for step in steps:
        members = [op for op in ops if op["step"] == step["index"]]
        main_tid = members[0]["tid"] if members else None
        start, end = step["ts_us"], step["ts_us"] + 1e3 * step["traced_ms"]
        weights, previous_end = [], start
        for op in members:
            if op["tid"] != main_tid or op["ts_us"] is None:
                weights.append(0.0)  # another thread's gaps (e.g. CUDA's backward) overlap the main one's
                continue
            weights.append(max(0.0, op["ts_us"] - previous_end))
            previous_end = max(previous_end, op["ts_us"] + (op["dur_us"] or 0.0))
        tail = max(0.0, end - previous_end)
        total = sum(weights) + tail
        scale = (per_step_us or 0.0) / total if total > 0 else 0.0
        for op, weight in zip(members, weights, strict=True):
            op["gap_us"] = weight * scale
        step["tail_gap_us"] = tail * scale
        step["host_gap_us"] = per_step_us or 0.0


def _add_dependencies(ops: list[dict[str, Any]]) -> None:
    """``deps``: the ops (by position) whose outputs each op reads — the data-dependency edges."""
    producer: dict[int, int] = {}
    for index, op in enumerate(ops):
        deps = {producer[ref[0]] for ref in _tensor_refs(op["inputs"].get("values", [])) if ref[0] in producer}
        op["deps"] = sorted(deps)
        for ref in _tensor_refs(op["outputs"].get("values", [])):
            producer[ref[0]] = index


def _select(ops: list[dict], steps: list[dict], options: GenerateOptions) -> list[dict]:
    step_start = {s["index"]: s["ts_us"] for s in steps}
    kept = []
    for op in ops:
        if options.steps is not None and op["step"] not in options.steps:
            continue
        if options.op and not re.search(options.op, op["name"]):
            continue
        if options.exclude_op and re.search(options.exclude_op, op["name"]):
            continue
        if options.scope and not any(re.search(options.scope, s) for s in op["scopes"]):
            continue
        if options.window_ms is not None:
            if op["ts_us"] is None or op["step"] not in step_start:
                continue
            offset_ms = (op["ts_us"] - step_start[op["step"]]) / 1e3
            if not options.window_ms[0] <= offset_ms < options.window_ms[1]:
                continue
        kept.append(op)
    return kept


def _obfuscated(name: str) -> str:
    if name.startswith(("autograd::engine::", "Optimizer.", "## ")):
        return name  # framework scopes, not the user's names
    return "scope_" + hashlib.sha256(name.encode()).hexdigest()[:10]


def generate_spec(bundle: str | Path, options: GenerateOptions | None = None) -> dict[str, Any]:
    """Read a (possibly multi-rank) bundle and return the spec as a JSON-ready dict."""
    options = options or GenerateOptions()
    full_step = (options.scope is None and options.op is None and options.exclude_op is None
                 and options.window_ms is None and options.repeat == 1)
    ranks = []
    metas = []
    for rank_dir in rank_dirs(Path(bundle)):
        meta, ops, steps = extract_rank(rank_dir)
        original_count = len(ops)
        for step in steps:  # every captured op's time: the denominator when only a part is replayed
            step["ops_dur_us"] = sum(op["dur_us"] or 0.0 for op in ops if op["step"] == step["index"])
        ops = _select(ops, steps, options)
        if not ops:
            raise TraceError(f"{rank_dir}: the selection {options} keeps no operators (of {original_count})")
        _add_dependencies(ops)
        if options.obfuscate:  # the program's names and its data go; shapes, ranges and timings stay
            for op in ops:
                op["scopes"] = [_obfuscated(s) for s in op["scopes"]]
                op["tensor_data"] = {}
        kept_steps = sorted({op["step"] for op in ops})
        ranks.append({
            "rank": meta.rank,
            "ops": ops,
            "steps": [s for s in steps if s["index"] in kept_steps],
            "selected_ops": len(ops),
            "captured_ops": original_count,
            # what the step's own floating inputs held; a part of a step reads other tensors than those
            "external_values": read_json(rank_dir / VALUES_FILE, "value profile")
            if full_step and (rank_dir / VALUES_FILE).is_file() else [],
        })
        metas.append(meta)
    meta = metas[0]
    platform = dict(meta.platform)
    if options.obfuscate:
        platform.pop("host", None)
    return {
        "schema": SPEC_SCHEMA,
        "source": {
            "bundle": "" if options.obfuscate else str(Path(bundle).resolve()),
            "workload": meta.source,
            "run_id": meta.source_run_id,
            "config": {} if options.obfuscate else meta.config,
            "platform": platform,
            "world_size": meta.world_size,
            "step_times_ms": [[1e3 * t for t in m.step_times_s] for m in metas],
            "traced_step_times_ms": [[1e3 * t for t in m.traced_step_times_s] for m in metas],
            "capture_overhead_pct": [m.capture_overhead_pct for m in metas],
            "peak_memory_bytes": [m.peak_memory_bytes for m in metas],
        },
        "options": {
            "scope": options.scope, "op": options.op, "exclude_op": options.exclude_op, "steps": options.steps,
            "window_ms": list(options.window_ms) if options.window_ms else None, "repeat": options.repeat,
            "obfuscate": options.obfuscate,
        },
        "full_step": full_step,
        "ranks": ranks,
    }


def write_spec(spec: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(spec, separators=(",", ":")))
    return path


def load_spec(path: str | Path) -> dict[str, Any]:
    """Read and check a spec file; errors name the file and the problem."""
    path = Path(path)
    spec = read_json(path, "generated benchmark spec")
    if not isinstance(spec, dict) or spec.get("schema") != SPEC_SCHEMA:
        found = spec.get("schema") if isinstance(spec, dict) else type(spec).__name__
        raise TraceError(f"{path}: spec schema {found!r} is not supported; supported: {SPEC_SCHEMA!r} "
                         f"(make one with `cobench trace generate BUNDLE`)")
    ranks = spec.get("ranks")
    if not isinstance(ranks, list) or not ranks or not all(isinstance(r, dict) and r.get("ops") for r in ranks):
        raise TraceError(f"{path}: the spec holds no operators")
    return spec
