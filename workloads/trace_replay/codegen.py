"""A captured step as one generated Python function: each op one direct C++ op call on the value list.

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

from workloads.trace_replay.ops import CompiledOp, flatten_tensors

SPIN_MIN_S = 2e-7  # shorter host gaps are not spun on: they add up to the next


def seconds(gap_us: Any) -> float:
    """A host gap in seconds, as a float the generated code can hold: finite, not negative."""
    value = 1e-6 * float(gap_us or 0.0)
    return value if math.isfinite(value) and value > 0 else 0.0


def spin_line(length_s: float) -> str:
    """The generated line that spends ``length_s`` busy after ``t`` (taken as the op before it returned)."""
    return f"    while pc() < t + {float(length_s)!r}: pass"


def spins(gaps_s: Sequence[float], tail_s: float, call_s: float,
          spin_cost_s: float = 0.0) -> tuple[list[float], float]:
    """How long to spin before each op (and after the last) to spend the program's host time.

    The program's gap before an op includes its own cost of calling it; the replay pays its own
    instead, ``call_s`` per op, so that much of each gap counts as spent. Where the replay's calls
    cost more than the program's gaps (ops the framework calls from C++, such as backward ops from
    the autograd engine), the balance carries to later gaps; a balance still owed at the step's end
    is taken back from the latest spins before it. The spins then add up to the program's host time
    less the replay's calls, never more: a step spends its host time, not its peaks. Gaps shorter
    than :data:`SPIN_MIN_S` are not spun on: they add up to the next. A spin itself runs
    ``spin_cost_s`` past its length (its last check of the clock, and leaving the loop: measured by
    :func:`.host_cost.measure_spin_cost`), so each is that much shorter.
    """
    out = [0.0] * len(gaps_s)
    owed = 0.0
    for j, gap in enumerate(gaps_s):
        owed += gap - call_s
        if owed > SPIN_MIN_S + spin_cost_s:
            out[j], owed = owed - spin_cost_s, 0.0
    owed += tail_s
    tail = owed - spin_cost_s if owed > SPIN_MIN_S + spin_cost_s else 0.0
    for j in reversed(range(len(out))):
        if owed >= 0:
            break
        taken = min(out[j], -owed)
        out[j] -= taken
        owed += taken
    return [spin if spin > SPIN_MIN_S else 0.0 for spin in out], tail


def generate_step(ops: Sequence[CompiledOp], positions: Sequence[int], clears: Sequence[list[int]],
                  gaps_s: Sequence[float] | None, tail_s: float, *, call_s: float = 0.0, spin_cost_s: float = 0.0,
                  births: Sequence[int | None] | None = None, grad: Sequence[bool] | None = None,
                  grad_on: bool = False, keep: list[Any] | None = None, stand_in: Callable[[int], None],
                  fill: Callable[[int], None], born: Callable[[int], None] | None = None,
                  name: str) -> tuple[Callable[[list[Any]], None], int]:
    """The step running ``ops[p]`` for each p in ``positions``; returns it and how many ops it runs.

    ``clears[j]``: slots to release after the j-th op (their last use). ``gaps_s[j]``: the
    program's own host time before the j-th op, spent busy as the program did (None: ops back to
    back). ``births[j]``: a key for ``born``, which makes the storages the program made right after
    the j-th op (None: none), within the gap that follows it: the program's host time there includes
    its making them (a compiled graph's own kernels). ``call_s``: the replay's own cost of calling an
    op (measured by the replayer on its own steps), which :func:`spins` takes out of the gaps, as it takes
    ``spin_cost_s`` out of each spin.
    ``grad[j]``: run the j-th op with grad mode set to ``grad_on`` and back off after it (what the
    replayer's autograd calibration compares: the same code, grad mode on and off); None: every op
    without grad, as the replay runs. Those ops' outputs are appended to ``keep`` then, so that the
    history they record is torn down when the caller clears it, not inside the step: the program tears
    its down in the backward, whose host time the capture measures apart.
    """
    consts: list[Any] = []
    fns: list[Callable[..., Any]] = []

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

    lines = ["def step(v):", "    t = pc()"]
    ran = 0
    spin_s, tail = spins(gaps_s, tail_s, call_s, spin_cost_s) if gaps_s is not None else \
        ([0.0] * len(positions), tail_s)
    for j, position in enumerate(positions):
        op = ops[position]
        if spin_s[j] > 0:
            lines.append(spin_line(spin_s[j]))
        toggled = grad is not None and grad[j] and op.error is None
        if toggled:
            lines.append(f"    grad({bool(grad_on)!r})")
        if op.error is not None:
            lines.append(f"    standin({int(position)})")
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
            fns.append(getattr(op.fn, "_op", op.fn))  # the C++ op itself, not its Python wrapper
            call = f"f[{len(fns) - 1}]({', '.join(parts)})"
            targets = [(n, int(slot)) for n, slot in enumerate(op.out_slots) if slot is not None]
            if op.single_output and targets:
                lines.append(f"    v[{targets[0][1]}] = {call}")
            elif targets:
                lines.append(f"    r = flat({call})")
                lines.extend(f"    v[{slot}] = r[{n}]" for n, slot in targets)
            else:
                lines.append(f"    {call}")
            if toggled:
                lines.append("    grad(False)")
                lines.extend(f"    keep.append(v[{slot}])" for _, slot in targets)
            if op.fills or op.pins or op.lengths:
                lines.append(f"    fill({int(position)})")
        lines.extend(f"    v[{int(slot)}] = None" for slot in clears[j])
        if gaps_s is not None:
            lines.append("    t = pc()")
        if births is not None and births[j] is not None:  # inside the next gap: the program made them there
            lines.append(f"    born({int(births[j])})")
    if tail > SPIN_MIN_S:
        lines.append(spin_line(tail))
    namespace: dict[str, Any] = {"f": fns, "c": consts, "flat": flatten_tensors, "pc": time.perf_counter,
                                 "standin": stand_in, "fill": fill, "born": born,
                                 "grad": torch._C._set_grad_enabled, "keep": keep}
    exec(compile("\n".join([*lines, "    return None"]), f"<cobench replay {name}>", "exec"), namespace)
    return namespace["step"], ran
