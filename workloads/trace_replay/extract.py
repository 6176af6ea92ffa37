"""The ops a replay runs, cut out of one rank's parsed trace (:class:`.parse.BundleTrace`), in execution order.

Which ops: the *top-level* operators of each captured step — operators with a schema (``aten::``,
``c10d::``, ``fbgemm::`` …) none of whose ancestors is itself such an operator. Their children run
inside them, so replaying them too would count their time twice. Record-function scopes (the step
marker, ``## forward ##``, module names, ``autograd::engine::evaluate_function: …``,
``Optimizer.step#…``) are kept as each op's scope path, for selection. Ops of threads that run no
framework work (e.g. a communication library's worker thread, whose copies are part of a
collective) are left out; a backward thread (autograd engine) is kept.

Each op keeps its schema, the ET's inputs/outputs (values, shapes, types, strides: storage ids and
offsets, so views share storage on replay), the integer value ranges the ET recorded, the integer
data it saved, its category and its original duration joined from Kineto on ``rf_id``; then the
program's allocations and frees around it (:mod:`.allocations`) and its host time before it
(:mod:`.host_time`). :func:`add_dependencies` adds the data-dependency edges of a selection.
"""

from __future__ import annotations

import bisect
import json
import math
import re
import statistics
from typing import Any

import torch

from workloads.trace_bundle import ET_FILE, STEP_ANNOTATION, TraceError
from workloads.trace_replay.allocations import mark_source_releases
from workloads.trace_replay.host_time import (
    COLLECTIVE,
    at_one_speed,
    host_gap_shape,
    measured_host_gaps,
    op_names,
    place_host_gaps,
    step_op_counts,
)
from workloads.trace_replay.parse import (
    BundleTrace,
    KinetoEvent,
    Node,
    is_tensor_ref,
    recorded_tensor_data,
    step_index,
    tensor_refs,
)
from workloads.trace_replay.sparse import refuse_unmade_sparse

_THREAD_ROOT = "[pytorch|profiler|execution_trace|thread]"
_PROCESS_ROOT = "[pytorch|profiler|execution_trace|process]"
_EVALUATE_FUNCTION = "autograd::engine::evaluate_function"  # a backward node's run, under its forward op's number
# A composite whose inner results are read later is replaced by its inner ops unless they come to this many
# replayed ops or more: the GRU tagger's `aten::gru` (two layers of 24 steps) came to 690 small ops a call,
# which the replay called one by one from Python where the program called them from C++ (docs/traces.md,
# "Generate": measured both ways); attention's composites come to one or two.
WHOLE_MIN_OPS = 64

