"""The replay's own host time per op call, measured as the capture measures the program's, and the
autograd bookkeeping the program did inside its forward ops, which the replay does not.

A replay that spends the program's host time between ops (:mod:`.host_time`) must not count its own
cost of calling each op twice: that cost is measured here on the replay's own generated steps, with
every gap zero, under the profiler against plain runs, and taken out of the gaps it spends.

A program's forward ops ran under grad mode: each recorded autograd history (a node, its saved
tensors, version counters) inside the op's own time, which the capture therefore counts as op time.
The replay measures that bookkeeping on its own steps — the same code with grad mode on and off around
each such op — then records the program's history as its steps run where it can (:func:`recordable_ops`;
its backward ops stay calls of their own, not a graph's), and spends the bookkeeping of the others as
host time before each.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from workloads.trace_replay.execute import StepRunner, detach_all
from workloads.trace_replay.host_time import (
    COLLECTIVE,
    HOST_TARGET_PCT,
    QUICK_TIMING_ROUNDS,
    half_width,
    kineto_host_gaps,
    profiled_steps,
    replayed_op_time,
    round_median_draws,
)
from workloads.trace_replay.ops import flatten_tensors

MIN_SAMPLE_MS = 20.0  # a sample runs a short step this long, as the side-by-side judgement's samples do
MAX_REPEATS = 50
CALIBRATION_ROUNDS = 24  # a calibration's rounds at least
MEDIAN_DRAWS = 200  # bootstrap draws for the interval that decides on one more round


@dataclass(frozen=True)
class Rounds:
    """How many rounds a calibration runs: ``least``, then, given the program's step (``step_us``) and seconds
    for them (``budget_s``), more while its median per step is known worse than ±:data:`HOST_TARGET_PCT` of the
    step, up to :data:`QUICK_TIMING_ROUNDS` while one more keeps all its rounds within ``budget_s``: as a
    capture adds host-time rounds. At 24 rounds the call cost alone moved a judgement of TorchRec's DLRM
    ±1.4 … 2.2 % and llama's autograd bookkeeping ±1.9 %, most of the ±2.5 % a verdict allows."""

    least: int = CALIBRATION_ROUNDS
    step_us: float = 0.0
    budget_s: float = 0.0

    def more(self, done: int, took_s: float, samples_s: list[float], per_step: float) -> bool:
        """Whether one more round is wanted after ``done`` rounds that took ``took_s`` in all, their
        ``samples_s`` a figure ``per_step`` times a step (ops per step)."""
        if done < self.least:
            return True
        if done >= QUICK_TIMING_ROUNDS or not (self.budget_s > 0 and self.step_us > 0 and per_step > 0):
            return False
        if took_s * (done + 1) / done > self.budget_s:
            return False
        return 100.0 * 1e6 * per_step * median_half_width(samples_s) / self.step_us > HOST_TARGET_PCT


FIXED_ROUNDS = Rounds()  # 24 rounds, no more


def median_half_width(samples: list[float], seed: int = 0) -> float:
    """Half the width of the 95 % bootstrap interval of the median of ``samples`` (each drawn alone, as a
    judgement resamples them: :func:`harness.traces.side_by_side.capture_shift_parts`); infinite for fewer
    than two."""
    if len(samples) < 2:
        return math.inf
    return half_width(round_median_draws([[x] for x in samples], random.Random(seed), MEDIAN_DRAWS))


