"""Replay one rank's captured steps on any device: a short facade over the pieces that do the work.

- :mod:`.plan` compiles each captured op (:mod:`.compiler`: the dispatcher op its schema names, its
  call template, the value slots its tensors come from and go to; collectives through
  ``torch.distributed`` on the replay's process group) and plans the dataflow (:mod:`.dataflow`,
  :mod:`.masks`): what each op reads, what the steps read but never make, and when each tensor is
  freed (:mod:`.liveness`), as late as the program held it.
- :mod:`.synthesis` makes what the steps read but never made (parameters, optimiser state, inputs)
  once, before timing, with defined contents (:mod:`.tensors`), and what the program made between
  ops at that point of each step.
- :mod:`.execute` dry-runs the steps (an op that cannot run is recorded with its error and stood in
  for by outputs of the captured shapes, so everything after it still runs), then runs each step
  as straight-line code (:mod:`.codegen`) with the program's host time spent in the gaps between
  ops when asked to, less the replay's own cost per call (:mod:`.host_cost`).

What may run at all is :mod:`.policy`'s, checked before a replay is built (:mod:`.safety`).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch

from workloads.trace_replay.dataflow import External
from workloads.trace_replay.execute import ReplayStats, StepRunner
from workloads.trace_replay.host_cost import (
    FIXED_ROUNDS,
    Rounds,
    grad_leaves,
    measure_autograd_cost,
    measure_call_cost,
    measure_gap_excess,
    recordable_ops,
    settled_excess,
)
from workloads.trace_replay.host_time import COLLECTIVE
from workloads.trace_replay.ops import CompiledOp
from workloads.trace_replay.plan import plan_replay
from workloads.trace_replay.records import RankRecord
from workloads.trace_replay.synthesis import Synthesis


class Replayer:
    """Replays one rank's ops; :meth:`run_step` replays the next captured step."""

    def __init__(self, rank_spec: RankRecord, device: torch.device, *, repeat: int = 1,
                 process_group: Any = None, seed: int = 0, host_gaps: bool = False, trust: bool = False,
                 record_history: bool = True):
        self.device, self.repeat = device, repeat
        self.host_gaps = host_gaps
        # with host gaps, the steps record the autograd history the program recorded, where they can
        # (StepRunner.record_history); else they spend its bookkeeping as host time
        self.record_history = record_history
        self.generator = torch.Generator().manual_seed(seed)
        # the capture's per-step host-time measurements the gaps' median came from
        self.gap_samples_us = next((list(s.host_gap_samples_us) for s in rank_spec.steps if s.host_gap_samples_us), [])
        # the time inside the replayed ops per step while the program's host time was measured
        self.program_op_us = next((s.program_op_us for s in rank_spec.steps if s.program_op_us > 0), 0.0)
        self.op_samples_us: list[float] = []  # the replay's own, per calibration round (set by calibrate_host_cost)
        self.process_group = process_group
        self.plan = plan_replay(rank_spec.ops, device, self.generator, repeat=repeat, process_group=process_group,
                                trust=trust)
        self.tensors = Synthesis(self.plan, device, self.generator, rank_spec.external_values)
        tails = {s.index: s.tail_gap_us for s in rank_spec.steps}
        tail_gaps_us = [tails.get(step, 0.0) for step in sorted({op.step for op in rank_spec.ops})]
        measured = next((s for s in rank_spec.steps if s.host_spin_ns > 0), None)
        self.runner = StepRunner(self.plan, self.tensors, host_gaps=host_gaps, tail_gaps_us=tail_gaps_us,
                                 host_spin_ns=measured.host_spin_ns if measured else 0.0,
                                 host_speed_elasticity=measured.host_speed_elasticity if measured else 1.0)
        self.call_samples_s: list[float] = []
        self.autograd_samples_s: list[float] = []
        self.outside_samples_s: list[float] = []
        self.gap_excess_samples_s: list[float] = []  # the call cost's excess between gaps (measure_gap_excess)
        self.gap_excess_applied_s = 0.0  # what of it was added to the call cost (settled_excess)
        self.autograd_unmeasured: str | None = None  # why the autograd bookkeeping was not measured
        self.autograd_every_op_s = 0.0  # its median per op over every such op (what spent would hold for all)
        self.calibration_rounds: dict[str, int] = {}  # calibration → the rounds it ran (calibrate_host_cost)

    @property
    def ops(self) -> list[CompiledOp]:
        return self.plan.ops

    @property
    def grad_ops_per_step(self) -> float:
        """The ops a step recorded autograd history through, on average over the captured steps: those the
        replay records that history through, or spends its bookkeeping for."""
        return statistics.fmean(sum(self.plan.specs[p].grad for p in step) for step in self.plan.sequence) \
            if self.plan.sequence else 0.0

    @property
    def records_history(self) -> bool:
        """Whether the steps record the program's autograd history as they run (the bookkeeping inside their
        ops' own time, none spent as host time): set by :meth:`calibrate_host_cost`."""
        return bool(self.runner.recorded)

    @property
    def spent_grad_ops_per_step(self) -> float:
        """Of :attr:`grad_ops_per_step`, those the steps do not record the history of: the replay spends their
        bookkeeping as host time (:attr:`autograd_s` each)."""
        recorded = self.runner.recorded
        return statistics.fmean(sum(self.plan.specs[p].grad and p not in recorded for p in step)
                                for step in self.plan.sequence) if self.plan.sequence else 0.0

    @property
    def sequence(self) -> list[list[int]]:
        """Each step's op indices, in replay order."""
        return self.plan.sequence

    @property
    def vals(self) -> list[Any]:
        """The replay's values, by slot."""
        return self.tensors.vals

    @property
    def externals(self) -> dict[int, External]:
        """The slots the steps read before any op makes them, with their layouts."""
        return self.plan.externals

    @property
    def errors(self) -> dict[int, str]:
        """Op index → why it did not run (compile, dry run or later)."""
        return self.runner.errors

    @property
    def divergent(self) -> dict[int, str]:
        """Op index → how what it made differs from what the program made."""
        return self.runner.divergent

    @property
    def call_s(self) -> float:
        """The replay's own host time per op call: set by :meth:`calibrate_host_cost`."""
        return self.runner.call_s

    @property
    def static_bytes(self) -> int:
        """Bytes of the synthesised tensors that live across steps: set by :meth:`materialize`."""
        return self.tensors.static_bytes

    def materialize(self) -> None:
        """Synthesise every tensor the steps read but never make (:meth:`.Synthesis.materialize`)."""
        self.tensors.materialize()

    def restore_values(self) -> None:
        """Put the floating state carried across steps back as it was made (:meth:`.Synthesis.restore_values`)."""
        self.tensors.restore_values()

    def nonfinite_tensors(self) -> int:
        """How many tensors carried across steps hold an infinite or NaN element."""
        return self.tensors.nonfinite_tensors()

    def exclude(self, reasons: dict[int, str]) -> None:
        """Never run these ops (e.g. they crashed a probe process); they count as failed, with the reason."""
        self.runner.exclude(reasons)

    def dry_run(self, before_op: Callable[[int], object] | None = None, steps: list[int] | None = None) -> ReplayStats:
        """Run every step (or ``steps``) once op by op, recording what fails (:meth:`.StepRunner.dry_run`)."""
        return self.runner.dry_run(before_op, steps)

    def run_step(self) -> int:
        """Replay the next captured step (cycling); returns how many ops ran."""
        return self.runner.run_step()

    @property
    def next_step(self) -> int:
        """The captured step :meth:`run_step` replays next (0: every one has run as often)."""
        return self.runner.next_step

    def time_ops(self, synchronize: Callable[[], None]) -> dict[int, list[float]]:
        """One pass over every step with each op timed alone (synchronised): op index → seconds."""
        return self.runner.time_ops(synchronize)

    def calibrate_host_cost(self, synchronize: Callable[[], None], rounds: Rounds = FIXED_ROUNDS) -> float:
        """Measure the replay's own host time per op call inside its ledger's op window (seconds; the median of
        :func:`.host_cost.measure_call_cost`'s figures), which the host gaps it spends then leave out, and the autograd
        bookkeeping per op the program recorded history through (:func:`.host_cost.measure_autograd_cost`); then the
        steps record that history as they run (:meth:`.StepRunner.record_history`, where ``record_history``), or the
        gaps add that bookkeeping; returns the call cost, 0 without host gaps. Where it is not measured (steps that
        hold collectives: the two runs compared would have to be in lockstep on every rank; a forward that fails with
        grad mode on around all those ops at once), the steps record the history all the same where they can, and
        spend none for the others. (Its work outside the window its ledger spends out of the gaps as the steps run;
        measured here too, for what the steps spin.) The call cost is measured with the ops back to back and then set
        to what it is as the steps run, between their gaps: whatever host time the steps take beyond what they mean to
        spend (:func:`.host_cost.measure_gap_excess`), as far as its rounds agree on it
        (:func:`.host_cost.settled_excess`), is added to it, so that the gaps leave that out too. ``rounds``: how many
        rounds each of the two measurements runs."""
        if not self.host_gaps:
            return 0.0
        if self.records_history:  # measured again: as the program's ops, without grad, and the two compared
            self.runner.stop_history(None)
        # a judgement resamples the call cost
        self.call_samples_s, self.outside_samples_s, self.op_samples_us, self.calibration_rounds["calls"] = \
            measure_call_cost(self.runner, synchronize, rounds, process_group=self.process_group)
        self.runner.call_s = statistics.median(self.call_samples_s) if self.call_samples_s else 0.0
        self.runner.outside_s = statistics.median(self.outside_samples_s) if self.outside_samples_s else 0.0
        collectives = any(COLLECTIVE.match(op.name) for op in self.plan.ops)
        if collectives:  # its variants would have to run in lockstep on every rank
            self.autograd_unmeasured = "not measured on steps that hold collectives"
        else:
            self.autograd_samples_s, self.autograd_unmeasured, self.calibration_rounds["autograd"] = \
                measure_autograd_cost(self.runner, synchronize, rounds)
        self.runner.autograd_s = max(0.0, statistics.median(self.autograd_samples_s)) if self.autograd_samples_s \
            else 0.0
        self.autograd_every_op_s = self.runner.autograd_s
        if self.record_history and self.grad_ops_per_step:
            # recorded where measured or not (the probes finding what can record it call each collective once, as
            # a step does; one op failing with grad mode on fails the measurement, and is left out here alone)
            leaves = grad_leaves(self.runner)
            if recorded := recordable_ops(self.runner, leaves):
                spent = {p for step in self.plan.sequence for p in step if self.plan.specs[p].grad} - recorded.keys()
                if spent and self.autograd_samples_s:  # the bookkeeping of those left out is theirs, not the average
                    samples, unmeasured, self.calibration_rounds["autograd_spent"] = \
                        measure_autograd_cost(self.runner, synchronize, rounds, only=spent)
                    if unmeasured is None and samples:
                        self.autograd_samples_s = samples
                        self.runner.autograd_s = max(0.0, statistics.median(samples))
                    else:
                        recorded = {}  # as it was measured for every op: spent for every op
            if recorded:
                self.runner.record_history(leaves, recorded)
        self.runner.regenerate()  # with the measured costs
        rounds = measure_gap_excess(self.runner, synchronize)
        self.gap_excess_samples_s = [e for r in rounds for e in r]
        # each call costs more spent between gaps than back to back: the call cost as the steps run, by as
        # much as the rounds agree on (a moment's load reads anything, either way)
        self.gap_excess_applied_s = max(settled_excess(rounds), -self.runner.call_s)
        if added := self.gap_excess_applied_s:
            self.call_samples_s = [max(0.0, c + added) for c in self.call_samples_s]
            self.runner.call_s += added
            self.runner.regenerate()
        return self.runner.call_s

    def op_time_ratio(self) -> tuple[float | None, str | None]:
        """The replay's time inside its ops (plus the autograd bookkeeping the program did inside them, which
        the replay measured and does not do) ÷ the program's at capture, both without the profiler's cost
        (:func:`.host_time.replayed_op_time`); or None and why. A figure, not a correction: the host gaps
        are spent as measured.

        Scaling the host time by it was tried. Six side-by-side comparisons, each in one process after one
        capture (ViT, ConvNeXt, GPT-2, two captures each), read the scaled replay 2.3 points slower than
        the unscaled one on average, slower in five of the six. The ratio moves with the machine between
        the capture and the replay's setup, which is not its speed while the replay is judged, and with
        whatever makes the replay's ops unlike the program's, which scaling the host time only adds to.
        As a figure it says where a time error may lie: above 1, the replay's ops ran slower at its setup
        than the program's at capture (a busier machine then, or ops unlike the program's). On an
        accelerator both are the host's time launching the ops (the program's backward ops on the autograd
        engine's device thread counted too)."""
        if not (self.program_op_us > 0 and self.op_samples_us):
            return None, "the spec or the calibration holds no op time (a spec from an older capture)"
        grad_ops = self.grad_ops_per_step
        if grad_ops and self.autograd_unmeasured:
            return None, "the autograd bookkeeping inside the program's op time is not measured"
        return (statistics.median(self.op_samples_us) + grad_ops * 1e6 * self.autograd_every_op_s) \
            / self.program_op_us, None

    @property
    def autograd_s(self) -> float:
        """The autograd bookkeeping per op the program recorded history through (seconds), spent as host
        time before each whose history the steps do not record (:attr:`records_history`): set by
        :meth:`calibrate_host_cost`."""
        return self.runner.autograd_s
