"""One rank's captured ops compiled and planned for replay: the sequence, what comes from where, what lives how long.

:func:`plan_replay` runs the planning passes in order — compile each op (:mod:`.compiler`), lay out
the step sequence, find what every op reads and what the replay must make itself
(:mod:`.dataflow`), give shape-deciding masks their captured counts (:mod:`.masks`), write the recorded
values of an integer tensor into it where a later op reads it (:func:`.dataflow.refill_pinned_reads`), and decide
when each tensor is freed (:mod:`.liveness`) — and returns the result as one :class:`ReplayPlan`,
which the synthesis and the step runner read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from workloads.trace_replay.compiler import OpCompiler
from workloads.trace_replay.dataflow import (
    Birth,
    Constraint,
    External,
    InputUse,
    find_births,
    find_externals,
    find_uninitialised_fills,
    find_wrapped_numbers,
    op_inputs,
    refill_pinned_reads,
)
from workloads.trace_replay.liveness import plan_clears
from workloads.trace_replay.masks import find_mask_pins
from workloads.trace_replay.ops import CompiledOp
from workloads.trace_replay.records import OpRecord


@dataclass
class ReplayPlan:
    """A rank's ops ready to replay, and what the replay knows of their tensors."""

    specs: list[OpRecord]  # the spec's ops, by index
    ops: list[CompiledOp]  # the same ops compiled, by index
    slots: dict[tuple, int]  # tensor key → slot in the value list
    sequence: list[list[int]]  # each step's op indices, repeated as asked
    inputs: list[list[InputUse]]  # by op index: the tensors it reads
    externals: dict[int, External]  # slots read before any op makes them
    constraints: list[Constraint]  # readers' recorded ranges and data of integer inputs
    births: dict[int, list[Birth]]  # flat position → storages the program made right after it
    born_slots: set[int]  # externals made within each step (a view of a storage in ``births``)
    external_masks: dict[int, torch.Tensor]  # externals that are masks with a captured count of True
    wrapped: dict[int, list[int]]  # op index → inputs that were Python numbers in the program
    clears: list[list[int]]  # flat position → slots to free after it

    def offset(self, k: int) -> int:
        """The flat position of step ``k``'s first op."""
        return sum(len(s) for s in self.sequence[:k])


def plan_replay(specs: list[OpRecord], device: torch.device, generator: torch.Generator, *, repeat: int = 1,
                process_group: Any = None, trust: bool = False) -> ReplayPlan:
    """Compile and plan a rank's ops; ``generator`` draws the masks' positions (it advances)."""
    # A training step (its backward ran): nothing the replay makes requires grad, so no graph is recorded;
    # every op but the few that need autograd on (:data:`.compiler.GRAD_MODE_OPS`) runs with it off
    training = any(s.startswith("autograd::engine::") for op in specs for s in op.scopes)
    compiler = OpCompiler(device, process_group=process_group, trust=trust, training=training)
    ops = [compiler.compile(i, op) for i, op in enumerate(specs)]
    slots = compiler.slots
    # The replay sequence: each step's ops, repeated; positions index into ops.
    sequence = [[op.index for op in ops if op.step == step] * repeat for step in sorted({op.step for op in specs})]
    inputs = [op_inputs(spec, slots) for spec in specs]
    externals, constraints = find_externals(sequence, ops, specs, inputs)
    births, born_slots = find_births(sequence, specs, inputs, externals)
    find_uninitialised_fills(ops, specs, inputs)
    external_masks = find_mask_pins(sequence, ops, specs, slots, externals, generator, device)
    refill_pinned_reads(sequence, ops)
    wrapped = find_wrapped_numbers(ops, inputs, externals)
    clears = plan_clears(sequence, ops, specs, inputs, externals, births, born_slots)
    return ReplayPlan(specs, ops, slots, sequence, inputs, externals, constraints, births, born_slots,
                      external_masks, wrapped, clears)