def measure_call_cost(runner: StepRunner, synchronize: Callable[[], None], rounds: Rounds = FIXED_ROUNDS, *,
                      process_group: Any = None) -> tuple[list[float], list[float], list[float], int]:
    """The replay's own host time per op inside its ledger's op window, and outside it, one figure each per
    measured sample (seconds), the time inside its ops (collectives left out) per step, one figure per
    round (µs: the mean over the steps, the profiler's cost taken out as the capture takes it out of the
    program's: :func:`.host_time.replayed_op_time`), and how many rounds ran.

    The program's host gaps were measured from its Kineto trace as the time outside its ops, the
    profiler's cost taken out (:func:`.host_time.kineto_host_gaps`); the replay's own time outside its
    ops (the generated code: argument lists, the op binding, slot stores and releases, its ledger) is
    measured here the same way on its own steps with every gap zero. A generated step keeps a ledger of
    the host time it spent (:func:`.codegen.generate_step`), each op timed from the clock read before its
    call to the one after: what it does outside that window is spent out of the program's gaps as it
    runs, and with every gap zero the step returns it (the window's share is the rest). What lies inside
    the window (the op binding's argument parsing and return, before and after the op proper) the ledger
    counts as op time: each gap leaves that out, so the gaps it spends are the program's host time it
    does not already pay. (A fixed per-call figure from a one-argument op came out at a third of a real
    op line's cost and left the replay ~10 % slow; the whole per-op cost taken out of the gaps beforehand
    left the replay's host time 2–15 % above the program's when judged, its stores and releases costing
    more then than when measured.)

    As the capture does: rounds of profiled steps then plain ones (as many as ``rounds`` says), each block after a
    pass that settles it (the profiler's buffers; the caches after it stops), each profiled sample
    set against the plain sample of its own round; the median over every sample of every round. (All
    profiled steps after all plain ones, the figure moved 3.7 … 8.3 µs per op between calibrations of
    one replay, a quarter of a BERT step's host time.) A sample is one step, or as many runs of it as
    last :data:`MIN_SAMPLE_MS` for a short one: a millisecond step's host time moves too much from
    one run to the next for one to say much. Steps that hold collectives run as many times on every rank
    of ``process_group`` (the default group when None): as many as the rank that needs the most.
    """
    steps = len(runner.plan.sequence)
    generated = [runner.generated_step(k, no_gap_time=True) for k in range(steps)]

    def run(k: int) -> float:
        with torch.no_grad():
            return generated[k][0](runner.tensors.vals)

    repeats = []  # runs of each step per sample, from a settling pass's own times
    for k in range(steps):
        run(k)
        synchronize()
        started = time.perf_counter()
        run(k)
        synchronize()
        repeats.append(max(1, min(MAX_REPEATS, math.ceil(MIN_SAMPLE_MS / max(1e3 * (time.perf_counter() - started),
                                                                               1e-3)))))
    lockstep = torch.distributed.is_initialized() and any(COLLECTIVE.match(op.name) for op in runner.plan.ops)

    def agreed_max(values: list[int]) -> list[int]:
        """The largest of each value over the ranks, where the steps hold collectives (run as often on each)."""
        if not lockstep:
            return values
        agreed = torch.tensor(values, dtype=torch.int64, device=runner.tensors.device)  # nccl: on the device
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MAX, group=process_group)
        return [int(v) for v in agreed]

    repeats = agreed_max(repeats)
    per_op: list[float] = []
    outside: list[float] = []
    op_us: list[float] = []
    names = {op.name for op in runner.plan.ops}
    calls_per_step = statistics.fmean(max(1, len(step)) for step in runner.plan.sequence) if steps else 0.0
    began, done = time.perf_counter(), 0
    while agreed_max([int(rounds.more(done, time.perf_counter() - began, per_op, calls_per_step))])[0]:
        done += 1
        # each block from the carried state as it was made: a step run over and over drifts (its values
        # sink into subnormal floats; ViT's ran twice as slow after some 25 runs), within a round too
        runner.tensors.restore_values()
        trace = profiled_steps([lambda k=k: [run(k) for _ in range(repeats[k])] for k in range(steps)],
                               settle=lambda: [run(k) for k in range(steps)], synchronize=synchronize)
        runner.tensors.restore_values()
        for k in range(steps):  # settles plain running again
            run(k)
        plain_us: dict[int | None, float] = {}
        ledger_us: dict[int, float] = {}
        for k in range(steps):
            synchronize()
            started = time.perf_counter()
            ledger_us[k] = 1e6 * sum(run(k) for _ in range(repeats[k]))
            synchronize()
            plain_us[k] = 1e6 * (time.perf_counter() - started)
        host_us = kineto_host_gaps(trace, plain_us)
        calls = {k: repeats[k] * max(1, len(runner.plan.sequence[k])) for k in host_us}
        per_op += [(host_us[k] - ledger_us[k]) / calls[k] for k in host_us]
        outside += [ledger_us[k] / calls[k] for k in host_us]
        inside = replayed_op_time(trace, plain_us, names.__contains__)  # the captured ops': as the program's
        if steps and len(inside) == steps:
            op_us.append(statistics.fmean(inside[k] / repeats[k] for k in inside))
    runner.tensors.restore_values()
    return [1e-6 * v for v in per_op], [1e-6 * v for v in outside], op_us, done


