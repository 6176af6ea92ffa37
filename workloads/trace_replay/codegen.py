"""A captured step as one generated Python function: each op one direct call on the value list (torch's
generated binding where it calls exactly that op, else the C++ op: :mod:`.bindings`).

Interpreting call templates op by op costs the replayer ~3.6 µs per op, comparable to a small op
itself; generated straight-line code costs 1.4–4.7 µs per op here (argument lists, the op binding,
slot stores: the replayer measures it, :meth:`.replay.Replayer.calibrate_host_cost`), close to the
original program's own dispatch cost. The code is built only from integers this module computes (slots, positions,
list indices), Python literals of exact JSON scalars (``repr`` of a str, int, bool or finite float
is a literal of the same value) and references to values it holds: no text of a spec is executed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from workloads.trace_replay.ops import CompiledOp, flatten_tensors, wait_for


def seconds(gap_us: Any) -> float:
    """A host gap in seconds, as a float the generated code can hold: finite, not negative."""
    value = 1e-6 * float(gap_us or 0.0)
    return value if math.isfinite(value) and value > 0 else 0.0


SPIN_PROBE_US = 200.0  # one reading of the host's speed: the ledger's spin loop run this long
SPIN_PROBE_READINGS = 5  # the median of this many


def spin_ns(clock: Callable[[], float] = time.perf_counter, readings: int = SPIN_PROBE_READINGS) -> float:
    """The host's speed now, as the ledger's own spin loop runs: nanoseconds per turn of it, the median of
    ``readings`` spins of :data:`SPIN_PROBE_US` each. The capture reads it beside the program's host
    time; a replay spending that host time reads it again as it runs (:class:`HostSpeed`). On this 2-core
    VM a turn took 83 ns in some minutes and 132 ns in others, and a pure Python loop, a small op's dispatch
    and a llama training step moved with it (correlation 0.8 with the step's time over 1,100 readings)."""
    taken = []
    for _ in range(readings):
        turns = 0
        now = start = clock()
        end = start + 1e-6 * SPIN_PROBE_US
        while now < end:  # the loop the generated steps spin (generate_step)
            now = clock()
            turns += 1
        taken.append(1e9 * (now - start) / max(1, turns))
    taken.sort()
    return taken[len(taken) // 2]


class HostSpeed:
    """How fast the host runs now against the capture's moment: ``scale`` multiplies every gap a step spends
    (the program's host time is host work, which takes longer as the host runs slower). Read with
    :func:`spin_ns` against the capture's own reading (``reference_ns``), at most every :data:`EVERY_S` as
    the steps run (:meth:`update`, after each step; 0.08 % of the replay's time): the median of the last
    :data:`KEPT` readings (the lower one of two: one reading alone does not move it), to the power
    ``elasticity``: how the program's host time moved with the spin at capture
    (:func:`~workloads.trace_replay.host_time.host_speed_elasticity`; 1: as much).

    The turns of the steps' own spins are not the reading: spun a few µs at a time right after an op, each
    turn runs slower than the clean loop's, and llama's replay read that way spent 22 % more host time than
    its program had while judged."""

    EVERY_S = 0.25
    READINGS = 1  # spins of SPIN_PROBE_US a reading
    KEPT = 3
    LIMITS = (0.25, 4.0)

    def __init__(self, reference_ns: float, clock: Callable[[], float] = time.perf_counter, *,
                 elasticity: float = 1.0):
        self.reference_ns, self.clock, self.elasticity = reference_ns, clock, elasticity
        self.scale = 1.0
        self.readings: list[float] = []
        self.scales: list[float] = []  # every scale the steps ran at, for the record
        self._last = -math.inf

    def update(self) -> None:
        """Read the host's speed again where :data:`EVERY_S` has passed since the last reading."""
        if self.clock() - self._last < self.EVERY_S:
            return
        self.readings = [*self.readings[-(self.KEPT - 1):], spin_ns(self.clock, self.READINGS)]
        ordered = sorted(self.readings)
        ratio = ordered[(len(ordered) - 1) // 2] / self.reference_ns
        self.scale = min(max(ratio ** self.elasticity, self.LIMITS[0]), self.LIMITS[1])
        self.scales.append(self.scale)
        self._last = self.clock()


def taken_back(gaps_s: Sequence[float], tail_s: float, cost_s: float) -> list[float]:
    """How much to take off each gap beforehand so that a step whose own work costs ``cost_s`` per op ends on
    the program's host time: where that work costs more than the gaps left (ops the framework calls from C++
    back to back, such as the backward's from the autograd engine), the balance still owed at the step's end
    comes off the latest gaps with room before it. (The ledger can only take an overrun back from the gaps
    after it; on T5, whose backward ends on ops called back to back, it ended its steps 0.3 ms late.)"""
    room = [0.0] * len(gaps_s)  # what each gap has left past the work before it and the balance owed then
    owed = 0.0
    for j, gap in enumerate(gaps_s):
        owed += gap - cost_s
        if owed > 0:
            room[j], owed = owed, 0.0
    owed += tail_s
    taken = [0.0] * len(gaps_s)
    for j in reversed(range(len(gaps_s))):
        if owed >= 0:
            break
        taken[j] = min(room[j], -owed)
        owed += taken[j]
    return taken


def wait_points(ops: Sequence[CompiledOp], positions: Sequence[int]) -> dict[int, int]:
    """For each collective the step launches (:attr:`.ops.CompiledOp.launches`), by its place in ``positions``,
    the place of the first op after it that reads or writes one of its buffers, before which the step waits
    for it (``len(positions)``: none does; the step waits at its end), or earlier where the program stood
    waiting for it there (:attr:`.ops.CompiledOp.waited_after`)."""
    launched = [j for j, p in enumerate(positions) if ops[p].launches and ops[p].error is None]
    if not launched:
        return {}
    read = [{slot for *_, slot in [*ops[p].arg_slots, *ops[p].kwarg_slots]} for p in positions]
    touched = [slots | {slot for slot in ops[p].out_slots if slot is not None}
               for slots, p in zip(read, positions, strict=True)]
    waits = {}
    for j in launched:
        at = next((i for i in range(j + 1, len(positions)) if read[j] & touched[i]), len(positions))
        stood = ops[positions[j]].waited_after
        waits[j] = at if stood is None else min(at, j + stood)
    return waits


def generate_step(ops: Sequence[CompiledOp], positions: Sequence[int], clears: Sequence[list[int]],
                  gaps_s: Sequence[float] | None, tail_s: float, *, call_s: float = 0.0, outside_s: float = 0.0,
                  births: Sequence[int | None] | None = None, grad: Sequence[bool] | None = None,
                  grad_on: bool = False, keep: list[Any] | None = None, stand_in: Callable[[int], None],
                  fill: Callable[[int], None], born: Callable[[int], None] | None = None,
                  name: str, speed: HostSpeed | None = None,
                  tear_down: tuple[int, Callable[[list[Any]], None]] | None = None,
                  leaves_at: Sequence[list[int]] | None = None,
                  clock: Callable[[], float] = time.perf_counter) -> tuple[Callable[[list[Any]], float], int]:
    """The step running ``ops[p]`` for each p in ``positions``; returns it and how many ops it runs.

    ``clears[j]``: slots to release after the j-th op (their last use). ``gaps_s[j]``: the
    program's own host time before the j-th op, and ``tail_s`` after the last, spent busy as the program
    spent them (None: ops back to back). ``births[j]``: a key for ``born``, which makes the storages the
    program made right after the j-th op (None: none), within the gap that follows it: the program's host
    time there includes its making them (a compiled graph's own kernels).

    The host time is spent against a ledger kept as the step runs: ``d``, the moment the next op may start,
    is the step's start plus every gap so far plus the time the step's ops took, each op timed from the
    clock read that ends the spin before it to the one right after its call returns. Everything else the
    replay does between ops (slot stores and releases, what the program made, the ledger's own lines, a
    spin running past its end) is then spent out of the program's gaps, at the cost it has as the step
    runs, not at one measured beforehand: a gap the replay's own work overran is taken back from the gaps
    after it; what is still owed at the step's end is what the step returns (seconds; 0 when it kept to
    the program's host time, below 0 when it ended early: what it took off its gaps beforehand, below,
    is counted, as the ledger's own lateness does not show it). ``call_s``: the replay's host time
    inside that window per op (the op binding's own work before and after the op proper:
    :func:`.host_cost.measure_call_cost`), which each gap leaves out; ``outside_s``: its work outside the
    window per op, as measured there, with which a balance the step would owe at its end is taken off its
    latest gaps beforehand (:func:`taken_back`).
    ``grad[j]``: run the j-th op with grad mode set to ``grad_on`` and back off after it; None: every op without grad.
    Those ops' outputs are appended to ``keep`` (where given), so that the history they record is torn down when the
    caller clears it, untimed, not inside the step (what the replayer's autograd calibration compares: the same code,
    grad mode on and off; the program tears its history down in the backward, whose host time the capture measures
    apart). As the replay runs its steps recording the program's history (the bookkeeping inside each op's own time),
    ``tear_down``: ``(j, fn)``, ``fn(v)`` run right after the j-th op, inside the ledger, whose gaps hold the
    program's own teardown (its backward's); ``leaves_at[j]``: slots whose tensors are let require grad right
    before the j-th op, as the program's were (:func:`.host_cost.recordable_ops`). A collective
    is launched where the program launched it and waited for before the first op that reads or writes its buffers
    (:func:`wait_points`), the wait until the exchange ended added to the ledger's moment (:func:`.ops.wait_for`):
    the gap before that op is the program's host time after the exchange it waited for ended
    (:func:`.host_time.waited_part`), its own wake-up included. ``speed``: every gap the ledger
    spends is multiplied by its ``scale``, read once a step (:class:`HostSpeed`); None: the gaps as given. ``clock``:
    the ledger's clock.
    """
    consts: list[Any] = []
    fns: list[Callable[..., Any]] = []
    refills: list[Callable[[list[Any]], None]] = []

    def const(value: Any) -> str:
        if value is None or type(value) in (bool, int, str) or (type(value) is float and math.isfinite(value)):
            return repr(value)
        consts.append(value)
        return f"c[{len(consts) - 1}]"

    def expr(template: Any, slots: dict[int, int]) -> str:
        if isinstance(template, list):
            return "[" + ", ".join(f"v[{slots[j]}]" if j in slots else const(item)
                                   for j, item in enumerate(template)) + "]"
        return f"v[{slots[-1]}]" if -1 in slots else const(template)

    ledger = gaps_s is not None
    lines = ["def step(v):"]
    waits = wait_points(ops, positions)
    pending: dict[int, list[int]] = {}  # a position in the step → the collectives waited for before its op
    for j, at in waits.items():
        pending.setdefault(at, []).append(j)

    def wait(at: int) -> None:  # before the op at ``at`` (len(positions): the step's end), its gap spent after
        for j in pending.get(at, []):
            lines.append(f"    d += wt(w{j})" if ledger else f"    wt(w{j})")
            lines.append(f"    w{j} = None")
    taken = 0.0  # what the gaps give up beforehand: the ledger's moments move earlier by it, its lateness does not
    if ledger:
        take = taken_back(gaps_s, tail_s, call_s + outside_s)
        taken = float(sum(take))
        gaps_s = [gap - cut - call_s for gap, cut in zip(gaps_s, take, strict=True)]  # the ledger's, per op
        lines.append("    k = h.scale if h is not None else 1.0")
        lines.append(f"    d = pc() + k * {float(gaps_s[0] if positions else tail_s)!r}")
    ran = 0
    for j, position in enumerate(positions):
        op = ops[position]
        wait(j)
        toggled = grad is not None and grad[j] and op.error is None
        if toggled:
            lines.append(f"    grad({bool(grad_on)!r})")
        after = float(gaps_s[j + 1] if j + 1 < len(positions) else tail_s) if ledger else 0.0
        if op.error is not None:
            lines.append(f"    standin({int(position)})")
            if ledger:
                lines.append(f"    d += k * {after!r}")
        else:
            ran += 1
            by_arg: dict[Any, dict[int, int]] = {}
            for pos, sub, slot in op.arg_slots:
                by_arg.setdefault(pos, {})[int(sub)] = int(slot)
            for key, sub, slot in op.kwarg_slots:
                by_arg.setdefault(key, {})[int(sub)] = int(slot)
            parts = [expr(a, by_arg.get(i, {})) for i, a in enumerate(op.args)]
            assert all(key.isidentifier() for key in op.kwargs), "keyword names come from the parsed schema"
            parts += [f"{key}={expr(value, by_arg.get(key, {}))}" for key, value in op.kwargs.items()]
            # torch's own binding where it calls exactly this op, else the C++ op itself, not its Python wrapper
            fns.append(op.binding or getattr(op.fn, "_op", op.fn))
            call = f"f[{len(fns) - 1}]({', '.join(parts)})"
            if op.refills:  # the replay's own work, before the spin: spent out of the program's gap
                refills.append(op.refill)
                lines.append(f"    rf[{len(refills) - 1}](v)")
            if leaves_at is not None:  # and the program's: inside its gap
                lines.extend(f"    v[{int(slot)}].requires_grad_()" for slot in leaves_at[j])
            if ledger:
                lines.append("    while (a := pc()) < d: pass")
            targets = [(n, int(slot)) for n, slot in enumerate(op.out_slots) if slot is not None]
            if j in waits:
                lines.append(f"    w{j} = {call}")
            elif op.single_output and targets:
                lines.append(f"    v[{targets[0][1]}] = {call}")
            elif targets:
                lines.append(f"    r = flat({call})")
            else:
                lines.append(f"    {call}")
            if ledger:
                lines.append(f"    d += pc() - a + k * {after!r}")
            if targets and not op.single_output:
                lines.extend(f"    v[{slot}] = r[{n}]" for n, slot in targets)
                # not held past its slots' lifetimes: until the next op with several outputs returned, its list
                # kept a convolution's input gradient through a batch norm's backward (+162 KB at its peak)
                lines.append("    r = None")
            if toggled:
                lines.append("    grad(False)")
                if keep is not None:
                    lines.extend(f"    keep.append(v[{slot}])" for _, slot in targets)
            if op.fills or op.pins or op.lengths or op.counts:
                lines.append(f"    fill({int(position)})")
        if tear_down is not None and j == tear_down[0]:
            lines.append("    td(v)")
        lines.extend(f"    v[{int(slot)}] = None" for slot in clears[j])
        if births is not None and births[j] is not None:  # inside the next gap: the program made them there
            lines.append(f"    born({int(births[j])})")
    wait(len(positions))
    if ledger:
        lines += ["    while pc() < d: pass", f"    return pc() - d - k * {taken!r}"]

    namespace: dict[str, Any] = {"f": fns, "c": consts, "rf": refills, "flat": flatten_tensors, "pc": clock, "h": speed,
                                 "standin": stand_in, "fill": fill, "born": born,
                                 "wt": lambda works: wait_for(works, clock), "grad": torch._C._set_grad_enabled,
                                 "keep": keep, "td": tear_down[1] if tear_down is not None else None}
    exec(compile("\n".join([*lines, "    return 0.0"]), f"<cobench replay {name}>", "exec"), namespace)
    return namespace["step"], ran