# Op categories for the time breakdown; the first pattern that matches the op's name wins.
CATEGORIES: list[tuple[str, str]] = [
    ("comm", COLLECTIVE.pattern),
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
    """An op's category in the time breakdown (:data:`CATEGORIES`)."""
    for category, pattern in CATEGORIES:
        if re.search(pattern, name):
            return category
    return "elementwise" if name.startswith("aten::") else "other"


def ancestors(node: Node, nodes: dict[int, Node]) -> list[Node]:
    """The scopes and ops ``node`` runs inside, innermost first."""
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
            roots = [a for a in ancestors(node, nodes) if a.name == _THREAD_ROOT]
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


def _replay_level(nodes: dict[int, Node]) -> tuple[list[Node], dict[int, set[int]]]:
    """The ops to replay: top-level ops, except that a composite op (one whose work is all done by the
    ops it calls) whose inner ops make a tensor a later op reads (e.g. attention's log-sum-exp, saved
    for backward) is replaced by its inner ops, so the replay makes that tensor instead of inventing it;
    and the composites kept whole although they make such tensors: those that would be replaced by
    :data:`WHOLE_MIN_OPS` ops or more (a recurrent layer's ``aten::gru`` calls its cell's small ops from
    C++, which the replay would call one by one from Python), by id, each with the storages its inner ops
    made. What such an op made inside it and still held when it returned is made right after it
    (:mod:`.allocations`: ``held_bytes``), of those storages only."""
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

    def expanded(node: Node) -> list[Node]:
        """The ops ``node`` would be replaced by (none: kept as it is)."""
        return ops_below(node) if escapes(node) else []

    counted: dict[int, int] = {}

    def count(node: Node) -> int:
        if node.id not in counted:
            below = expanded(node)
            counted[node.id] = sum(count(n) for n in below) if below else 1
        return counted[node.id]

    roots = [n for n in nodes.values() if n.schema and not any(a.schema for a in ancestors(n, nodes))]
    level, work = [], sorted(roots, key=lambda n: n.id)
    whole: dict[int, set[int]] = {}
    while work:
        node = work.pop(0)
        below = expanded(node)
        if below and sum(count(n) for n in below) >= WHOLE_MIN_OPS:
            whole[node.id] = {key[1] for n in subtree(node) if n.schema for key in _keys(n.outputs)}
            below = []
        if below:
            work = below + work
        else:
            level.append(node)
    return level, whole


def _step_of(node: Node, chain: list[Node], event: KinetoEvent | None, step_events: list[KinetoEvent]) -> int | None:
    for a in chain:
        if a.name.startswith(STEP_ANNOTATION):
            return int(a.name[len(STEP_ANNOTATION):])
    if event is not None:  # another thread (e.g. CUDA's backward thread): place it by time
        for s in step_events:
            if s.ts <= event.ts < s.ts + s.dur:
                return step_index(s)
    return None


# The execution trace writes a float input with six decimals (AdamW's eps of 1e-8 reads 0.0, its learning rate of
# 0.0029627 reads 0.002963); the profiler's own record of the op's scalar inputs holds them whole
ET_DOUBLE_DECIMALS = 6


def precise_doubles(inputs: dict[str, list], event: KinetoEvent | None) -> dict[str, list]:
    """An op's inputs with each float (``Double``) the execution trace rounded to :data:`ET_DOUBLE_DECIMALS`
    decimals put back at the precision its Kineto event recorded (``Concrete Inputs``, joined on ``rf_id``),
    where the two agree to that rounding; as recorded otherwise. A replay of AdamW with its eps read as 0.0
    divided a zero moment by zero: 63 of llama's replayed carried tensors held NaN after one pass over its three
    steps."""
    concrete = event.concrete if event is not None else None
    types, values = inputs.get("types"), inputs.get("values")
    if not concrete or not isinstance(types, list) or not isinstance(values, list) or \
            not len(concrete) == len(types) == len(values):
        return inputs
    fixed = list(values)
    for i, (kind, value, text) in enumerate(zip(types, values, concrete, strict=True)):
        if kind != "Double" or isinstance(value, bool) or not isinstance(value, int | float) or not text:
            continue
        try:
            precise = float(text)
        except ValueError:
            continue
        if math.isfinite(precise) and round(precise, ET_DOUBLE_DECIMALS) == round(float(value), ET_DOUBLE_DECIMALS):
            fixed[i] = precise
    return {**inputs, "values": fixed}


def _recorded_history(level: list[Node], nodes: dict[int, Node]) -> set[int]:
    """The ids of the replay-level ops that recorded autograd history: those whose history a backward in the trace
    evaluated. Under grad mode every op carries the autograd sequence number it would take (``seq_id``), and an
    op that records history takes it, the next op then carrying the next; a backward's node carries its forward
    op's. An op recorded history where a backward node carries a number from its own up to the next op's (an op
    on tensors that require no grad carries the number the op after it takes). A step with no backward in the
    trace recorded none that this can tell."""
    backward = sorted({n.seq_id for n in nodes.values() if n.seq_id is not None and _is_backward(n.name)})
    forward = sorted((n.seq_id, n.id) for n in level if n.seq_id is not None and not _is_backward(n.name))
    recorded = set()
    for i, (seq, node_id) in enumerate(forward):
        until = forward[i + 1][0] if i + 1 < len(forward) else math.inf
        at = bisect.bisect_left(backward, seq)
        if at < len(backward) and backward[at] < until:
            recorded.add(node_id)
    return recorded


def _is_backward(name: str) -> bool:
    return "backward" in name.lower() or name.startswith(_EVALUATE_FUNCTION)


def _captured_ops(trace: BundleTrace) -> tuple[list[dict[str, Any]], dict[int, set[int]]]:
    """The replay-level ops of the captured steps with what the trace says of each, in execution order, and
    the composites kept whole among them, by id, each with the storages its inner ops made."""
    nodes, by_rf, step_events = trace.nodes, trace.kineto.by_rf_id(), trace.kineto.steps
    threads = _framework_threads(nodes)
    ops = []
    level, whole = _replay_level(nodes)
    recorded = _recorded_history(level, nodes)
    for node in level:
        chain = ancestors(node, nodes)
        if not any(a.id in threads for a in chain):
            continue  # a library worker thread's ops (part of a collective), not framework work
        event = by_rf.get(node.rf_id) if node.rf_id is not None else None
        step = _step_of(node, chain, event, step_events)
        if step is None:
            continue
        scopes = [a.name for a in reversed(chain)
                  if a.name not in (_THREAD_ROOT, _PROCESS_ROOT) and not a.name.startswith(STEP_ANNOTATION)]
        ops.append({
            "id": node.id,
            "name": node.name,
            "schema": node.schema,
            "step": step,
            "tid": node.tid,
            "scopes": scopes,
            "category": op_category(node.name),
            "inputs": precise_doubles(node.inputs, event),
            "outputs": node.outputs,
            "tensor_range": node.tensor_range,
            "tensor_data": recorded_tensor_data(trace.path, node),
            "ts_us": event.ts if event else None,
            "dur_us": event.dur if event else None,
            # the program recorded autograd history through it (a backward evaluated it): the replay records it
            # too, or measures its bookkeeping and spends it (workloads/trace_replay/execute.py)
            "grad": node.id in recorded,
            **({"held_bytes": 0} if node.id in whole else {}),  # set from the allocator's events
        })
    ops.sort(key=lambda o: (o["step"], o["ts_us"] if o["ts_us"] is not None else math.inf, o["id"]))
    return ops, whole


def extract_rank(trace: BundleTrace) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """One rank's parsed bundle → (ops, steps), ops in execution order, as the spec holds them."""
    et_path = trace.path / ET_FILE
    if not any(n.name.startswith(STEP_ANNOTATION) for n in trace.nodes.values()):
        raise TraceError(f"{et_path}: no captured steps (no '{STEP_ANNOTATION}<i>' markers); capture with "
                         f"harness.traces.capture.capture() or `cobench trace capture`")
    ops, whole = _captured_ops(trace)
    refuse_unmade_sparse(ops, et_path)
    steps = [{"index": step_index(e), "ts_us": e.ts, "traced_ms": e.dur / 1e3}
             for e in sorted(trace.kineto.steps, key=lambda e: e.ts)]
    if not ops:
        raise TraceError(f"{et_path}: the captured steps contain no operators with a schema")
    mark_source_releases(ops, trace.kineto.memory, whole)
    replayed = {op["name"] for op in ops}
    # and how long the ops took meanwhile, which a replay sets its own against (Replayer.op_time_ratio)
    measured, op_us = measured_host_gaps(trace, replayed)
    # at one speed of the capture's host (which a replay scales by its own host's speed against it)
    speed = at_one_speed(measured, trace.meta)
    samples = speed.samples_us
    place_host_gaps(ops, steps, statistics.median(samples) if samples else None, host_gap_shape(trace, replayed))
    # How many ops each traced step ran against the program's steps timed after them (as the profiler saw
    # both): a program whose steps differ by chance (a layer dropped at random) may have been traced on
    # steps unlike its own, whose replay then says nothing about the program's time.
    # (counted as the capture counted them when it chose to trace them again: step_op_counts)
    traced = step_op_counts(trace.kineto, op_names(trace.timing)) if trace.timing is not None else {}
    timed = list(step_op_counts(trace.timing).values()) if trace.timing is not None else []
    for step in steps:  # what the estimate rests on: a judgement resamples it (harness.traces.judge)
        step["host_gap_samples_us"] = samples
        step["kineto_ops"] = traced.get(step["index"], 0)
        step["program_kineto_ops"] = statistics.fmean(timed) if timed else 0.0
        step["program_op_us"] = statistics.median(op_us) if op_us else 0.0
        step["host_spin_ns"] = speed.reference_ns
        if speed.elasticity is not None:
            step["host_speed_elasticity"] = speed.elasticity
    return ops, steps


def add_dependencies(ops: list[dict[str, Any]]) -> None:
    """``deps``: the ops (by position) whose outputs each op reads — the data-dependency edges."""
    producer: dict[int, int] = {}
    for index, op in enumerate(ops):
        deps = {producer[ref[0]] for ref in tensor_refs(op["inputs"].get("values", [])) if ref[0] in producer}
        op["deps"] = sorted(deps)
        for ref in tensor_refs(op["outputs"].get("values", [])):
            producer[ref[0]] = index