def measure_gap_excess(runner: StepRunner, synchronize: Callable[[], None], rounds: int = 8) -> list[list[float]]:
    """How much more host time per op the replay's steps take, spending their gaps, than they mean to spend:
    one figure per measured step (seconds), a list per round, measured as the capture measures the program's host time
    (:func:`.host_time.kineto_host_gaps`: the generated steps with their gaps under Kineto alone, then
    plain, the profiler's cost taken out), less what each step's ledger spends (every gap and its tail, at
    the host-speed scale it ran at), ÷ its ops.

    The call cost (:func:`measure_call_cost`) is measured with the ops back to back. Spent between gaps, each
    call costs more: over the model zoo on a quiet machine (2026-11-29, 28 judgements), the replay's host
    time as judged, less the autograd bookkeeping it spends on purpose, stood above what it spent in 22, by
    1.4 % of the program's step at the median (up to 0.9 µs an op; Faster R-CNN 1.5–3.2), about a third of
    the replay's bias then (its time error +3.9 % at the median). Added to the call cost, one BERT
    capture's excess went from +0.41 µs an op to −0.05. Steps that hold collectives run on every rank in
    the same order, once each a round."""
    steps = len(runner.plan.sequence)
    generated = [runner.generated_step(k) for k in range(steps)]
    speed = runner.speed
    scales: dict[int, float] = {}
    recorded = len(speed.scales) if speed is not None else 0  # the record keeps the scales the replay ran at

    def run(k: int) -> None:
        scales[k] = speed.scale if speed is not None else 1.0
        with torch.no_grad():
            generated[k][0](runner.tensors.vals)
        if speed is not None:
            speed.update()

    excess: list[list[float]] = []
    for _ in range(rounds):
        runner.tensors.restore_values()
        trace = profiled_steps([lambda k=k: run(k) for k in range(steps)],
                               settle=lambda: [run(k) for k in range(steps)], synchronize=synchronize)
        runner.tensors.restore_values()
        for k in range(steps):  # settles plain running again
            run(k)
        plain_us: dict[int | None, float] = {}
        for k in range(steps):
            synchronize()
            started = time.perf_counter()
            run(k)
            synchronize()
            plain_us[k] = 1e6 * (time.perf_counter() - started)
        host_us = kineto_host_gaps(trace, plain_us)
        round_excess = []
        for k, host in host_us.items():
            positions = runner.plan.sequence[k]
            spent_us = 1e6 * scales[k] * (sum(runner.gaps_s(positions)) + runner.tail_gap_s(k))
            round_excess.append(1e-6 * (host - spent_us) / max(1, len(positions)))
        if round_excess:
            excess.append(round_excess)
    runner.tensors.restore_values()
    if speed is not None:
        del speed.scales[recorded:]
    return excess


def settled_excess(rounds: list[list[float]]) -> float:
    """The part of a measured excess that its own spread cannot undo: the bound nearest zero of the 95 %
    interval of the median over the rounds' medians (the order statistics that hold the median with 95 %
    probability, whatever the distribution), 0 where that interval holds zero.

    A round's steps share its moment, so a round is one figure. On a quiet machine the rounds agree: a
    host-bound program's read 16–65 µs an op and gave 16 (the median 19). With one busy neighbour they
    do not (−116 … +1,151 µs an op; the median of every step's figure once read +412, and a replay then
    spent 1.2 ms a step too little of a 4 ms gap); the bound nearest zero of such rounds is 0 or near it."""
    medians = sorted(statistics.median(r) for r in rounds if r)
    n = len(medians)
    if n < 3:
        return 0.0
    k = max(0, math.floor((n - 1.96 * math.sqrt(n)) / 2))
    low, high = medians[k], medians[n - 1 - k]
    return low if low > 0 else high if high < 0 else 0.0


def _runs_with_grad(op: Any, vals: list[Any], leaves: list[torch.Tensor]) -> bool:
    for leaf in leaves:
        leaf.requires_grad_(True)
    try:
        with torch.enable_grad():
            op.call(vals)
        return True
    except Exception:  # noqa: BLE001 - the answer: these leaves cannot require grad here
        return False
    finally:
        for leaf in leaves:
            leaf.requires_grad_(False)


def _probed_with_grad(plan: Any, position: int, op: Any) -> bool:
    """Whether the probes below try the op at ``position`` with grad: one the program recorded autograd history
    through, and not a collective, which every rank calls as often and in the same order (once, as the walk does;
    a probe's second try would leave the other ranks waiting for it)."""
    return plan.specs[position].grad and not COLLECTIVE.match(op.name)


