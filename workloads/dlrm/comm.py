"""Compression of the pooled-embedding all-to-all, and measuring that all-to-all.

Codecs plug into TorchRec's own interface: the sharder takes a ``qcomm_codecs_registry`` (comm op
name → :class:`QuantizedCommCodecs`, a forward and a backward ``QuantizedCommCodec``), and TorchRec
encodes before and decodes after each collective. Built-in codecs are FBGEMM's (fp16, bf16, fp8,
int8). Other codecs register a factory in :data:`CUSTOM_CODECS`::

    from workloads.dlrm.comm import CUSTOM_CODECS
    CUSTOM_CODECS["eb"] = lambda options, process_group: QuantizedCommCodecs(forward=..., backward=...)

at import time of a module the ``workloads.dlrm`` package imports; ``workload.comm_codec=eb``
then selects it and ``workload.codec_options`` (a dict) reaches the factory unchanged (on the
command line, Hydra adds keys to it with a ``+``: ``+workload.codec_options.eb=0.01``). Two optional
members of a codec are used when present (duck-typed, so FBGEMM's codecs need neither):

- ``set_iteration(step, loss)``: called once per training step, before its forward, with the
  step index and the previous step's loss (a float, None at the first step); every rank alike;
- ``stats.as_dict()``: flat numbers reported as ``codec_forward_<name>`` / ``codec_backward_<name>``
  metrics at the end of a run (non-finite values are left out).

:class:`PooledA2AMeter` counts the bytes and times the collectives TorchRec really issues.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

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
) -> dict[str, QuantizedCommCodecs] | None:
    """The ``qcomm_codecs_registry`` for ``EmbeddingBagCollectionSharder``; None for ``none``.

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
        codecs = CUSTOM_CODECS[codec_name](dict(codec_options or {}), process_group)
        return {CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL.name: codecs}
    precisions = BUILTIN_CODECS[codec_name]
    if precisions is None:
        return None
    config = QCommsConfig(forward_precision=CommType(precisions[0]), backward_precision=CommType(precisions[1]))
    if device.type == "cpu":
        # Only the all-to-all runs on CPU (row-wise sharding, whose output is a reduce-scatter, is
        # CUDA-only). get_qcomm_codecs_registry would swap bf16 for fp16 here ("not supported on
        # GLOO"), yet gloo's all_to_all_single carries bf16 (torch 2.13), so build the codecs directly.
        return {CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL.name: get_qcomm_codecs(config)}
    return get_qcomm_codecs_registry(
        config,
        comm_ops=[CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL, CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER],
        device=device,
    )


def _all_to_all_codecs(registry: dict[str, QuantizedCommCodecs] | None) -> list[tuple[str, Any]]:
    codecs = (registry or {}).get("POOLED_EMBEDDINGS_ALL_TO_ALL")
    return [] if codecs is None else [("forward", codecs.forward), ("backward", codecs.backward)]


class CustomCodec:
    """What cobench's own all-to-all codecs (``CUSTOM_CODECS``) add to TorchRec's ``QuantizedCommCodec``:
    a per-step schedule, statistics, and a block size fitted to the sharding plan. TorchRec's built-in
    codecs are not CustomCodecs and get none of these calls."""

    auto_block = False  # True: block_size was not given and may be fitted to the sharding plan

    def set_iteration(self, step: int, loss: float | None = None) -> None:
        """Called once per training step before it runs (``loss``: the previous step's)."""

    def set_block_size(self, block_size: int) -> None:
        """Re-block before the first message."""
        raise NotImplementedError

    def stats_dict(self) -> dict[str, float]:
        """The codec's own statistics since it was built (metric name → value)."""
        return {}


def _custom_codecs(registry: dict[str, QuantizedCommCodecs] | None) -> list[tuple[str, CustomCodec]]:
    return [(direction, codec) for direction, codec in _all_to_all_codecs(registry) if isinstance(codec, CustomCodec)]


def advance_codecs(registry: dict[str, QuantizedCommCodecs] | None, step: int, loss: torch.Tensor | None) -> None:
    """Tell our codecs which step starts (``loss``: the previous step's)."""
    scheduled = [codec for _, codec in _custom_codecs(registry)]
    if not scheduled:
        return
    previous = float(loss) if loss is not None else None  # finished: the harness synchronised the last step
    for codec in scheduled:
        codec.set_iteration(step, previous)


