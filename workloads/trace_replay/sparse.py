"""Sparse tensors a step makes: found in the trace, made by the replay's own ops, given the captured count.

An embedding trained with sparse gradients (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag(sparse=True)``),
a sparse optimiser (``SparseAdam``) and a graph's adjacency built each step (``torch.sparse_coo_tensor``,
``torch.sparse.mm``) make tensors with no storage of their own: the trace records them as
``[id, 0, 0, 0, 0, '']`` (no storage, no elements, element size 0) with their dense shape. The replay runs
the ops that make them, which make sparse tensors as the program's did, from the replay's own inputs.

How many elements such a tensor stores follows its inputs' values: a batch's distinct rows, after
``coalesce``. The capture records the indices such tensors are made of (``harness.traces.capture.INDEX_OPS``),
which give the replay the program's count. Where they are not recorded, the trace still says how many the
program's held where a later op of the step reads them (``_indices``, ``_values``, ``_nnz``); the op that
made it then stores exactly that many on replay (its own first ones, or more rows not yet among its
indices, their values its own cycled: :func:`fit_count`, tens to hundreds of µs a call on a CPU), like a
keep list cut to its captured length. A sparse tensor a step reads but never
makes (a ``torch.sparse`` input, an adjacency built once before training, a sparse gradient carried
across steps) is refused at spec generation: a replay cannot make one up from a dense shape alone.
"""

from __future__ import annotations

from typing import Any

import torch

from workloads.trace_bundle import TraceError

# ops reading a sparse tensor whose outputs say how many elements it stores: the count's position in the
# first output's shape (None: the output is the count itself)
_COUNT_READERS = {"aten::_indices": -1, "aten::indices": -1, "aten::_values": 0, "aten::values": 0,
                  "aten::_nnz": None}


def storageless(ref: Any) -> bool:
    """Whether a trace's tensor reference is of a tensor with no storage of its own (its element size 0)."""
    return isinstance(ref, list) and len(ref) == 6 and ref[4] == 0 and isinstance(ref[5], str)


def refuse_unmade_sparse(ops: list[dict[str, Any]], path: Any) -> None:
    """Refuse (TraceError naming ``path`` and the op) ops of a spec or trace that read a tensor with no storage
    of its own that no op of their step made before: a ``torch.sparse`` input, an adjacency built before
    training, a sparse gradient carried across steps, a ``torch.func`` wrapper. The replay makes sparse
    tensors only by running the ops that made them; from a dense shape alone it would make up another
    tensor than the program's (a strided one, which a sparse op reads as dense, silently)."""
    from workloads.trace_replay.memory import laid_out_refs  # (it imports the ops, which import this)

    made: set[int] = set()
    for k, op in enumerate(ops):
        if k and op.get("step") != ops[k - 1].get("step"):
            made.clear()
        for ref, _, _ in laid_out_refs(op.get("inputs") or {}):
            if storageless(ref) and ref[0] not in made:
                raise TraceError(
                    f"{path}: {op.get('name')} (step {op.get('step')}) reads a tensor with no storage of its own "
                    f"that no op of its step made: a sparse tensor made before the step (a torch.sparse input, an "
                    f"adjacency built once, a sparse gradient carried across steps) or a torch.func wrapper; a "
                    f"replay makes sparse tensors only by running the ops that make them, so it cannot reproduce "
                    f"this program: make the sparse tensor inside the step (or keep it dense), and capture without "
                    f"torch.func transforms")
        made.update(ref[0] for ref, _, _ in laid_out_refs(op.get("outputs") or {}) if storageless(ref))