def grad_leaves(runner: StepRunner) -> list[torch.Tensor]:
    """The tensors the steps read before making them (parameters, inputs) that the program's grad-mode ops read, and
    that may require grad there: floating leaves, which the calibration (and the steps recording that history:
    :meth:`.StepRunner.record_history`) let require grad so that those ops record history. One pass over the steps, op
    by op, tries each such op with its own leaves requiring grad; where that fails, each leaf alone (a batch norm's
    running statistics are written in place: they cannot). Of those, the parameters, where the steps update some in
    place (an optimizer's step: their version counters moved in that pass): the data a step reads the program did
    not let require grad, and a linear layer whose input requires grad saves its weight too. Where the steps update
    none (steps that accumulate gradients without a step of the optimizer), every one."""
    plan, vals = runner.plan, runner.tensors.vals
    leaves: dict[int, torch.Tensor] = {}
    refused: set[int] = set()
    versions = {id(v): v._version for v in vals if isinstance(v, torch.Tensor)}

    def probe(position: int, op: Any) -> None:
        if _probed_with_grad(plan, position, op):
            mine = {id(v): v for _, _, slot in [*op.arg_slots, *op.kwarg_slots]
                    if slot in plan.externals and isinstance(v := vals[slot], torch.Tensor)
                    and v.is_floating_point() and v.is_leaf and not v.requires_grad and id(v) not in refused}
            if mine and not _runs_with_grad(op, vals, list(mine.values())):
                for key, leaf in mine.items():
                    if not _runs_with_grad(op, vals, [leaf]):
                        refused.add(key)
            leaves.update(mine)
        op.store(op.call(vals), vals, runner.tensors.generator)

    runner.walk(probe)
    found = [leaf for key, leaf in leaves.items() if key not in refused]
    return [leaf for leaf in found if leaf._version != versions.get(id(leaf), leaf._version)] or found


def _storages(tensors: Any) -> set[int]:
    """The data pointers of the storages of the strided tensors among ``tensors`` (nested lists and tuples)."""
    found = set()
    for item in flatten_tensors(tensors):
        if isinstance(item, torch.Tensor) and item.layout == torch.strided:
            found.add(item.untyped_storage().data_ptr())
    return found


def recordable_ops(runner: StepRunner, leaves: list[torch.Tensor]) -> dict[int, list[int]]:
    """The ops (positions) the program recorded autograd history through whose history the replay can record as it
    runs them (:meth:`.StepRunner.record_history`), the program's memory kept: those that save for their backward
    only tensors of their inputs' and outputs' storages, which the replay holds as the program did. An op that
    saves its own intermediates (a recurrent layer kept whole saves its gates) would hold them beside the storages
    the replay makes where the program made them (:mod:`.dataflow`'s births): recording every such op's history
    (and holding their outputs to the forward's end), a GRU tagger's replay held 45 % more than its program at its
    peak.
    An op none of whose inputs requires grad here records history where the program had let one require grad that
    :func:`grad_leaves` does not give (a parameter gathered anew each step, an input let require grad for its
    gradient, the output of an op left out above): its floating inputs that are leaves are let require grad right
    before it, as the steps then do (the op's position → those slots; most hold none). One that records no history
    even so is left out, its bookkeeping spent. One pass over the steps, op by op, ``leaves`` requiring grad and
    those ops run with grad mode on; one that fails so is left out."""
    plan, vals = runner.plan, runner.tensors.vals
    found: dict[int, list[int]] = {}
    saved: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)
        return tensor

    def probe(position: int, op: Any) -> None:
        if not _probed_with_grad(plan, position, op):
            op.store(op.call(vals), vals, runner.tensors.generator)
            return
        args, kwargs = op.arguments(vals)
        made: list[int] = []
        if not any(isinstance(t, torch.Tensor) and t.requires_grad
                   for t in flatten_tensors([args, list(kwargs.values())])):
            made = list(dict.fromkeys(
                slot for _, _, slot in [*op.arg_slots, *op.kwarg_slots]
                if isinstance(v := vals[slot], torch.Tensor) and v.is_floating_point() and v.is_leaf))
        for slot in made:
            vals[slot].requires_grad_(True)
        saved.clear()
        recorded = False
        try:
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                out = op.call(vals)
        except Exception:  # noqa: BLE001 - left out: it runs without grad, its bookkeeping spent
            for slot in made:
                vals[slot].requires_grad_(False)
            out = op.call(vals)
        else:
            own = _storages([args, list(kwargs.values())]) | _storages(out)
            recorded = any(isinstance(t, torch.Tensor) and t.grad_fn is not None for t in flatten_tensors(out)) \
                and all(p in own for p in _storages(saved))
            if recorded:
                found[position] = made
            else:  # as the steps run it: without grad, what it read not requiring grad for it
                for slot in made:
                    vals[slot].requires_grad_(False)
                out = [t.detach() if isinstance(t, torch.Tensor) and t.grad_fn is not None else t
                       for t in flatten_tensors(out)]
        saved.clear()
        op.store(out, vals, runner.tensors.generator)

    for leaf in leaves:
        leaf.requires_grad_(True)
    try:
        runner.walk(probe)
    finally:
        for leaf in leaves:
            leaf.requires_grad_(False)
        detach_all(vals)
    return found