def codec_metrics(registry: dict[str, QuantizedCommCodecs] | None) -> dict[str, float]:
    """Our all-to-all codecs' own statistics (:meth:`CustomCodec.stats_dict`)."""
    metrics = {}
    for direction, codec in _custom_codecs(registry):
        for name, value in codec.stats_dict().items():
            if math.isfinite(value):
                metrics[f"codec_{direction}_{name}"] = float(value)
    return metrics


# -- measuring the all-to-all ------------------------------------------------------------------


@dataclass
class _Call:
    """One all-to-all in flight: bytes sent to other ranks, and its start marks."""

    bytes_sent: int
    start_s: float
    start_event: Any = None  # torch.Event on accelerators


class _MeteredWork:
    """Wraps a ``dist.Work``: ``wait()`` is where the meter learns the collective finished."""

    def __init__(self, work: Any, meter: PooledA2AMeter, call: _Call):
        self._work, self._meter, self._call = work, meter, call

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        before = time.perf_counter()
        result = self._work.wait(*args, **kwargs)
        self._meter._finished(self._call, before)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class _MeteredDist:
    """Stands in for ``torch.distributed`` inside ``torchrec.distributed.comm_ops``."""

    def __init__(self, meter: PooledA2AMeter):
        self._meter = meter

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes=None,
                          input_split_sizes=None, group=None, async_op: bool = False) -> Any:
        return self._meter._issue(output, input, output_split_sizes, input_split_sizes, group, async_op)


