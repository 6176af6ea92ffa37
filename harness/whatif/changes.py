"""The changes ``cobench trace predict`` takes, parsed and placed on a captured graph.

``workload.<layers key>=N`` (llama ``n_layers``, seqrec ``num_layers``, DLRM ``dcn_num_layers``),
``workload.batch_size=B``, ``workload.seq_len=S`` (seqrec: ``max_len``) and ``world_size=W`` (the
data-parallel degree; ``runner.world_size=W`` and ``dp=W`` are the same; a workload with a
``parallelism`` choice, Llama's FSDP2 by default, must say ``workload.parallelism=ddp``: FSDP's
per-layer gathers and its DTensor dispatch are not modelled). A key the workload does not have is
refused by name, with the keys it does have.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.whatif.graph import Graph
from harness.whatif.predict import (
    BATCH_KEY,
    LAYER_KEYS,
    SEQ_KEYS,
    Change,
    resolved_workload,
    workload_value,
)

WORLD_KEYS = ("world_size", "runner.world_size", "dp")


@dataclass
class Changes:
    """A graph's change (layers, batch, sequence, platform) and the data-parallel degree (None: as captured)."""

    change: Change
    world_size: int | None = None
    items: tuple[str, ...] = ()  # as given, for the record
    parallelism: str | None = None  # workload.parallelism=ddp: the data parallelism the prediction models

    def describe(self) -> dict:
        return self.change.describe() | ({"world_size": self.world_size} if self.world_size else {})


def parse_changes(graph: Graph, items: list[str]) -> Changes:
    """``key=N`` items → :class:`Changes`; a malformed item or a key this workload lacks is a ValueError
    naming it."""
    values = resolved_workload(graph)
    layer_key = LAYER_KEYS.get(graph.workload)  # a registered workload's layers: found in the graph by their count
    batch_key = BATCH_KEY if workload_value(values, BATCH_KEY) is not None else None
    change, world, parallelism = Change(), None, None
    for item in items:
        key, sep, value = item.partition("=")
        if key == "workload.parallelism" and "parallelism" in values:
            if value != "ddp":
                raise ValueError(f"invalid change {item!r}: a data-parallel prediction models DDP "
                                 "(workload.parallelism=ddp); FSDP's sharding is not modelled")
            parallelism = value
            continue
        if not sep or not value.strip().isdigit() or int(value) <= 0:
            raise ValueError(f"invalid change {item!r}: write key=N with a positive integer N")
        short, n = key.strip().removeprefix("workload."), int(value)
        if key in WORLD_KEYS:
            world = n
        elif layer_key is not None and short == layer_key:
            change.layers = n
        elif short == batch_key:
            change.batch_size = n
        elif short in SEQ_KEYS and workload_value(values, short) is not None:
            change.seq_len = n
        else:
            known = [f"workload.{k}" for k in (layer_key, batch_key) if k]
            known += [f"workload.{k}" for k in SEQ_KEYS if workload_value(values, k) is not None] + ["world_size"]
            hint = "" if batch_key else (
                "; the capture's config names no batch size: a program of your own names its sizes when it is "
                "captured, harness.traces.capture.capture(..., config={'workload': {'batch_size': N, 'seq_len': L}}), "
                "and a batch or sequence change can then be predicted")
            raise ValueError(f"invalid change {key!r} for a {graph.workload or 'captured'} trace: supported: "
                             f"{', '.join(known)}{hint}")
    captured = values.get("parallelism")
    if world and world > 1 and captured not in (None, "ddp") and parallelism is None:
        raise ValueError(f"the {graph.workload} workload's parallelism={captured} may shard parameters (FSDP) at "
                         f"more than one rank; this prediction models DDP: add workload.parallelism=ddp (and run "
                         "the real configuration with it)")
    return Changes(change, world, tuple(items), parallelism)
