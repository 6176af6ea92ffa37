"""The execution graph of one captured step, read from a trace bundle: what what-if prediction edits.

Nodes are the ops a replay would run (``workloads.trace_replay.extract``: the execution trace joined with
its Kineto trace), in host order, each with

- its duration from the steps the capture ran under Kineto alone, matched op by op, less Kineto's own
  cost per recorded event (measured from the bundle: Kineto-alone step − plain step, over the events of
  a step; the execution-trace observer's cost, ~15 µs an event and uneven, is why its own durations are
  not used but as a fallback);
- the program's host time before it (``gap_us``, from the capture's Kineto-alone steps against its
  plain steps), its data dependencies, category and input shapes;
- the module and forward op it belongs to: forward ops by their ``nn.Module`` scope, backward ops through
  their autograd node's sequence number to the forward op that made it (Lumos: forward joins backward on
  ``seq_id``); :meth:`Graph.assign_layers` then finds the repeated layers.

On a CPU one host thread runs every op, so the critical path is host order, with each op also waiting
for the ops whose outputs it reads; :func:`schedule` replays that and splits the step into compute by
category, communication and host time.
"""

from __future__ import annotations

import statistics
from bisect import bisect_left
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workloads.trace_bundle import BundleMeta, TraceError
from workloads.trace_replay.extract import add_dependencies, extract_rank
from workloads.trace_replay.parse import KinetoTrace, Node, is_tensor_ref, read_bundle

COMM_CATEGORIES = ("communication",)
MIN_LAYER_OPS = 4  # a repeated layer has at least this many forward ops (fewer: q/k/v-like repeats inside one)
# the layers hold at least this share of the forward ops' time: a repeat inside one layer (its q, k and v
# projections) holds far less (tiny Llama: layers 79 %, q/k/v 5 %; DLRM's cross network 37 %)
MIN_LAYER_SHARE = 0.15


@dataclass(frozen=True)
class TensorUse:
    """A tensor an op reads or writes: its shape, element size, and whether it lives across steps
    (a parameter or optimizer state: its shape does not follow the batch)."""

    shape: tuple[int, ...]
    itemsize: int
    persistent: bool


@dataclass
class Op:
    """One node of the graph."""

    id: int
    name: str
    category: str
    dur_us: float  # tracer cost taken out
    gap_us: float  # the program's host time before it
    shapes: list[Any]
    deps: list[int] = field(default_factory=list)
    layer: tuple[str, int] | None = None  # (stack name, index), e.g. ("layers", 3); None: outside the stack
    layer_share: float = 1.0  # for optimizer ops: the share of their work that belongs to the layers
    inputs: list[TensorUse] = field(default_factory=list)
    outputs: list[TensorUse] = field(default_factory=list)
    module: str | None = None  # innermost nn.Module (a backward op: its forward op's)
    anchor: int | None = None  # the forward op (ET node with a sequence number) it belongs to
    backward: bool = False
    scopes: list[str] = field(default_factory=list)