class PooledA2AMeter:
    """Bytes and time of the pooled-embedding all-to-alls, per training step.

    Within :meth:`step`, ``torchrec.distributed.comm_ops`` sees a stand-in for
    ``torch.distributed`` whose ``all_to_all_single`` records each call: the forward all-to-all
    (``All2All_Pooled_Req``) and the backward one (``All2All_Pooled_Wait.backward``). Nothing else
    in a table- or column-wise DLRM step calls that function there (the sparse-feature exchange
    lives in ``dist_data`` and is not counted; row-wise sharding uses a reduce-scatter instead).

    What is measured, per call:

    - bytes: the encoded buffer this rank sends to *other* ranks (its own chunk stays local), in
      the codec's dtype, so compression shows up directly;
    - time: from just before the collective is issued until its work handle's ``wait()`` returns
      (on CPU, wall clock; on accelerators, device events around issue and wait, read at the next
      step so no extra synchronisation enters the timed step). Any compute TorchRec overlaps with
      the collective between issue and wait is included: this is the collective's latency as the
      step sees it, encode and decode excluded;
    - wait: CPU time blocked inside ``wait()`` (CPU only): the part of the collective not hidden.

    Overhead: two ``perf_counter`` calls and two small Python objects per collective.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._use_events = device.type != "cpu"
        self._step_bytes: list[int] = []
        self._step_time_s: list[float] = []
        self._step_wait_s: list[float] = []
        self._step_calls: list[int] = []
        self._pending_events: list[tuple[int, Any, Any]] = []  # (step index, start, end)

    @contextmanager
    def step(self) -> Iterator[None]:
        """Count the all-to-alls of one training step (forward and backward inside the block)."""
        from torchrec.distributed import comm_ops

        self._resolve_events()
        self._step_bytes.append(0)
        self._step_time_s.append(0.0)
        self._step_wait_s.append(0.0)
        self._step_calls.append(0)
        original = comm_ops.dist
        comm_ops.dist = _MeteredDist(self)  # type: ignore[assignment]
        try:
            yield
        finally:
            comm_ops.dist = original

    def _issue(self, output, input_, output_split_sizes, input_split_sizes, group, async_op) -> Any:
        world = dist.get_world_size(group)
        me = dist.get_rank(group)
        if input_split_sizes:
            elements = sum(n for rank, n in enumerate(input_split_sizes) if rank != me)
        else:
            elements = input_.numel() // world * (world - 1)
        call = _Call(elements * input_.element_size(), time.perf_counter())
        if self._use_events:
            call.start_event = torch.Event(device=self.device, enable_timing=True)
            call.start_event.record()
        work = dist.all_to_all_single(
            output, input_, output_split_sizes, input_split_sizes, group=group, async_op=async_op
        )
        if work is None:  # synchronous call: it has finished
            self._finished(call, time.perf_counter())
            return None
        return _MeteredWork(work, self, call)

    def _finished(self, call: _Call, wait_started_s: float) -> None:
        end_s = time.perf_counter()
        self._step_bytes[-1] += call.bytes_sent
        self._step_calls[-1] += 1
        if self._use_events:
            end_event = torch.Event(device=self.device, enable_timing=True)
            end_event.record()
            self._pending_events.append((len(self._step_time_s) - 1, call.start_event, end_event))
        else:
            self._step_time_s[-1] += end_s - call.start_s
            self._step_wait_s[-1] += end_s - wait_started_s

    def _resolve_events(self) -> None:
        for step, start, end in self._pending_events:
            end.synchronize()
            self._step_time_s[step] += start.elapsed_time(end) / 1e3
        self._pending_events.clear()

    def summary(self) -> dict[str, float]:
        """Per-step means; the first step is left out of times (it pays one-off set-up costs)."""
        self._resolve_events()
        if not self._step_calls or not any(self._step_calls):
            return {}
        timed = slice(1, None) if len(self._step_calls) > 1 else slice(None)
        times, waits = self._step_time_s[timed], self._step_wait_s[timed]
        metrics = {
            "a2a_bytes_per_step": sum(self._step_bytes) / len(self._step_bytes),
            "a2a_calls_per_step": sum(self._step_calls) / len(self._step_calls),
            "a2a_time_ms": 1e3 * sum(times) / len(times),
        }
        if not self._use_events:
            metrics["a2a_wait_ms"] = 1e3 * sum(waits) / len(waits)
        return metrics


def fp32_a2a_bytes_per_step(dim_per_rank: list[int], rank: int, batch_per_rank: list[int]) -> int:
    """Bytes this rank would send to other ranks per step without compression (forward + backward).

    Forward, rank r receives this rank's pooled columns for its own batch: B_r × D_rank. Backward,
    this rank returns the gradient of rank r's columns for its own batch: B_rank × D_r.
    """
    forward = sum(b * dim_per_rank[rank] for r, b in enumerate(batch_per_rank) if r != rank)
    backward = sum(batch_per_rank[rank] * d for r, d in enumerate(dim_per_rank) if r != rank)
    return 4 * (forward + backward)


MAX_AUTO_BLOCK = 256  # larger blocks amortise the 8-byte header, smaller ones track the range more tightly


def fit_block_size(registry: dict[str, Any] | None, dim_per_rank: list[int]) -> int | None:
    """Give codecs without an explicit block_size the largest block (≤ MAX_AUTO_BLOCK) dividing every
    rank's pooled-embedding dim sum, so every chunk of the all-to-all is a whole number of blocks."""
    codecs = [c for _, c in _custom_codecs(registry) if c.auto_block]
    if not codecs:
        return None
    common = math.gcd(*dim_per_rank)
    block = max(d for d in range(1, min(common, MAX_AUTO_BLOCK) + 1) if common % d == 0)
    for codec in codecs:
        codec.set_block_size(block)
    return block


def projected_a2a(bytes_per_step: float, a2a_wait_ms: float, step_ms: float,
                  bandwidths_gbps: list[float]) -> dict[str, float]:
    """All-to-all and step time this rank would see on links of ``bandwidths_gbps`` (GB/s per rank).

    Loopback gloo is far faster than a real network, so the measured all-to-all hides what
    compression buys. The projection replaces the measured blocking time with bytes ÷ bandwidth
    (an all-to-all moves each rank's sent bytes over its own link); codec time stays as measured.
    """
    metrics = {}
    for gbps in bandwidths_gbps:
        label = f"{gbps:g}".replace(".", "p") + "GBps"
        a2a_ms = 1e3 * bytes_per_step / (gbps * 1e9)
        metrics[f"a2a_projected_ms_{label}"] = a2a_ms
        metrics[f"step_projected_ms_{label}"] = max(step_ms - a2a_wait_ms, 0.0) + a2a_ms
    return metrics
