"""Running a planned replay: the dry run that finds what cannot run, the generated steps, each op timed alone.

The dry run calls each op once, in step order: an op that fails is recorded with its error and
stood in for (outputs of its captured layout) from then on, so everything after it still runs,
and an op whose result takes another shape than captured is recorded as divergent. Steps then run
as generated straight-line code (:mod:`.codegen`), with the program's host time spent in the gaps
between ops when asked to; an op that fails only then sends its step back through the dry run.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from workloads.trace_replay.bindings import cached_binding
from workloads.trace_replay.codegen import HostSpeed, generate_step, seconds
from workloads.trace_replay.ops import CompiledOp, describe, fit_length
from workloads.trace_replay.plan import ReplayPlan
from workloads.trace_replay.sparse import captured_counts, fit_count, layout_divergence
from workloads.trace_replay.synthesis import Synthesis

OVERRUNS_KEPT = 4096  # steps whose overrun a runner keeps


def detach_all(vals: list[Any], slots: Iterable[int] | None = None) -> None:
    """Every tensor in ``vals`` (or in its ``slots``) that records autograd history kept without it (its history
    let go of)."""
    for slot in range(len(vals)) if slots is None else slots:
        if isinstance(value := vals[slot], torch.Tensor) and value.requires_grad:
            vals[slot] = value.detach()


@dataclass
class ReplayStats:
    """What the dry run found: ops that could not run, by index, with their errors."""

    errors: dict[int, str] = field(default_factory=dict)


class StepRunner:
    """Runs a plan's steps on its synthesised tensors; records which ops failed and which diverged."""

    def __init__(self, plan: ReplayPlan, tensors: Synthesis, *, host_gaps: bool = False,
                 tail_gaps_us: list[float] | None = None, host_spin_ns: float = 0.0,
                 host_speed_elasticity: float = 1.0):
        self.plan, self.tensors = plan, tensors
        self.host_gaps = host_gaps
        # the program's host time is host work: spent longer as this host runs slower than the capture's did
        # then, as much as the program's moved with it at capture (a spin loop read now against the capture's
        # reading: codegen.HostSpeed); None where not read
        self.speed = HostSpeed(host_spin_ns, elasticity=host_speed_elasticity) \
            if host_gaps and host_spin_ns > 0 else None
        self._tail_gaps_us = tail_gaps_us or [0.0] * len(plan.sequence)
        self._next = 0
        self._generated: list[tuple[Callable[[list[Any]], float], int] | None] = [None] * len(plan.sequence)
        self._bindings: dict[Any, Callable[..., Any] | None] = {}  # op and kinds of arguments → its binding
        self.errors: dict[int, str] = {}  # op index → why it did not run (compile, dry run or later)
        self.divergent: dict[int, str] = {}  # op index → how what it made differs from what the program made
        self._counts = captured_counts(plan.specs, plan.sequence)  # sparse outputs' stored elements, by op
        self.call_s = 0.0  # the replay's own host time per op call inside the ledger's op window (:mod:`.host_cost`)
        self.outside_s = 0.0  # and outside it, per op: what its ledger spends out of the program's gaps
        # per step run, the latest OVERRUNS_KEPT: how far its own work ran past the program's host time (a long
        # benchmark runs millions of steps; their median is what is reported)
        self.overrun_s: deque[float] = deque(maxlen=OVERRUNS_KEPT)
        # the autograd bookkeeping per op the program recorded history through (:mod:`.host_cost`), spent as
        # host time before each such op the replay runs without grad (those not in ``recorded``)
        self.autograd_s = 0.0
        self.recorded: set[int] = set()  # the ops (positions) that record the program's history as they run
        self.history_leaves: list[torch.Tensor] = []  # what requires grad while they do
        self.step_leaves: dict[int, list[int]] = {}  # and the slots let require grad right before these ops
        self.history_stopped: str | None = None  # why the steps stopped recording history, where they did

    @property
    def next_step(self) -> int:
        """The step :meth:`run_step` runs next."""
        return self._next

    def record_history(self, leaves: list[torch.Tensor], recorded: dict[int, list[int]]) -> None:
        """From now on, the ops at ``recorded`` (of those the program recorded autograd history through) run with
        grad mode on, ``leaves`` requiring grad (the floating tensors the steps read before making them that the
        program's did) and, right before each, the tensors in the slots ``recorded`` gives it (what the program let
        require grad that the leaves do not cover: :func:`.host_cost.recordable_ops`): each step records the
        program's history as those ops run, the bookkeeping inside each op's own time as it was in the program's,
        and tears it down after the last of them, before the ops of its backward (:func:`.codegen.generate_step`);
        the bookkeeping of the others is spent as host time (:attr:`autograd_s` each, a spin). Spent so for every
        op, the replay's ops ran faster than the
        program's on steps under 1 ms: a small op runs slower right after autograd's work than after a spin
        (docs/results.md, trace fidelity)."""
        for leaf in leaves:
            leaf.requires_grad_(True)
        self.history_leaves, self.recorded = list(leaves), set(recorded)
        self.step_leaves = {p: slots for p, slots in recorded.items() if slots}
        self.regenerate()

    def stop_history(self, reason: str | None) -> None:
        """Run every op without grad again, spending the measured bookkeeping as host time (see
        :meth:`record_history`); ``reason``: why, where the steps could not go on recording (None: to be
        measured again)."""
        for leaf in self.history_leaves:
            leaf.requires_grad_(False)
        self.history_leaves, self.recorded, self.step_leaves = [], set(), {}
        detach_all(self.tensors.vals)
        self.history_stopped = reason
        self.regenerate()

    def regenerate(self) -> None:
        """Generate each step's code again on its next run (ops failed, or the host cost changed)."""
        self._generated = [None] * len(self.plan.sequence)

    def exclude(self, reasons: dict[int, str]) -> None:
        """Never run these ops (e.g. they crashed a probe process); they count as failed, with the reason."""
        for index, reason in reasons.items():
            self.plan.ops[index].error = reason
        self.regenerate()

    def dry_run(self, before_op: Callable[[int], object] | None = None, steps: list[int] | None = None) -> ReplayStats:
        """Run every step (or ``steps``) once op by op; ops that fail are recorded and stood in for from then on.

        ``before_op(index)`` is called before each op runs (the crash probe writes it down).
        Failures accumulate in :attr:`errors`.
        """
        stats = ReplayStats()
        for op in self.plan.ops:
            if op.error is not None:
                stats.errors[op.index] = op.error
        integer_stand_ins: dict[int, int] = {}  # slot → the failed op whose output it stands in for
        with torch.no_grad():
            for k in range(len(self.plan.sequence)) if steps is None else steps:
                offset = self.plan.offset(k)
                for j, position in enumerate(self.plan.sequence[k]):
                    op = self.plan.ops[position]
                    if op.error is None:
                        # Index-like inputs invented for a failed op could send an unchecked kernel out
                        # of bounds: ops reading them are skipped too, with the reason.
                        culprit = next((integer_stand_ins[s] for s, *_ in self.plan.inputs[position]
                                        if s in integer_stand_ins), None)
                        if culprit is not None:
                            op.error = f"skipped: reads an integer output of failed op #{culprit}"
                            stats.errors[op.index] = op.error
                    if op.error is None:
                        if before_op is not None:
                            before_op(op.index)
                        try:
                            if not op.bound:  # the generated steps' quicker way in, where there is one
                                op.binding, op.bound = cached_binding(op.fn, *op.arguments(self.tensors.vals),
                                                                      self._bindings), True
                            self._call_or_unalias(position)
                            self._check_shapes(op)
                        except Exception as err:  # noqa: BLE001 - recorded per op; replay goes on
                            op.error = describe(err)
                            stats.errors[op.index] = op.error
                    if op.error is not None:
                        self.tensors.stand_in(op)
                        integer_stand_ins.update(
                            (slot, op.index) for slot, info in zip(op.out_slots, op.out_infos, strict=False)
                            if slot is not None and info is not None and not info.dtype.is_floating_point)
                    self.tensors.give_birth(offset + j)
        if steps is None:
            self._next = 0
        self.regenerate()  # ops that failed are stood in for now
        self.errors.update(stats.errors)
        return stats

    def _check_shapes(self, op: CompiledOp) -> None:
        """Record in :attr:`divergent` an op whose result's shape differs from the captured one (its inputs'
        values decided it differently): it ran, but not as the program's did. The first output only: a
        fused kernel's bookkeeping outputs (``_embedding_bag``'s offset2bag, a batch norm's saved
        statistics) take shapes its code path chooses, which its backward reads either way. A 1-D integer
        output of another length (an NMS keep list: how many boxes survive depends on the scores) is cut
        or cycled to the captured length from then on (:attr:`CompiledOp.lengths`), like a mask's count.
        Every output: one the program made with no storage of its own must come out sparse (and one it made over
        a storage strided), storing as many elements as the program's did where the trace says (:mod:`.sparse`)."""
        slot, info = (op.out_slots[0], op.out_infos[0]) if op.out_slots else (None, None)
        value = self.tensors.vals[slot] if slot is not None else None
        if (info is not None and isinstance(value, torch.Tensor) and value.dim() == 1 and len(info.shape) == 1
                and not value.is_floating_point() and value.dtype != torch.bool and value.shape[0] != info.shape[0]
                and not op.lengths):
            # a keep list (NMS) whose length the values decided: the captured length, from its own elements
            op.lengths.append((slot, info.shape[0]))
            self.tensors.vals[slot] = fit_length(value, info.shape[0])
            return
        if info is not None and isinstance(value, torch.Tensor) and tuple(value.shape) != info.shape:
            self.divergent.setdefault(op.index, f"made shape {list(value.shape)} where the program made "
                                                f"{list(info.shape)}")
        for slot, info in zip(op.out_slots, op.out_infos, strict=False):
            if slot is None or info is None:
                continue
            value = self.tensors.vals[slot]
            if why := layout_divergence(info.storageless, value):
                self.divergent.setdefault(op.index, why)
            elif info.storageless and isinstance(value, torch.Tensor) and value.layout == torch.sparse_coo \
                    and not op.counts and (count := self._counts.get(op.index)) is not None \
                    and value._nnz() != count:
                # a sparse tensor whose count of stored elements its inputs' values decided (coalesce): the
                # captured count, from its own elements, from then on
                op.counts.append((slot, count))
                self.tensors.vals[slot] = fit_count(value, count, self.tensors.generator)

    def _call_or_unalias(self, position: int) -> None:
        """Run an op; if it refuses inputs that overlap in memory, give its synthesised inputs storage of
        their own and try once more. The observer's storage ids come from data addresses, which are
        reused after frees, so two tensors the program never aliased can arrive with one storage id."""
        op = self.plan.ops[position]
        try:
            op.store(op.call(self.tensors.vals), self.tensors.vals, self.tensors.generator)
        except RuntimeError as err:
            shared = [slot for slot, *_ in self.plan.inputs[position] if slot in self.plan.externals]
            if "single memory location" not in str(err) and "overlap" not in str(err) or not shared:
                raise
            for slot in shared:
                self.tensors.vals[slot] = self.tensors.vals[slot].clone()
            op.store(op.call(self.tensors.vals), self.tensors.vals, self.tensors.generator)

    def run_step(self) -> int:
        """Replay the next captured step (cycling); returns how many ops ran."""
        k = self._next
        self._next = (k + 1) % len(self.plan.sequence)
        if self._generated[k] is None:
            self._generated[k] = self.generated_step(k)
        step, ran = self._generated[k]
        try:
            with torch.no_grad():
                self.overrun_s.append(step(self.tensors.vals))
            if self.speed is not None:
                self.speed.update()
        except Exception as err:  # noqa: BLE001 - an op failed only now (its inputs differ from the dry run's)
            if self.recorded:  # perhaps for recording history (the dry run runs without): spent instead
                self.stop_history(f"step {k} failed while recording autograd history: {describe(err)}")
            self.dry_run(steps=[k])  # find it op by op: recorded, stood in for, the code regenerated
        return ran

    def generated_step(self, k: int, *, no_gap_time: bool = False, grad_on: bool | None = None,
                       keep: list[Any] | None = None, only: set[int] | None = None,
                       upto: int | None = None) -> tuple[Callable[[list[Any]], float], int]:
        """Step ``k`` as one generated function (:func:`codegen.generate_step`); ``no_gap_time``: the
        same code with every host gap zero (what :func:`.host_cost.measure_call_cost` measures);
        ``grad_on``: that code with grad mode set to it around each op the program recorded autograd
        history through (what :func:`.host_cost.measure_autograd_cost` compares), their outputs
        appended to ``keep``, with every gap zero (``only``: of those ops, these positions alone). ``upto``: the
        step's first that many ops only. Neither given, with host gaps, where the steps record history
        (:meth:`record_history`), those ops run with grad mode on, their history torn down after the last of them."""
        positions = self.plan.sequence[k][:upto]
        offset = self.plan.offset(k)
        tear_down = leaves_at = None
        grad = None if grad_on is None else [self.plan.specs[p].grad and (only is None or p in only)
                                             for p in positions]
        if self.recorded and grad_on is None and not no_gap_time and self.host_gaps:
            recorded = [p in self.recorded and self.plan.ops[p].error is None for p in positions]
            if any(recorded):  # the step records the program's history as it runs
                leaves_at = [self.step_leaves.get(p, []) if r else []
                             for p, r in zip(positions, recorded, strict=True)]
                made = sorted({slot for p, r in zip(positions, recorded, strict=True) if r
                               for slot in self.plan.ops[p].out_slots if slot is not None}
                              | {slot for slots in leaves_at for slot in slots})
                # torn down: what they made, kept without it for the ops after
                tear_down = (max(j for j, r in enumerate(recorded) if r), functools.partial(detach_all, slots=made))
                grad, grad_on, keep = recorded, True, None
        no_gap_time = no_gap_time or (grad_on is not None and tear_down is None)
        gaps = None
        if self.host_gaps:
            gaps = [0.0] * len(positions) if no_gap_time else self.gaps_s(positions)
        tail = self.tail_gap_s(k) if self.host_gaps and not no_gap_time else 0.0
        births = [offset + j if offset + j in self.plan.births else None for j in range(len(positions))]
        return generate_step(self.plan.ops, positions, self.plan.clears[offset:offset + len(positions)], gaps, tail,
                             call_s=0.0 if no_gap_time else self.call_s,
                             outside_s=0.0 if no_gap_time else self.outside_s, births=births,
                             grad=grad, grad_on=bool(grad_on), keep=keep,
                             stand_in=lambda i: self.tensors.stand_in(self.plan.ops[i]),
                             fill=lambda i: self.plan.ops[i].store_fills(self.tensors.vals, self.tensors.generator),
                             born=self.tensors.give_birth, name=f"step {k}",
                             speed=None if no_gap_time else self.speed, tear_down=tear_down, leaves_at=leaves_at)

    def gaps_s(self, positions: list[int]) -> list[float]:
        """The host time to spend before each of these ops (seconds): the program's gap, plus the autograd
        bookkeeping before each op the program recorded history through that does not record it here."""
        return [seconds(self.plan.specs[p].gap_us) + (self.plan.specs[p].grad and p not in self.recorded)
                * self.autograd_s for p in positions]

    def tail_gap_s(self, k: int) -> float:
        """The host time to spend after step ``k``'s last op (seconds)."""
        return seconds(self._tail_gaps_us[k])

    def spun_s(self) -> float:
        """What the steps spin, on average a step, with the costs measured so far (seconds): the program's host
        time less the replay's own work (its calls, and the rest per op), which the ledger spends out of it."""
        total = 0.0
        for k, positions in enumerate(self.plan.sequence):
            total += max(0.0, sum(self.gaps_s(positions)) + self.tail_gap_s(k)
                         - len(positions) * (self.call_s + self.outside_s))
        return total / max(1, len(self.plan.sequence))

    def walk(self, run_op: Callable[[int, CompiledOp], None]) -> None:
        """One pass over every step op by op, as the steps run: ``run_op(position, op)`` runs each op that
        has not failed (one that raises is recorded as failed, as in :meth:`run_step`, and stood in for from
        then on); then what the program made after it is made and what it read last is let go."""
        vals = self.tensors.vals
        with torch.no_grad():
            for k, step in enumerate(self.plan.sequence):
                offset = self.plan.offset(k)
                for j, position in enumerate(step):
                    op = self.plan.ops[position]
                    if op.error is None:
                        try:
                            run_op(position, op)
                        except Exception as err:  # noqa: BLE001 - recorded like a dry-run failure
                            op.error = self.errors[op.index] = describe(err)
                            self.regenerate()
                    if op.error is not None:
                        self.tensors.stand_in(op)
                    self.tensors.give_birth(offset + j)
                    for slot in self.plan.clears[offset + j]:
                        vals[slot] = None
        self._next = 0

    def time_ops(self, synchronize: Callable[[], None]) -> dict[int, list[float]]:
        """One pass over every step with each op timed alone (synchronised): op index → seconds."""
        times: dict[int, list[float]] = {}
        vals = self.tensors.vals

        def timed(_: int, op: CompiledOp) -> None:
            synchronize()
            started = time.perf_counter()
            op.store(op.call(vals), vals, self.tensors.generator)
            synchronize()
            times.setdefault(op.index, []).append(time.perf_counter() - started)

        self.walk(timed)
        return times
