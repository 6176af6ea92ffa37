"""The registry of codecs for the pooled-embedding all-to-all: FBGEMM's built-in ones and cobench's own.

Codecs plug into TorchRec's own interface: the sharder takes a ``qcomm_codecs_registry`` (comm op
name → :class:`QuantizedCommCodecs`, a forward and a backward ``QuantizedCommCodec``), and TorchRec
encodes before and decodes after each collective. Built-in codecs are FBGEMM's (fp16, bf16, fp8,
int8). Other codecs register a factory in :data:`CUSTOM_CODECS`::

    from workloads.dlrm.codec_registry import CUSTOM_CODECS
    CUSTOM_CODECS["eb"] = lambda options, process_group: QuantizedCommCodecs(forward=..., backward=...)

at import time of a module the ``workloads.dlrm`` package imports; ``workload.comm_codec=eb``
then selects it and ``workload.codec_options`` (a dict) reaches the factory unchanged (on the
command line, Hydra adds keys to it with a ``+``: ``+workload.codec_options.eb=0.01``). Two optional
members of a codec are used when present (duck-typed, so FBGEMM's codecs need neither):

- ``set_iteration(step, loss)``: called once per training step, before its forward, with the
  step index and the previous step's loss (a float, None at the first step); every rank alike;
- ``stats.as_dict()``: flat numbers reported as ``codec_forward_<name>`` / ``codec_backward_<name>``
  metrics at the end of a run (non-finite values are left out).

:mod:`workloads.dlrm.a2a` counts the bytes and times the collectives TorchRec really issues, and
times every codec the same way.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from workloads.dlrm.a2a import TimedCodec

if TYPE_CHECKING:  # TorchRec is imported where used: registering the workload must stay cheap
    from torchrec.distributed.types import QuantizedCommCodecs

# name → (forward, backward) TorchRec ``CommType`` values. FP8 gradients (e5m2) lose too much
# range on small embedding gradients; the backward pass of fp8 sends bf16 instead.
BUILTIN_CODECS: dict[str, tuple[str, str] | None] = {
    "none": None,
    "fp16": ("fp16", "fp16"),
    "bf16": ("bf16", "bf16"),
    "fp8": ("fp8", "bf16"),
    "int8": ("int8", "int8"),
}

CodecFactory = Callable[[dict[str, Any], Any], "QuantizedCommCodecs"]
# Codecs registered by other modules: factory(codec_options, process_group) -> QuantizedCommCodecs
CUSTOM_CODECS: dict[str, CodecFactory] = {}


def codec_names() -> list[str]:
    return [*BUILTIN_CODECS, *CUSTOM_CODECS]


def codec_unsupported(name: str, device: torch.device, world_size: int) -> str | None:
    """Why a valid codec ``name`` cannot run on this platform or launch (a sentence), or None when it can."""
    if name != "none" and world_size == 1:
        return (f"comm_codec={name} needs >1 rank: a single process has no embedding all-to-all to compress; "
                "launch with torchrun --nproc-per-node N, or use comm_codec=none")
    if name == "fp8" and device.type == "cpu":
        return ("comm_codec=fp8 does not run on CPU: FBGEMM's CPU FP8 quantiser rejects the flat all-to-all "
                "buffer (\"Tensor 'input' must have 2 dimension(s)\"); use fp16, bf16 or int8 on CPU")
    return None


def codec_problem(name: str, codec_options: dict[str, Any]) -> str | None:
    """What is wrong with codec ``name`` and its options (a sentence), or None when they are valid."""
    if name not in BUILTIN_CODECS and name not in CUSTOM_CODECS:
        return f"got {name!r}, allowed values: {', '.join(codec_names())}"
    if name in BUILTIN_CODECS and codec_options:
        return f"codec_options are for codecs registered in CUSTOM_CODECS; the built-in {name!r} takes none"
    if name in CUSTOM_CODECS:
        try:  # building a codec only validates its options; nothing is communicated yet
            CUSTOM_CODECS[name](dict(codec_options), None)
        except ValueError as err:
            return f"bad codec_options for {name!r}: {err}"
    return None


def build_qcomm_registry(
    codec_name: str,
    device: torch.device,
    codec_options: dict[str, Any] | None = None,
    process_group: Any = None,
    block_size: int | None = None,
) -> dict[str, QuantizedCommCodecs] | None:
    """The ``qcomm_codecs_registry`` for ``EmbeddingBagCollectionSharder``; None for ``none``.

    Every codec is wrapped in a :class:`~workloads.dlrm.a2a.TimedCodec`. ``block_size``: what custom
    codecs get when their options do not set one (:func:`auto_block_size`).

    Built-in codecs cover the pooled-embedding all-to-all (table/column-wise sharding) and, on
    accelerators, the reduce-scatter (row-wise), with TorchRec's fallbacks for the latter (no fp8
    reduce-scatter). Custom codecs cover the all-to-all only.
    """
    from torchrec.distributed.fbgemm_qcomm_codec import (
        CommType,
        QCommsConfig,
        get_qcomm_codecs,
        get_qcomm_codecs_registry,
    )
    from torchrec.distributed.types import CommOp

    if codec_name in CUSTOM_CODECS:
        options = dict(codec_options or {})
        if options.get("block_size") is None and block_size is not None:
            options["block_size"] = block_size
        codecs = CUSTOM_CODECS[codec_name](options, process_group)
        return {CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL.name: _timed(codecs)}
    precisions = BUILTIN_CODECS[codec_name]
    if precisions is None:
        return None
    config = QCommsConfig(forward_precision=CommType(precisions[0]), backward_precision=CommType(precisions[1]))
    if device.type == "cpu":
        # Only the all-to-all runs on CPU (row-wise sharding, whose output is a reduce-scatter, is
        # CUDA-only). get_qcomm_codecs_registry would swap bf16 for fp16 here ("not supported on
        # GLOO"), yet gloo's all_to_all_single carries bf16 (torch 2.13), so build the codecs directly.
        return {CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL.name: _timed(get_qcomm_codecs(config))}
    registry = get_qcomm_codecs_registry(
        config,
        comm_ops=[CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL, CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER],
        device=device,
    )
    return {name: _timed(codecs) for name, codecs in registry.items()}


def _timed(codecs: QuantizedCommCodecs) -> QuantizedCommCodecs:
    codecs.forward, codecs.backward = TimedCodec(codecs.forward), TimedCodec(codecs.backward)
    return codecs


MAX_AUTO_BLOCK = 256  # larger blocks amortise the 8-byte header, smaller ones track the range more tightly


def auto_block_size(common_width: int) -> int:
    """The largest block (<= MAX_AUTO_BLOCK values) dividing ``common_width``, the gcd of the ranks'
    pooled-embedding widths under the sharding plan: every chunk of the all-to-all is whole blocks."""
    return max(d for d in range(1, min(common_width, MAX_AUTO_BLOCK) + 1) if common_width % d == 0)


def _all_to_all_codecs(registry: dict[str, QuantizedCommCodecs] | None) -> list[tuple[str, Any]]:
    """(direction, codec) of the all-to-all, each still wrapped in its :class:`TimedCodec`."""
    codecs = (registry or {}).get("POOLED_EMBEDDINGS_ALL_TO_ALL")
    return [] if codecs is None else [("forward", codecs.forward), ("backward", codecs.backward)]


class CustomCodec:
    """What cobench's own all-to-all codecs (``CUSTOM_CODECS``) add to TorchRec's ``QuantizedCommCodec``:
    a per-step schedule and statistics. TorchRec's built-in codecs are not CustomCodecs and get none
    of these calls. A factory receives ``block_size`` (the largest block, at most 256 values, that
    divides every rank's pooled-embedding width) among its options unless the user gave one."""

    def set_iteration(self, step: int, loss: float | None = None) -> None:
        """Called once per training step before it runs (``loss``: the previous step's)."""

    def stats_dict(self) -> dict[str, float]:
        """The codec's own statistics since it was built (metric name → value)."""
        return {}


def _custom_codecs(registry: dict[str, QuantizedCommCodecs] | None) -> list[tuple[str, CustomCodec]]:
    unwrapped = [(direction, getattr(codec, "inner", codec)) for direction, codec in _all_to_all_codecs(registry)]
    return [(direction, codec) for direction, codec in unwrapped if isinstance(codec, CustomCodec)]


def advance_codecs(registry: dict[str, QuantizedCommCodecs] | None, step: int, loss: torch.Tensor | None) -> None:
    """Tell our codecs which step starts (``loss``: the previous step's)."""
    scheduled = [codec for _, codec in _custom_codecs(registry)]
    if not scheduled:
        return
    # reading the loss waits for the previous step on an accelerator; the error-bounded codec waits for its
    # kernels anyway (its message width reaches the host each call), so this adds no stall of its own
    previous = float(loss) if loss is not None else None
    for codec in scheduled:
        codec.set_iteration(step, previous)


def codec_seconds(registry: dict[str, QuantizedCommCodecs] | None) -> tuple[float, float]:
    """(codec work, waiting in collectives of its own) seconds of every all-to-all codec so far,
    forward and backward: encode + decode time less what our codecs spent in their size exchange
    (``stats.exchange_seconds``, the wait for the slowest rank that the all-to-all would otherwise
    have had), and that exchange time."""
    work = waiting = 0.0
    for _, codec in _all_to_all_codecs(registry):
        if isinstance(codec, TimedCodec):
            exchange = getattr(getattr(codec.inner, "stats", None), "exchange_seconds", 0.0)
            work += codec.encode_seconds + codec.decode_seconds - exchange
            waiting += exchange
    return work, waiting


def codec_metrics(registry: dict[str, QuantizedCommCodecs] | None) -> dict[str, float]:
    """Our all-to-all codecs' own statistics (:meth:`CustomCodec.stats_dict`)."""
    metrics = {}
    for direction, codec in _custom_codecs(registry):
        for name, value in codec.stats_dict().items():
            if math.isfinite(value):
                metrics[f"codec_{direction}_{name}"] = float(value)
    return metrics