def captured_counts(ops: list[Any], sequence: list[list[int]]) -> dict[int, int]:
    """Position of an op whose first output has no storage of its own → how many elements the program's
    stored, where a later op of its step read it through :data:`_COUNT_READERS` (before the tensor id was
    made again: ids are reused)."""
    counts: dict[int, int] = {}
    for step in sequence:
        maker: dict[int, int] = {}  # sparse tensor id → the position of the op that made it
        for position in step:
            op = ops[position]
            values = op.inputs.values
            if op.name in _COUNT_READERS and values and storageless(values[0]) and values[0][0] in maker:
                made = maker[values[0][0]]
                out, where = (op.outputs.values or [None])[0], _COUNT_READERS[op.name]
                shape = (op.outputs.shapes or [None])[0]
                count = out if where is None else shape[where] if isinstance(shape, list) and shape else None
                if type(count) is int and count >= 0:
                    counts.setdefault(made, count)
            for ref in op.outputs.values or []:
                if isinstance(ref, list) and len(ref) == 6:
                    maker.pop(ref[0], None)
            first = (op.outputs.values or [None])[0]
            if storageless(first):
                maker[first[0]] = position
    return counts


def fit_count(tensor: torch.Tensor, count: int, generator: torch.Generator) -> torch.Tensor:
    """A sparse COO tensor like ``tensor`` storing ``count`` elements: its first ones, or all of them and rows
    not among its indices (drawn from ``generator``), their values its own cycled (zeros where it stored
    none); coalesced where it was. Another layout, or a count its dense shape cannot hold, is returned as it
    is (the shapes after it then differ, and the replay says so)."""
    stored = tensor._nnz()
    sparse_dims = tensor.size()[:tensor.sparse_dim()]
    rows = 1
    for size in sparse_dims:
        rows *= size
    if tensor.layout != torch.sparse_coo or stored == count or count > rows:
        return tensor
    indices, values = tensor._indices(), tensor._values()
    if count < stored:
        indices, values = indices[:, :count], values[:count]
    else:
        linear = torch.zeros(stored, dtype=torch.int64, device=indices.device)
        for d, size in enumerate(sparse_dims):
            linear = linear * size + indices[d]
        added = _unused(linear, rows, count - stored, generator).to(indices.device)
        unravelled = []
        for size in reversed(sparse_dims):
            unravelled.append(added % size)
            added = added // size
        extra = torch.stack(unravelled[::-1]) if unravelled else added[None]
        cycled = torch.arange(count - stored, device=values.device) % stored if stored else None
        filler = values[cycled] if cycled is not None else values.new_zeros((count - stored, *values.shape[1:]))
        indices, values = torch.cat([indices, extra.to(indices.dtype)], 1), torch.cat([values, filler])
        if tensor.is_coalesced():
            linear = torch.zeros(count, dtype=torch.int64, device=indices.device)
            for d, size in enumerate(sparse_dims):
                linear = linear * size + indices[d]
            order = linear.argsort()
            indices, values = indices[:, order], values[order]
    return torch.sparse_coo_tensor(indices, values, tensor.shape, is_coalesced=tensor.is_coalesced(),
                                   check_invariants=False)


def _unused(linear: torch.Tensor, rows: int, wanted: int, generator: torch.Generator) -> torch.Tensor:
    """``wanted`` distinct row numbers below ``rows`` not in ``linear``."""
    taken = linear.cpu()
    if rows <= max(1 << 16, 4 * (taken.numel() + wanted)):  # a mask of every row
        free = torch.ones(rows, dtype=torch.bool)
        free[taken] = False
        candidates = free.nonzero().flatten()
        return candidates[torch.randperm(candidates.numel(), generator=generator)[:wanted]]
    found = torch.empty(0, dtype=torch.int64)
    while found.numel() < wanted:  # three rows in four free: a draw finds most of what it wants
        draw = torch.randint(0, rows, (2 * wanted,), generator=generator)
        draw = draw[~torch.isin(draw, taken) & ~torch.isin(draw, found)].unique()
        found = torch.cat([found, draw[:wanted - found.numel()]])
    return found


def layout_divergence(captured_storageless: bool, value: Any) -> str | None:
    """How a replayed output's layout differs from the program's, or None: a tensor the program made with no
    storage of its own must come out sparse, one it made over a storage strided."""
    if not isinstance(value, torch.Tensor):
        return None
    if captured_storageless and value.layout == torch.strided:
        return ("made a strided tensor where the program made one with no storage of its own (a sparse tensor, "
                "or a torch.func wrapper such as vmap's batched tensors, which a replay does not make)")
    if not captured_storageless and value.layout != torch.strided:
        return f"made a {value.layout} tensor where the program made a strided one"
    return None
