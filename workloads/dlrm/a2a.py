"""Measuring the pooled-embedding all-to-all: bytes and time per step, codec time, and what a
slower link would make of them (projection, break-even bandwidth)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


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

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int] | None = None,
                          input_split_sizes: list[int] | None = None, group: dist.ProcessGroup | None = None,
                          async_op: bool = False) -> _MeteredWork | None:
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

    def _issue(self, output: torch.Tensor, input_: torch.Tensor, output_split_sizes: list[int] | None,
               input_split_sizes: list[int] | None, group: dist.ProcessGroup | None,
               async_op: bool) -> _MeteredWork | None:
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


class TimedCodec:
    """Any TorchRec ``QuantizedCommCodec`` (FBGEMM's or ours), timed: encode and decode seconds and
    the float32 bytes they saw, so every codec gets the same cost figure. Every other attribute is
    the wrapped codec's. On accelerators each call synchronises the device (a codec's cost is its
    kernels, not their launch)."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.encode_seconds = 0.0
        self.decode_seconds = 0.0
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _timed(self, method: Any, tensor: torch.Tensor, ctx: Any) -> tuple[torch.Tensor, float]:
        _synchronize(tensor.device)
        started = time.perf_counter()
        out = method(tensor, ctx)
        _synchronize(tensor.device)
        return out, time.perf_counter() - started

    def encode(self, input_tensor: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        out, seconds = self._timed(self.inner.encode, input_tensor, ctx)
        self.encode_seconds += seconds
        self.calls += 1
        return out

    def decode(self, input_grad: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        out, seconds = self._timed(self.inner.decode, input_grad, ctx)
        self.decode_seconds += seconds
        return out


def _synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def break_even_gbps(bytes_saved_per_step: float, codec_seconds_per_step: float) -> float:
    """The link bandwidth (GB/s per rank) below which compressing wins: the wire time it saves,
    bytes saved ÷ bandwidth, exceeds what encoding and decoding cost. Above it, send float32."""
    if codec_seconds_per_step <= 0:
        return float("inf")
    return max(bytes_saved_per_step, 0.0) / codec_seconds_per_step / 1e9