def measure_autograd_cost(runner: StepRunner, synchronize: Callable[[], None], rounds: Rounds = FIXED_ROUNDS,
                          only: set[int] | None = None) -> tuple[list[float], str | None, int]:
    """The autograd bookkeeping per op the program recorded history through, one figure per sample
    (seconds), why there is none where the steps could not run with grad mode on, and how many rounds ran.

    Each step's generated code up to its last such op (the forward: the rest of the step does not
    change with grad mode, and would only add its own spread to the difference) runs with grad mode
    off around those ops and with it on (the steps' external floating inputs of those ops requiring
    grad), one run of each in turn, the order alternating, as many pairs as last
    :data:`MIN_SAMPLE_MS`, each round from the carried state as it was made; a sample is a round's
    difference over the step's such ops. Their outputs are held until each run's time is taken: the
    history they recorded is torn down outside it, as the program's is in its backward, whose host
    time the capture already counts (torn down inside, the figure came out twice GPT-2's forward with
    grad against without). A step whose grad-mode run fails (an in-place op on a tensor the program
    did not let require grad) leaves the figure unmeasured: 0, with the error. ``only``: of those ops, these
    positions alone (the others run without grad in both runs).
    """
    steps = len(runner.plan.sequence)
    grads = [[runner.plan.specs[p].grad and (only is None or p in only) for p in runner.plan.sequence[k]]
             for k in range(steps)]
    counts = [sum(g) for g in grads]
    if not any(counts):
        return [], None, 0
    ends = [max((j + 1 for j, g in enumerate(gs) if g), default=0) for gs in grads]
    keep: list[Any] = []  # the ops' outputs, and with them their history, until a run's time is taken
    variants = {grad: [runner.generated_step(k, grad_on=grad, keep=keep, only=only, upto=ends[k])[0]
                       for k in range(steps)] for grad in (False, True)}
    leaves, vals = grad_leaves(runner), runner.tensors.vals
    made = [{slot for p in runner.plan.sequence[k][:ends[k]] for slot in runner.plan.ops[p].out_slots
             if slot is not None and slot not in runner.plan.externals} for k in range(steps)]

    def timed(k: int, grad: bool) -> float:
        for leaf in leaves:
            leaf.requires_grad_(grad)
        try:
            with torch.no_grad():
                synchronize()
                started = time.perf_counter()
                variants[grad][k](vals)
                synchronize()
                return time.perf_counter() - started
        finally:
            keep.clear()  # the history torn down untimed: the program's backward does it
            detach_all(vals, made[k])  # what the rest of the steps read, without the history it recorded
            for leaf in leaves:
                leaf.requires_grad_(False)

    samples: list[float] = []
    r = 0
    try:
        repeats = []
        for k in range(steps):
            if counts[k]:
                timed(k, True)  # settles it, and finds a step that cannot run with grad
            repeats.append(max(1, min(MAX_REPEATS, math.ceil(MIN_SAMPLE_MS / max(1e3 * timed(k, False), 1e-3)))))
        grad_per_step = statistics.fmean(counts)
        began = time.perf_counter()
        while rounds.more(r, time.perf_counter() - began, samples, grad_per_step):
            runner.tensors.restore_values()  # a step run over and over drifts (denormal values run slower)
            for k in range(steps):
                if counts[k]:
                    took = {True: 0.0, False: 0.0}
                    for i in range(repeats[k]):
                        for grad in ((True, False) if (r + i) % 2 else (False, True)):
                            took[grad] += timed(k, grad)
                    samples.append((took[True] - took[False]) / (repeats[k] * counts[k]))
            r += 1
    except Exception as err:  # noqa: BLE001 - reported with the figure, which stays unmeasured
        return [], f"{type(err).__name__}: {str(err)[:300]}", r
    finally:
        runner.tensors.restore_values()
    return samples, None, r
