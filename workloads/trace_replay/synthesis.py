"""The tensors a replay reads but no replayed op makes: synthesised with defined contents, restored, checked.

Tensors the steps read but never produced (parameters, optimiser state, inputs) are synthesised
once, before timing: one buffer per captured storage, sized from the true extent of every view of
it, each view laid over it, filled with the values their readers recorded (:mod:`.tensors`). A
storage the program made itself between ops (the spec's ``born``) is made at that point of each
step instead. The floating state carried across steps can be put back as it was made, and an op
that could not run is stood in for by outputs of its captured layout.
"""

from __future__ import annotations

import bisect
import math
from typing import Any

import torch

from workloads.trace_replay.dataflow import Constraint, External
from workloads.trace_replay.ops import CompiledOp
from workloads.trace_replay.plan import ReplayPlan
from workloads.trace_replay.records import ValueStats
from workloads.trace_replay.tensors import copy_recorded, fill_view, match_scalars, match_values, stand_in

HELD_ALIGN = 64  # bytes: each storage laid over a composite's held buffer starts on such a boundary
HELD_CHUNKS = 8  # a composite's held memory is made in at most this many buffers, freed one by one


class Synthesis:
    """The replay's value list (:attr:`vals`, by slot) and the tensors it makes itself."""

    def __init__(self, plan: ReplayPlan, device: torch.device, generator: torch.Generator,
                 external_values: list[Any]):
        self.plan, self.device, self.generator = plan, device, generator
        self.vals: list[Any] = [None] * len(plan.slots)
        self.external_values = external_values  # what the program's own floating inputs held
        self.static_bytes = 0  # synthesised tensors (parameters, optimiser state, inputs): set by materialize()
        self._values_of: dict[tuple[int, torch.dtype], ValueStats] = {}
        self._initial_values: list[tuple[torch.Tensor, torch.Tensor]] = []  # (storage's bytes, their copy)
        self._birth_plans: dict[int, tuple[dict, list, list, int]] = {}
        self._flat = [p for positions in plan.sequence for p in positions]  # flat position → op index
        self._held_templates: dict[int, tuple[torch.Tensor, list]] = {}  # see _give_birth_held
        self._freed: dict[int, list[int]] | None = None  # slot → the flat positions after which it is freed

    def materialize(self) -> None:
        """Synthesise every external tensor that lives across steps: one buffer per captured storage,
        views laid over it (those the program makes during a step are made there: :meth:`give_birth`)."""
        static = {slot: entry for slot, entry in self.plan.externals.items() if slot not in self.plan.born_slots}
        reader: dict[tuple[int, torch.dtype], str] = {}  # each storage's first reader
        for positions in self.plan.sequence:
            for p in positions:
                for use in self.plan.inputs[p]:
                    reader.setdefault((use.info.storage_id, use.info.dtype), self.plan.ops[p].name)
        self._values_of = match_values([((info.storage_id, info.dtype), info.shape, info.dtype,
                                         reader.get((info.storage_id, info.dtype)))
                                        for info, _, _ in static.values() if info.dtype.is_floating_point],
                                       self.external_values)
        self.static_bytes = self._lay_out(static)  # what lives across steps
        for slot, mask in self.plan.external_masks.items():
            if slot in static:
                self.vals[slot].copy_(mask)
        # 0-dim floats no op made, with the program's values read by read, each in storage of its own (the
        # observer's storage ids repeat where the program made one at the address the last one freed)
        viewed = {(info.storage_id, info.dtype) for info, _, _ in static.values() if info.shape != ()}
        reads = [[(use.slot, self.plan.ops[p].name, use.info.dtype) for p in positions for use in self.plan.inputs[p]
                  if use.slot in static and use.info.shape == () and use.info.dtype.is_floating_point
                  and (use.info.storage_id, use.info.dtype) not in viewed] for positions in self.plan.sequence]
        for slot, value in match_scalars(reads, self.external_values).items():
            self.vals[slot] = torch.full((), value, dtype=static[slot].info.dtype, device=self.device)
        for index, slots in self.plan.wrapped.items():  # Python numbers in the program: Python numbers again
            op = self.plan.ops[index]
            for pos, sub, slot in [entry for entry in op.arg_slots if entry[2] in slots and entry[1] < 0]:
                if isinstance(self.vals[slot], torch.Tensor):
                    op.args[pos] = self.vals[slot].item()
                    op.arg_slots.remove((pos, sub, slot))
        self._initial_values, seen = [], set()  # the floating state as made, for restore_values()
        for slot, (info, _, _) in static.items():
            value = self.vals[slot]
            if info.dtype.is_floating_point and isinstance(value, torch.Tensor) and value.numel():
                storage = value.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    whole = torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage)
                    self._initial_values.append((whole, whole.to("cpu", copy=True)))

    def restore_values(self) -> None:
        """Put the floating state carried across steps (parameters, optimiser state) back as it was made.

        A replay runs the same captured steps again and again, on the same batches, and its state drifts
        where the program's, on fresh batches, does not; a CPU's kernels slow down on the subnormal floats
        it may sink into. With an optimiser's Python numbers made up it sank fast (GPT-2: 73 op calls a step
        with subnormal inputs after 300 replayed steps, ViT 116); with the program's own
        (:func:`.tensors.match_scalars`), 4 and 0. Restoring between measurements keeps the replay where
        the program was.
        The copy is in host memory; this costs a copy, not a step.
        """
        with torch.no_grad():
            for whole, initial in self._initial_values:
                whole.copy_(initial)

    def give_birth(self, k: int) -> None:
        """Make the storages the program made right after flat position ``k``, with defined contents."""
        if k not in self._birth_plans:  # each step pays for the buffers, not for working out their layout
            births, every = self.plan.births.get(k, []), self.plan.externals
            constrained = {(c[0].storage_id, c[0].dtype) for c in self.plan.constraints}
            # floating storages without recorded constraints (on the CPU, where the generator lives): one
            # buffer each, filled whole in one call, views laid over it; the others by the general path, each
            # storage on its own: one integer storage among a recurrent layer's 240 born together (the labels,
            # read later with their recorded values) had sent them all that way, 380 views a step made and filled
            # one by one, and the GRU tagger's replay ran +142 % slow
            general = {key for key, _ in births
                       if key in constrained or self.device.type != "cpu" or not key[1].is_floating_point}
            externals = {slot: every[slot] for key, slots in births if key in general for slot in slots}
            constraints = [c for c in self.plan.constraints if (c[0].storage_id, c[0].dtype) in general]
            fast = [(max(every[s].info.offset + every[s].info.extent for s in slots), key[1],
                     [(s, every[s].info) for s in slots]) for key, slots in births if key not in general]
            self._birth_plans[k] = (externals, constraints, fast, self.plan.specs[self._flat[k]].held_bytes)
        externals, constraints, fast, held = self._birth_plans[k]
        laid_out = self._lay_out(externals, constraints) if externals else 0
        if not fast:
            return
        if held:
            self._give_birth_held(k, fast, max(held - laid_out, 0))
            return
        for numel, dtype, views in fast:
            whole = torch.empty(max(numel, 1), dtype=dtype, device=self.device)
            whole.uniform_(0.1, 1.0, generator=self.generator)  # see tensors.fill_view: positive, defined
            for slot, info in views:
                self.vals[slot] = whole.as_strided(info.shape, info.stride, info.offset)

    def _give_birth_held(self, k: int, fast: list[tuple[int, torch.dtype, list[tuple[int, Any]]]],
                         held: int) -> None:
        """What a composite op kept whole held at its return (``held`` bytes: a recurrent layer's gates and
        states, saved for backward), made as the program made it: all at once, in at most
        :data:`HELD_CHUNKS` buffers, the storages later ops read laid over them and the rest of ``held``
        spread over them by their bytes (nothing reads it). Its storages are grouped in the order the replay
        frees them (as the program freed them, :mod:`.liveness`), so that the memory goes as the program's
        backward let it go, a chunk at a time: one buffer for all of them lived until the last was freed,
        and the GRU tagger's replayed step peaked at 0.883 MB where its captured steps held 0.753 (0.748 in
        eight). Each buffer is a copy of one made and filled once (in [0.1, 1), as
        :func:`.tensors.fill_view` fills where nothing is known): made one by one, each filled, the GRU
        tagger's 97 storages a step cost its replay more host time than keeping the op whole saved."""
        if k not in self._held_templates:
            entries = sorted(fast, key=lambda entry: max(self._freed_after(slot, k) for slot, _ in entry[2]))
            sizes = [max(numel, 1) * dtype.itemsize for numel, dtype, _ in entries]
            born, rest = sum(sizes), max(held - sum(sizes), 0)
            groups: list[list[int]] = []  # runs of about equal bytes, in the order they are freed
            done = 0
            for n, size in enumerate(sizes):
                if not groups or done >= born * len(groups) / HELD_CHUNKS:
                    groups.append([])
                groups[-1].append(n)
                done += size
            chunks, at = [], 0  # (where a chunk begins in the template, its storages, where it ends)
            for members in groups:
                begin, layout = at, []
                for n in members:
                    numel, dtype, views = entries[n]
                    at = -(-at // HELD_ALIGN) * HELD_ALIGN
                    layout.append(((at - begin) // dtype.itemsize, max(numel, 1), dtype, views))
                    at += sizes[n]
                at += rest * sum(sizes[n] for n in members) // max(born, 1)  # its share of what nothing reads
                at = -(-at // HELD_ALIGN) * HELD_ALIGN
                chunks.append((begin, layout, at))
            template = torch.empty(max(at, 1), dtype=torch.uint8, device=self.device)
            for begin, layout, end in chunks:
                typed = {dtype: template[begin:end].view(dtype) for _, _, dtype, _ in layout}
                for start, numel, dtype, _ in layout:
                    typed[dtype][start:start + numel].uniform_(0.1, 1.0, generator=self.generator)
            self._held_templates[k] = (template, chunks)
        template, chunks = self._held_templates[k]
        for begin, layout, end in chunks:
            whole = template[begin:end].clone()
            typed = {dtype: whole.view(dtype) for _, _, dtype, _ in layout}
            for start, _, dtype, views in layout:
                for slot, info in views:
                    self.vals[slot] = typed[dtype].as_strided(info.shape, info.stride, start + info.offset)
        # the op's workspace at its peak inside it, beside all it held then, made and let go at once: the replay's
        # op ran without grad and freed each time step's gates as it went, so its own peak stayed below the
        # program's; what the buffers above laid out beyond ``held`` counts toward it
        transient = self.plan.specs[self._flat[k]].transient_bytes
        if transient and (scratch := held + transient - template.numel()) > 0:
            torch.empty(scratch, dtype=torch.uint8, device=self.device)

    def _freed_after(self, slot: int, k: int) -> float:
        """The flat position after which the replay frees ``slot``, made at flat position ``k`` (inf: never)."""
        if self._freed is None:
            self._freed = {}
            for position, slots in enumerate(self.plan.clears):
                for cleared in slots:
                    self._freed.setdefault(cleared, []).append(position)
        positions = self._freed.get(slot, [])
        n = bisect.bisect_left(positions, k)
        return positions[n] if n < len(positions) else math.inf

    def _lay_out(self, externals: dict[int, External], constraints: list[Constraint] | None = None) -> int:
        """Buffers for these external slots, their views in :attr:`vals` with defined contents (``constraints``:
        the readers' recorded ranges and data that may apply, default all); returns the bytes allocated."""
        # Keyed by storage and dtype: the observer's storage ids come from data addresses, reused after
        # frees, so a step counter (int64) and a bias correction (float64) freed and made in turn can
        # arrive with one id; views of one storage in two dtypes are otherwise rare.
        nbytes: dict[tuple[int, torch.dtype], int] = {}
        for info, _, _ in externals.values():
            end = (info.offset + info.extent) * info.itemsize
            key = (info.storage_id, info.dtype)
            nbytes[key] = max(nbytes.get(key, 0), end)
        storages = {sid: torch.empty(max(n, 1), dtype=torch.uint8, device=self.device).untyped_storage()
                    for sid, n in nbytes.items()}
        # Wide views first: a narrower view of the same storage (e.g. one table's slice of a
        # jagged batch's offsets) carries its own reader's range, so it is written last and wins.
        ordered = sorted(externals.items(), key=lambda item: -item[1][0].extent)
        for slot, (info, rng, is_offsets) in ordered:
            view = torch.empty(0, dtype=info.dtype, device=self.device)
            view.set_(storages[(info.storage_id, info.dtype)], info.offset, info.shape, info.stride)
            fill_view(view, rng, is_offsets, self.generator, self._values_of.get((info.storage_id, info.dtype)))
            self.vals[slot] = view
        # Then what the readers recorded, on every view of a synthesised storage: ranges from the
        # widest view to the narrowest, recorded data last (it is the program's own values).
        constraints = self.plan.constraints if constraints is None else constraints
        for info, rng, is_offsets, data in sorted(constraints, key=lambda c: (c[3] is not None, -c[0].extent)):
            if (info.storage_id, info.dtype) in storages:
                view = torch.empty(0, dtype=info.dtype, device=self.device)
                view.set_(storages[(info.storage_id, info.dtype)], info.offset, info.shape, info.stride)
                if data is None or not copy_recorded(view, data):
                    fill_view(view, rng, is_offsets, self.generator)
        return sum(max(n, 1) for n in nbytes.values())

    def nonfinite_tensors(self) -> int:
        """How many of the tensors carried across steps (parameters, optimiser state, inputs) now hold an
        infinite or NaN element: 0 in a sane replay. (A step's intermediates may hold them by design,
        e.g. a division masked afterwards, as in the program itself.)"""
        carried = (self.vals[slot] for slot in self.plan.externals)
        return sum(1 for v in carried if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel()
                   and not bool(torch.isfinite(v).all()))

    def stand_in(self, op: CompiledOp) -> None:
        """Outputs of the captured shapes for an op that could not run, so its consumers still run."""
        for slot, info in zip(op.out_slots, op.out_infos, strict=False):
            if slot is not None and info is not None and self.vals[slot] is None and info.storageless:
                # a sparse tensor storing nothing (:mod:`.sparse`)
                self.vals[slot] = torch.sparse_coo_tensor(torch.empty((len(info.shape), 0), dtype=torch.int64),
                                                          torch.empty(0, dtype=info.dtype), info.shape,
                                                          device=self.device)
            elif slot is not None and info is not None and self.vals[slot] is None:
                self.vals[slot] = stand_in(info.shape, info.stride, info.offset, info.extent, info.dtype, self.device)