@dataclass
class Graph:
    """One step of a captured program as a graph, with what it was measured at."""

    workload: str
    config: dict[str, Any]
    ops: list[Op]
    tail_gap_us: float
    measured_step_ms: float  # the plain (untraced) step's median
    tracer_cost_us: tuple[float, float]  # per event: execution-trace observer, Kineto
    platform: dict[str, Any]
    # the plain steps run between the Kineto-alone ones the op times come from (the same minutes; the traced
    # step's batch where the workload holds it, :meth:`workloads.base.WorkloadBase.hold_batch`): what the
    # unchanged graph's replay is judged against
    replay_reference_ms: float | None = None

    def workload_config(self, overrides: dict[str, Any] | None = None) -> Any:
        """The captured workload's config object — its registered schema over the recorded values, with
        ``overrides`` — or None where this version cannot build it (an unknown workload, a foreign config)."""
        from omegaconf import OmegaConf

        from workloads import discover

        raw = dict(self.config.get("workload") or {})
        spec = discover().get(str(raw.get("name", "")))
        if spec is None:
            return None
        try:
            return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(spec.config_class), raw,
                                                       overrides or {}))
        except Exception:  # noqa: BLE001 - a config this version cannot read
            return None

    @property
    def stacks(self) -> Counter:
        """Module lists with an index in their path: name → how many were seen (``layers.0`` …
        ``layers.3`` → {"layers": 4}); a layer stack is among them, or is one module that repeats."""
        found: dict[str, set[int]] = defaultdict(set)
        for op in self.ops:
            indexed = _layer_of([f"nn.Module: {op.module}"]) if op.module else None
            if indexed is not None:
                found[indexed[0]].add(indexed[1])
        return Counter({name: len(indices) for name, indices in found.items() if len(indices) > 1})

    def assign_layers(self, count: int | None) -> tuple[str, int]:
        """Mark every op with its layer among ``count`` repeated layers (None: the size of the module
        list ``<name>.<i>`` with the most time). The layers are found in the step's forward ops as the
        longest stretch of ``count`` identical consecutive blocks (by op name): that holds whether a layer
        is a module of a list (Llama), work its parent does per layer (seqrec's attention) or a loop in
        one module (DLRM's cross network). Without such a stretch, the module list itself. Backward ops
        follow their forward op; a gradient's accumulation follows the op that made it; work over every
        parameter at once is shared by parameter count. Returns (where the layers are, how many)."""
        time_in: dict[str, float] = defaultdict(float)
        for op in self.ops:
            indexed = _layer_of([f"nn.Module: {op.module}"]) if op.module else None
            if indexed is not None:
                time_in[indexed[0]] += op.dur_us
        lists = {name: n for name, n in self.stacks.items() if count is None or n == count}
        if count is None and lists:
            count = self.stacks[max(lists, key=lambda name: time_in[name])]
        by_list: dict[int, tuple[str, int]] = {}
        if lists:  # ops anywhere under <list>.<i> (its sub-modules' own lists included)
            listed = max(lists, key=lambda name: time_in[name])
            for op in self.ops:
                rest = op.module[len(listed) + 1:] if op.module and op.module.startswith(f"{listed}.") else ""
                head = rest.split(".")[0]
                if head.isdigit():
                    by_list[op.id] = (listed, int(head))
        found = self._repeated_stretch(count) if count and count >= 2 else None
        if found is not None:
            stack, layers = found
            # the module list's ops the stretch did not reach (no forward op of theirs) — only when the
            # stretch and that list are one place (one's path inside the other's): DLRM's 3 cross layers
            # loop in one module, and its bottom MLP's 3 linear layers (a module list of the same length)
            # are not among them
            same = any(f"{stack}.".startswith(f"{name}.") or f"{name}.".startswith(f"{stack}.") for name in lists)
            for op in self.ops if same else []:
                if op.layer is None and op.id in by_list:
                    op.layer = (stack, by_list[op.id][1])
        elif lists:
            stack, layers = listed, self.stacks[listed]
            for op in self.ops:
                op.layer = by_list.get(op.id)
        else:
            raise ValueError(f"found no {count} repeated layers in the captured step: no {count} identical "
                             f"consecutive blocks of forward ops and no module list of {count} (seen: "
                             f"{dict(self.stacks) or 'none'})")
        _share_optimizer_ops(self.ops)
        return stack, layers

    def _repeated_stretch(self, count: int) -> tuple[str, int] | None:
        forward = [op for op in self.ops if not op.backward and op.anchor is not None]
        names = [op.name for op in forward]
        n = len(names)
        total = sum(op.dur_us for op in forward) or 1.0
        for period in range(n // count, MIN_LAYER_OPS - 1, -1):
            for start in range(0, n - period * count + 1):
                if all(names[start + k] == names[start + k + period * j]
                       for j in range(1, count) for k in range(period)) and \
                        sum(op.dur_us for op in forward[start: start + period * count]) >= MIN_LAYER_SHARE * total:
                    layer_of_anchor: dict[int, int] = {}
                    for j in range(count):
                        for op in forward[start + j * period: start + (j + 1) * period]:
                            layer_of_anchor.setdefault(op.anchor, j)
                    modules = {op.module for op in forward[start: start + period * count] if op.module}
                    where = _common_prefix(sorted(modules)) or "forward ops"
                    for op in self.ops:
                        index = layer_of_anchor.get(op.anchor) if op.anchor is not None else None
                        op.layer = (where, index) if index is not None else None
                    return where, count
        return None


def _common_prefix(paths: list[str]) -> str:
    if not paths:
        return ""
    parts = [p.split(".") for p in paths]
    common = []
    for column in zip(*parts, strict=False):
        if len(set(column)) != 1 or column[0].isdigit():
            break
        common.append(column[0])
    return ".".join(common)


def _layer_of(scopes: list[str]) -> tuple[str, int] | None:
    """The innermost ``<stack>.<i>`` module in an op's scopes (``nn.Module: layers.3.attention`` → layers, 3)."""
    for scope in reversed(scopes):
        if not scope.startswith("nn.Module: "):
            continue
        parts = scope.removeprefix("nn.Module: ").split(".")
        for i in range(len(parts) - 1, 0, -1):
            if parts[i].isdigit():
                return ".".join(parts[:i]), int(parts[i])
    return None


class _NodeTree:
    """The execution trace's node tree, read for what each op belongs to: its scopes, module and forward op."""

    def __init__(self, nodes: dict[int, Node]):
        self.nodes = nodes
        self.children: dict[int, list[int]] = defaultdict(list)
        for i, node in nodes.items():
            if node.parent != i:
                self.children[node.parent].append(i)
        # forward ops by sequence number: a backward op's autograd node carries its forward op's seq_id
        self.forward_by_seq: dict[int, int] = {}
        for i, node in nodes.items():
            if node.seq_id is not None and "Backward" not in node.name:
                self.forward_by_seq.setdefault(node.seq_id, i)

    def _parent(self, i: int) -> int | None:
        return self.nodes[i].parent if i in self.nodes else None

    def descendants(self, i: int) -> int:
        count, todo = 0, list(self.children.get(i, ()))
        while todo:
            j = todo.pop()
            count += 1
            todo.extend(self.children.get(j, ()))
        return count

    def scopes_of(self, i: int) -> list[str]:
        chain, seen = [], set()
        j = self._parent(i)
        while j is not None and j in self.nodes and j not in seen and j != 0:
            seen.add(j)
            chain.append(self.nodes[j].name)
            j = self._parent(j)
        return list(reversed(chain))

    def anchor_of(self, i: int) -> tuple[int | None, bool]:
        """The forward op (ET node with a sequence number) an op belongs to, and whether the op is in
        backward: a forward op's own or nearest ancestor's; a backward op's autograd node's forward op."""
        nodes = self.nodes
        j, seen = i, set()
        while j in nodes and j not in seen and j != 0:
            seen.add(j)
            engine = nodes[j].name.startswith("autograd::engine::evaluate_function")
            # the engine's own work for a node sits beside the node
            candidates = [j, *self.children.get(j, [])] if engine else [j]
            for k in candidates:
                # the autograd node: ``XBackward0``, or a C++ custom function's ``CppNode<...>``
                if ("Backward" in nodes[k].name or (engine and k != j)) and nodes[k].seq_id is not None:
                    return self.forward_by_seq.get(nodes[k].seq_id), True
            j = nodes[j].parent
        j, seen = i, set()
        while j in nodes and j not in seen and j != 0:
            seen.add(j)
            if nodes[j].seq_id is not None and "Backward" not in nodes[j].name:
                return j, False
            j = nodes[j].parent
        return None, False

    def module_of(self, i: int) -> str | None:
        """The innermost ``nn.Module`` an ET node runs in (its path, e.g. ``layers.3.attention``)."""
        for scope in reversed(self.scopes_of(i)):
            if scope.startswith("nn.Module: "):
                return scope.removeprefix("nn.Module: ")
        return None


@dataclass(frozen=True)
class _TracerCosts:
    """The step times a bundle records, and the tracers' cost per recorded event they imply."""

    plain_ms: float  # the plain steps' median
    plain_near_ms: float  # the plain steps run between the Kineto-alone ones
    et_us: float  # the execution-trace observer's, per event
    kineto_us: float  # Kineto's, per event


def _tracer_costs(meta: BundleMeta, events_per_step: float) -> _TracerCosts:
    """The tracer's cost per recorded event, from the bundle's own three timings."""
    plain_ms = statistics.median(meta.step_times_s) * 1e3
    traced_ms = statistics.median(meta.traced_step_times_s) * 1e3
    kineto_ms = statistics.median(meta.timing_step_times_s) * 1e3 if meta.timing_step_times_s else plain_ms
    plain_near_ms = statistics.median(meta.timing_plain_step_times_s) * 1e3 if meta.timing_plain_step_times_s \
        else plain_ms
    return _TracerCosts(plain_ms, plain_near_ms, max(0.0, (traced_ms - kineto_ms) * 1e3 / events_per_step),
                        max(0.0, (kineto_ms - plain_near_ms) * 1e3 / events_per_step))


def _graph_ops(chosen_ops: list[dict[str, Any]], tree: _NodeTree, alone: list[float] | None,
               costs: _TracerCosts) -> list[Op]:
    """The step's spec ops as graph nodes: tracer cost taken out of their times, each with its tensors,
    module and forward op."""
    # a tensor lives across steps (a parameter, optimizer state, the prepared data) when no earlier op of
    # the step made its storage: storage ids are recycled by the allocator step after step, so their
    # reappearance says nothing; what the step itself produced is an activation or a gradient
    produced: set[Any] = set()

    def uses(io: dict[str, Any], persistent_inputs: set[Any] | None = None) -> list[TensorUse]:
        found = []
        for value, shape in zip(io.get("values", []), io.get("shapes", []), strict=False):
            if is_tensor_ref(value) and isinstance(shape, list) and all(isinstance(d, int) for d in shape):
                lives = value[1] in persistent_inputs if persistent_inputs is not None else value[1] not in produced
                found.append(TensorUse(tuple(shape), int(value[4]), lives))
        return found

    ops = []
    for k, raw in enumerate(chosen_ops):
        inner = 1 + tree.descendants(int(raw["id"]))
        if alone is not None:  # the same op in the steps run under Kineto alone, less Kineto's own cost
            dur = max(alone[k] - costs.kineto_us * inner, 0.5 * alone[k])
        else:
            traced = float(raw.get("dur_us") or 0.0)
            dur = max(traced - (costs.et_us + costs.kineto_us) * inner, 0.05 * traced)
        read = uses(raw.get("inputs") or {})
        in_values = [v for v in (raw.get("inputs") or {}).get("values", []) if is_tensor_ref(v)]
        out_values = [v for v in (raw.get("outputs") or {}).get("values", []) if is_tensor_ref(v)]
        lasting = {v[1] for v in in_values if v[1] not in produced}
        wrote = uses(raw.get("outputs") or {}, lasting)  # in place on a lasting tensor: still lasting
        produced.update(v[1] for v in out_values if v[1] not in lasting)
        anchor, backward = tree.anchor_of(int(raw["id"]))
        module = tree.module_of(anchor) if backward and anchor is not None else tree.module_of(int(raw["id"]))
        ops.append(Op(int(raw["id"]), raw["name"], raw["category"], dur, float(raw.get("gap_us") or 0.0),
                      list((raw.get("inputs") or {}).get("shapes", [])), list(raw.get("deps", [])),
                      None, inputs=read, outputs=wrote, module=module, anchor=anchor, backward=backward,
                      scopes=list(raw.get("scopes", []))))
    return ops


def load_graph(bundle: str | Path, step: int | None = None) -> Graph:
    """The graph of one captured step of ``bundle`` (a single-rank bundle or its ``rank0``); ``step``:
    which traced step (default: the middle one)."""
    bundle = Path(bundle)
    if (bundle / "rank0").is_dir():
        bundle = bundle / "rank0"
    trace = read_bundle(bundle)  # each file once; the ops are the ones a spec of the whole step holds
    raw_ops, raw_steps = extract_rank(trace)
    add_dependencies(raw_ops)
    steps = sorted({o["step"] for o in raw_ops})
    if not steps:
        raise TraceError(f"{bundle}: the capture holds no complete step to predict from")
    chosen = steps[len(steps) // 2] if step is None else step
    if chosen not in steps:
        raise TraceError(f"{bundle}: no traced step {chosen}; it has {steps}")
    meta = trace.meta
    costs = _tracer_costs(meta, len(trace.nodes) / max(1, len(steps)))
    chosen_ops = [o for o in raw_ops if o["step"] == chosen]
    alone = _kineto_alone_durations(trace.timing, [o["name"] for o in chosen_ops])
    ops = _graph_ops(chosen_ops, _NodeTree(trace.nodes), alone, costs)
    step_info = next(s for s in raw_steps if s["index"] == chosen)
    return Graph(workload=str(meta.source), config=dict(meta.config or {}), ops=ops,
                 tail_gap_us=float(step_info.get("tail_gap_us", 0.0)), measured_step_ms=costs.plain_ms,
                 tracer_cost_us=(costs.et_us, costs.kineto_us), platform=dict(meta.platform),
                 replay_reference_ms=costs.plain_near_ms)


def _kineto_alone_durations(timing: KinetoTrace | None, names: list[str]) -> list[float] | None:
    """Each op's median duration over the steps the capture ran under Kineto alone (no execution-trace
    observer, whose cost per op is far larger and uneven): the ops of a step, in host order, matched to
    that step's events on its thread one after another by name (an event nested inside the previous match
    is skipped). None when a step cannot be matched whole."""
    if timing is None:
        return None
    per_step: list[list[float]] = []
    ops = sorted(timing.cpu_ops, key=lambda e: e.ts)
    starts = [e.ts for e in ops]
    for step in sorted(timing.steps, key=lambda e: e.ts):
        lo, hi = step.ts, step.ts + step.dur
        mine = [e for e in ops[bisect_left(starts, lo):bisect_left(starts, hi)] if e.tid == step.tid]
        found, cursor, after = [], 0, lo
        for name in names:
            while cursor < len(mine) and (mine[cursor].ts < after or mine[cursor].name != name):
                cursor += 1
            if cursor == len(mine):
                break
            found.append(mine[cursor].dur)
            after = mine[cursor].ts + mine[cursor].dur
            cursor += 1
        if len(found) == len(names):
            per_step.append(found)
    if not per_step:
        return None
    return [statistics.median(column) for column in zip(*per_step, strict=True)]


def _numel(shape: Any) -> int:
    if not isinstance(shape, list) or not all(isinstance(d, int) for d in shape):
        return 0
    total = 1
    for d in shape:
        total *= d
    return total


def _share_optimizer_ops(ops: list[Op]) -> None:
    """Per-parameter work (a gradient's accumulation) belongs to the layer whose backward op produced that
    gradient; work over every parameter at once (foreach/fused optimizer kernels, gradient norms) belongs
    to the layers in proportion to the parameter elements accumulated there."""
    held: Counter = Counter()
    last_layer = None
    for op in ops:
        if not any("AccumulateGrad" in s for s in op.scopes):
            last_layer = op.layer if op.layer is not None else last_layer
            if op.layer is None and any(s.startswith("autograd::engine") for s in op.scopes):
                last_layer = None  # backward work outside the layers (the loss, the head)
            continue
        # the engine accumulates a parameter's gradient as soon as the backward op that made it is done
        op.layer = op.layer or last_layer
        if op.name == "aten::detach" or op.name == "aten::add_" or op.name == "aten::copy_":
            held["layers" if op.layer is not None else "rest"] += _numel(op.shapes[0] if op.shapes else None)
    total = held["layers"] + held["rest"]
    share = held["layers"] / total if total else 0.0
    for op in ops:
        if op.layer is None and (op.category == "optimizer" or op.name.startswith("aten::_foreach")):
            op.layer_share = share
        else:
            op.layer_share = 1.0


def schedule(graph: Graph, durations: dict[int, float] | None = None, gaps: dict[int, float] | None = None,
             extra: list[Op] | None = None) -> dict[str, Any]:
    """Replay the graph: host order on one thread, each op also after the ops it reads from. Returns the
    step time, its breakdown (compute by category, communication, host) along the critical path, and each
    op's end (``end_us``, by op id)."""
    ops = [*graph.ops, *(extra or [])]
    end: dict[int, float] = {}
    clock = 0.0
    by_category: dict[str, float] = defaultdict(float)
    host = 0.0
    idle = 0.0
    for op in ops:
        gap = (gaps or {}).get(op.id, op.gap_us)
        start = clock + gap
        host += gap
        ready = max((end[d] for d in op.deps if d in end), default=0.0)
        if ready > start:
            idle += ready - start
            start = ready
        dur = (durations or {}).get(op.id, op.dur_us)
        end[op.id] = start + dur
        clock = end[op.id]
        by_category["communication" if op.category in COMM_CATEGORIES else op.category] += dur
    clock += graph.tail_gap_us
    host += graph.tail_gap_us
    return {"step_us": clock, "host_us": host, "idle_us": idle, "compute_us": dict(by_category), "end_us": end}
