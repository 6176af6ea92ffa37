"""Capture a trace bundle from any PyTorch loop, or from a registered workload.

Wrap your own loop and mark its steps::

    from harness.traces.capture import capture

    with capture("traces/mine", steps=3) as cap:
        while not cap.done:
            with cap.step():
                train_step()

The first ``warmup`` steps run plain (not timed), the next ``baseline_steps`` run plain and are
timed — the reference the replay is judged against, since the profiler itself distorts time —,
the next ``steps`` run under the PyTorch execution-trace observer and the Kineto profiler (the
structure), the next ones measure how much of a step is the program's own host time between ops: one
round that settles, then 8 to 32 rounds of Kineto alone (2 steps to settle, 4 measured) then plain (4 to
settle, 3 measured), so the profiler's cost is taken against the plain steps of the same round, not of the
baseline, rounds added after the eighth while the median host time is not yet known within ±1 % of the
step; where the traced steps ran more or fewer ops a step than those rounds' steps (a program whose steps
differ by chance: a layer dropped at random), twice as many steps are traced again in their place, up to
:data:`MAX_TRACED_AGAIN` times (each twice the last); the last block traced runs again, each step with the
random draws it had, under the memory profiler alone, for its peak without the observer's own copies
(:func:`harness.traces.allocator_peaks.captured_step_peak_bytes`); the last step (not timed) records what the
step's floating tensors hold (:mod:`harness.traces.capture_values`).
A registered workload whose op shapes follow its data (seqrec's length buckets) holds its batch from the
traced step on (``hold_batch``), so those steps run the traced step's shapes. The
bundle (see :mod:`workloads.trace_bundle`) is written when the ``with`` block ends. Under
``torchrun`` every rank writes ``<out>/rank<i>/``.
"""

from __future__ import annotations

import json
import math
import os
import platform as pyplatform
import random
import shutil
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.profiler import ExecutionTraceObserver, ProfilerActivity, profile, record_function
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from harness.config import CobenchConfig, results_root
from harness.distributed import broadcast_from_main, env_dist_info, gather_to_all
from harness.platform import Platform, device_name, host_allocator_in_effect, synchronize
from harness.recording.fingerprint import git_state, library_versions
from harness.running.loop import MemoryMeter, seed_everything
from harness.running.runner import join_process_group, open_workload
from harness.traces.allocator_peaks import StepPeaks
from harness.traces.capture_values import ValueProfile
from workloads import discover
from workloads.base import RunContext, Workload
from workloads.device import rng_state, set_rng_state
from workloads.trace_bundle import (
    ET_FILE,
    ET_RESOURCES,
    KINETO_FILE,
    KINETO_TIMING_FILE,
    META_FILE,
    STEP_ANNOTATION,
    VALUES_FILE,
    BundleMeta,
    TraceError,
)
from workloads.trace_replay.codegen import spin_ns
from workloads.trace_replay.fidelity import steps_unlike
from workloads.trace_replay.host_time import (
    HOST_TARGET_PCT,
    MAX_TIMING_ROUNDS,
    MAX_TIMING_TRACE_BYTES,
    PLAIN_MEASURED,
    PLAIN_SETTLE,
    QUICK_TIMING_ROUNDS,
    SETTLE_ROUNDS,
    TIMING_MEASURED,
    TIMING_ROUNDS,
    TIMING_WARMUP,
    event_weights,
    host_time_half_width_pct,
    is_op,
    kineto_host_gaps,
    op_names,
    step_op_counts,
    steps_at_one_speed,
)
from workloads.trace_replay.parse import KinetoTrace, kineto_trace, read_kineto

# Kineto's own lines (profiler_start/stop, stages) are not the user's business; set it to see them
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

# Ask the ET observer to record the value range of integer tensors (index validity on replay) and,
# for the ops that read indices, lengths and offsets, their integer inputs' data (raw bytes in
# ``et_resources/nid_<node>_tid_<input>.dat``): replayed lookups then hit the rows the program hit.
_INT_RANGE_ENV = "ENABLE_PYTORCH_EXECUTION_TRACE_SAVE_INTEGRAL_TENSOR_RANGE"
_INT_DATA_ENV = "ENABLE_PYTORCH_EXECUTION_TRACE_SAVE_INTEGRAL_TENSOR_DATA"
INDEX_OPS = (
    "aten::embedding", "aten::embedding_bag", "aten::_embedding_bag", "aten::_embedding_bag_forward_only",
    "aten::embedding_dense_backward", "aten::_embedding_bag_backward", "aten::cumsum", "aten::index_select",
    "aten::index", "aten::index_put_", "aten::index_put", "aten::_index_put_impl_", "aten::gather",
    "aten::scatter", "aten::scatter_", "aten::scatter_add", "aten::scatter_add_", "aten::scatter_reduce",
    "aten::scatter_reduce_", "aten::index_add", "aten::index_add_", "aten::index_reduce", "aten::index_reduce_",
    "aten::index_copy", "aten::index_copy_", "aten::index_fill", "aten::index_fill_", "aten::put_", "aten::take",
    "aten::take_along_dim", "aten::nll_loss_forward", "aten::nll_loss2d_forward", "aten::nll_loss2d_backward",
    "aten::ctc_loss", "aten::_ctc_loss", "aten::_ctc_loss_backward", "aten::multi_margin_loss",
    "aten::multilabel_margin_loss_forward", "aten::embedding_renorm_", "aten::_embedding_bag_dense_backward",
    "aten::_embedding_bag_per_sample_weights_backward", "aten::_pack_padded_sequence", "aten::_unique",
    "aten::unique_dim", "aten::unique_consecutive",
    "aten::nll_loss_backward", "aten::cross_entropy_loss", "aten::one_hot", "aten::bincount",
    # backward ops handed the index their forward read: made by the replay's own ops from made-up inputs, it holds
    # other values (an adaptive softmax's targets within a cluster, from targets drawn with randint: 88 into 60)
    "aten::gather_backward", "aten::multi_margin_loss_backward", "aten::multilabel_margin_loss_backward",
    "aten::_unsafe_index", "aten::_unsafe_index_put", "aten::_unsafe_masked_index",
    "aten::_unsafe_masked_index_put_accumulate", "aten::put", "aten::embedding_renorm",
    "aten::repeat_interleave", "aten::searchsorted", "aten::masked_select", "aten::_unique2", "aten::segment_reduce",
    # the indices a sparse gradient or tensor is made of: how many rows it stores once coalesced (SparseAdam's
    # updates) follows them (workloads.trace_replay.sparse)
    "aten::embedding_backward", "aten::embedding_sparse_backward", "aten::_embedding_bag_sparse_backward",
    "aten::sparse_coo_tensor", "aten::_sparse_coo_tensor_unsafe", "aten::_sparse_coo_tensor_with_dims_and_tensors",
    # ops that carry index tensors whole (storage offset 0: see workloads.trace_replay.parse.recorded_tensor_data)
    "aten::split", "aten::split_with_sizes", "aten::narrow", "aten::slice", "aten::select", "aten::view",
    "aten::reshape", "aten::to", "aten::_to_copy", "aten::copy_", "aten::clone", "aten::cat", "aten::stack",
    "aten::unbind", "aten::flatten", "aten::contiguous",
)


_ROUND = TIMING_WARMUP + TIMING_MEASURED + PLAIN_SETTLE + PLAIN_MEASURED  # steps of a host-time round
# The capture's last step, untimed, records what the step's floating tensors hold: a program's state moves
# as it trains (an optimiser's second moments fill in as batches reach more embedding rows), so the replay
# puts back the state of the most trained step the capture saw, the nearest to the program's later steps
VALUE_STEPS = 1
# Traced steps whose ops a step differ from the host-time rounds' steps by more than UNREPRESENTATIVE_PCT are
# not the program's typical steps (Wav2Vec2's layer drop: 3 traced steps of 774 ops where its steps ran 941 at
# the mean, in one of its captures in the zoo's run of 2026-11-30 15:13): the capture traces twice as many
# steps again in their place, at most this many times (3 steps, then 6, 12 and 24)
MAX_TRACED_AGAIN = 3
# Layouts the execution-trace observer cannot record: it asks every tensor for its strides, which these have not
# ("Sparse CSR tensors do not have strides"), and the process then died of a segmentation fault inside the
# program's next op (torch 2.13, a CSR matrix times a dense one). The last warm-up step looks for them.
UNTRACEABLE_LAYOUTS = (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)


class _UntraceableLayouts(TorchDispatchMode):
    """Under it, the first op that reads or makes a tensor of an :data:`UNTRACEABLE_LAYOUTS` layout is kept in
    :attr:`found` (its name and the layout); the ops themselves run unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.found: tuple[str, torch.layout] | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.found is None:
            for value in tree_flatten((args, kwargs, out))[0]:
                if isinstance(value, torch.Tensor) and value.layout in UNTRACEABLE_LAYOUTS:
                    self.found = (str(func.overloadpacket), value.layout)
                    break
        return out


def _data_ops() -> list[str]:
    """INDEX_OPS plus every op registered by a recommendation library (fbgemm's jagged, permute and
    table-batched-embedding ops take lengths, offsets and layout buffers that must be exact) or by
    torchvision (its RoI ops read box-to-image indices)."""
    registered = [name for name in torch._C._dispatch_get_all_op_names() if name.startswith(("fbgemm::",
                                                                                               "torchvision::"))]
    return [*INDEX_OPS, *registered]


def platform_record(device: torch.device, world_size: int) -> dict[str, Any]:
    """What a replay compares against to decide whether it runs on the capture's platform."""
    return {
        "device_type": device.type,
        "device_name": device_name(device),
        "num_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "host_allocator": host_allocator_in_effect(),
        "world_size": world_size,
        "host": pyplatform.node(),
        "torch_version": torch.__version__,
        "libraries": library_versions(),
        "git_sha": git_state()[0],
    }


def profiler_activities(device: torch.device) -> list[ProfilerActivity]:
    activities = [ProfilerActivity.CPU]
    if device.type != "cpu":
        accelerator = {"cuda": ProfilerActivity.CUDA, "xpu": ProfilerActivity.XPU}.get(device.type)
        if accelerator is not None and accelerator in torch.profiler.supported_activities():
            activities.append(accelerator)
    return activities


class _ModuleScopes:
    """While tracing, every ``nn.Module`` forward runs inside a record-function scope named after the
    module (``nn.Module: layers.0.attention`` when the root module was given, else its class), so a
    spec can be cut by module (``cobench trace generate --scope``)."""

    def __init__(self, model: torch.nn.Module | None):
        self.names = {id(m): name or "root" for name, m in model.named_modules()} if model is not None else {}
        self.stack: list[Any] = []
        self.handles: list[Any] = []

    def __enter__(self) -> _ModuleScopes:
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        self.handles = [register_module_forward_pre_hook(self._enter), register_module_forward_hook(self._exit)]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()
        while self.stack:
            self.stack.pop().__exit__(None, None, None)

    def _enter(self, module: torch.nn.Module, _args: Any) -> None:
        scope = record_function(f"nn.Module: {self.names.get(id(module), type(module).__name__)}")
        scope.__enter__()
        self.stack.append(scope)

    def _exit(self, _module: torch.nn.Module, _args: Any, _out: Any) -> None:
        if self.stack:
            self.stack.pop().__exit__(None, None, None)


@dataclass(frozen=True)
class _Draws:
    """The states of the random generators a step draws from: torch's on the CPU and on the step's device,
    Python's and NumPy's global ones (where NumPy is loaded). Put back before a step, the step draws what a
    step started from there drew: a program's random shapes (a crop's length, a mask's count) come out alike."""

    cpu: torch.Tensor
    device: torch.device
    on_device: torch.Tensor | None
    python: Any
    numpy: Any

    @classmethod
    def now(cls, device: torch.device) -> _Draws:
        numpy = sys.modules.get("numpy")
        return cls(torch.random.get_rng_state(), device, rng_state(device), random.getstate(),
                   numpy.random.get_state() if numpy is not None else None)

    def restore(self) -> None:
        torch.random.set_rng_state(self.cpu)
        if self.on_device is not None:
            set_rng_state(self.device, self.on_device)
        random.setstate(self.python)
        if self.numpy is not None:
            sys.modules["numpy"].random.set_state(self.numpy)


class Capture:
    """Drives the phases of a capture; use :meth:`step` around each step of the loop."""

    def __init__(self, out_dir: Path, steps: int, warmup: int, baseline_steps: int, device: torch.device,
                 model: torch.nn.Module | None = None, host_rounds_s: float = 0.0):
        if steps < 1 or baseline_steps < 1 or warmup < 0:
            raise ValueError(
                f"capture needs steps >= 1 and baseline_steps >= 1 and warmup >= 0; got steps={steps}, "
                f"baseline_steps={baseline_steps}, warmup={warmup}"
            )
        self.out_dir, self.device = out_dir, device
        self.warmup, self.baseline_steps, self.steps = warmup, baseline_steps, steps
        self.step_index = 0
        self.plain_times_s: list[float] = []
        self.memory = MemoryMeter(device)
        self.traced_times_s: list[float] = []
        self.timing_times_s: list[float] = []  # steps under Kineto alone (host-gap measurement)
        self.timing_plain_times_s: list[float] = []  # plain steps interleaved with those
        self.timing_spin_ns: list[float] = []  # the host's speed after each round's Kineto-alone steps (spin_ns)
        self.timing_step_spin_ns: list[list[float]] = []  # the same right before and after each measured one
        self._timing_profiler: profile | None = None
        self._timing_parts: list[dict[str, Any]] = []  # each round's Kineto-alone trace
        self.timing_rounds = TIMING_ROUNDS  # host-time rounds to run: more while the host time is not yet known
        # each finished round's host time per measured step (its index among them → µs)
        self.round_host_us: list[dict[int, float]] = []
        # what those rounds leave of the median's interval (% of a plain step), brought to one host speed as the
        # spec holds them
        self.host_half_width_pct = math.inf
        self._rounds_began: float | None = None  # when the first measured host-time round started (perf_counter)
        self.host_rounds_s = host_rounds_s  # what the rounds may take in all to run past MAX_TIMING_ROUNDS
        self._round_trace: KinetoTrace | None = None  # the running round's Kineto-alone steps
        self._timing_bytes = 0  # what the rounds' Kineto-alone traces come to, exported
        self._profiler: profile | None = None
        self._observer: ExecutionTraceObserver | None = None
        self._scopes = _ModuleScopes(model)
        self.values: list[dict[str, Any]] | None = None  # the value profile of the capture's last step
        self.timing_ops: list[int] = []  # ops each measured Kineto-alone step ran (the top-most op events)
        self.timing_op_names: set[str] = set()  # the ops those steps ran, by name
        self.again_blocks: list[int] = []  # the steps of each block traced again after the rounds (_check_traced)
        self._traced_draws: list[_Draws] = []  # the random generators' states before each traced step
        self._peaks = StepPeaks(device)
        self.step_peak_bytes: list[int] = []  # each traced step's memory peak, run again without the observer
        self._draws_after: _Draws | None = None  # the generators' states when those steps began
        # the profiler's cost of each kind of op event on this host, measured before the program's first step (the
        # rounds' host time is split by it, and the spec's; once a process)
        self.event_weights = event_weights()

    @property
    def timing_steps(self) -> int:
        """Steps under Kineto alone that are measured, over all rounds."""
        return self.timing_rounds * TIMING_MEASURED

    @property
    def total_steps(self) -> int:
        """Steps the loop runs; it grows while the host-time rounds are added (:meth:`_settle_rounds`)."""
        return self.warmup + self.baseline_steps + self.steps + (SETTLE_ROUNDS + self.timing_rounds) * _ROUND + \
            sum(self.again_blocks) + self.memory_steps + VALUE_STEPS

    @property
    def memory_steps(self) -> int:
        """Steps run again for their memory peak after the last block traced: one for each of its steps."""
        return self.again_blocks[-1] if self.again_blocks else self.steps

    @property
    def tracing(self) -> bool:
        """Whether the next step runs traced (under the execution-trace observer)."""
        return self._trace_index()[0] is not None

    @property
    def traced_again(self) -> int:
        """How many times the steps were traced again after the host-time rounds (:meth:`_check_traced`)."""
        return len(self.again_blocks)

    def _trace_index(self) -> tuple[int | None, int, bool]:
        """The next step's index among its block of traced steps (None: not traced), the block's steps, and
        whether it is traced again."""
        index = self.step_index - self.warmup - self.baseline_steps
        again = index - self.steps - (SETTLE_ROUNDS + self.timing_rounds) * _ROUND  # past the rounds: traced again
        for size in self.again_blocks if again >= 0 else ():
            if again < size:
                return again, size, True
            again -= size
        return (index, self.steps, False) if 0 <= index < self.steps else (None, 0, False)

    @property
    def done(self) -> bool:
        """True once every phase has run: the loop may stop."""
        return self.step_index >= self.total_steps

    @contextmanager
    def step(self) -> Iterator[None]:
        """One step of the user's loop; steps past the last phase run plain."""
        index = self.step_index - self.warmup - self.baseline_steps
        trace_index, block, traced_again = self._trace_index()
        traced = trace_index is not None
        round_, at = divmod(index - self.steps - SETTLE_ROUNDS * _ROUND, _ROUND)  # the settling rounds: below 0
        in_rounds = index >= self.steps and round_ < self.timing_rounds
        in_timing = in_rounds and round_ >= 0
        profile_values = self.step_index == self.total_steps - 1
        memory_index = self.step_index - (self.total_steps - VALUE_STEPS - self.memory_steps)
        in_memory = 0 <= memory_index < self.memory_steps
        kineto = in_rounds and at < TIMING_WARMUP + TIMING_MEASURED
        measured_kineto = kineto and in_timing and at >= TIMING_WARMUP
        measured_plain = in_timing and at >= _ROUND - PLAIN_MEASURED
        timing_index = round_ * TIMING_MEASURED + at - TIMING_WARMUP
        timed = self.warmup <= self.step_index < self.warmup + self.baseline_steps or traced
        if traced and self._profiler is None:
            self._traced_draws = []
            if traced_again:  # in place of the steps traced before
                self.traced_times_s = []
                (self.out_dir / ET_FILE).unlink(missing_ok=True)
                shutil.rmtree(self.out_dir / ET_RESOURCES, ignore_errors=True)
            self._start_profiler()
        if traced:
            self._traced_draws.append(_Draws.now(self.device))
        if in_memory:
            if memory_index == 0:
                self._draws_after = _Draws.now(self.device)
                self._peaks.start()
            if memory_index < len(self._traced_draws):  # the traced step's own draws: its shapes
                self._traced_draws[memory_index].restore()
        if kineto and self._timing_profiler is None:
            self._timing_profiler = profile(activities=profiler_activities(self.device))
            self._timing_profiler.start()
        synchronize(self.device)
        if in_timing and self._rounds_began is None:
            self._rounds_began = time.perf_counter()
        spin_before = spin_ns(readings=1) if measured_kineto else 0.0  # outside the step's annotation and time
        started = time.perf_counter()
        if traced:
            with record_function(f"{STEP_ANNOTATION}{trace_index}"), self._scopes:
                yield
        elif profile_values:
            held = ValueProfile()
            # compiled code runs eagerly for this one step: a dispatch mode would make torch.compile
            # recompile the program's own graphs
            with torch.compiler.set_stance("force_eager"), held:
                yield
            self.values = held.entries
        elif measured_kineto:
            with record_function(f"{STEP_ANNOTATION}{timing_index}"):
                yield
        elif in_memory:
            with self._peaks.step():
                yield
        elif self.step_index == self.warmup - 1:  # the last warm-up step (a compiled program compiled in the first)
            layouts = _UntraceableLayouts()
            with torch.compiler.set_stance("force_eager"), layouts:
                yield
            if layouts.found is not None:
                op, layout = layouts.found
                raise TraceError(
                    f"capture into {self.out_dir}: the step holds a sparse tensor of layout {layout} (first in "
                    f"{op}), which PyTorch's execution-trace observer cannot record (it takes every tensor's "
                    f"strides, and the process crashed after it); keep sparse matrices in COO layout "
                    f"(`.to_sparse()`, which the replay runs) or dense while capturing")
        else:
            yield
        synchronize(self.device)
        elapsed = time.perf_counter() - started
        if timed:
            (self.traced_times_s if traced else self.plain_times_s).append(elapsed)
        if measured_kineto:
            self.timing_times_s.append(elapsed)
            self.timing_step_spin_ns.append([spin_before, spin_ns(readings=1)])
        if measured_plain:
            self.timing_plain_times_s.append(elapsed)
        if timed and not traced:
            self.memory.sample()
        self.step_index += 1
        if in_memory and memory_index == self.memory_steps - 1:
            self.step_peak_bytes = self._peaks.stop()
            self.end_memory_steps()
        if traced and trace_index == block - 1:
            self._stop_profiler()
            if traced_again:
                self._check_traced()
        if kineto and at == TIMING_WARMUP + TIMING_MEASURED - 1 and not in_timing:
            self._stop_timing_profiler(keep=False)  # a settling round's
        if measured_kineto and at == TIMING_WARMUP + TIMING_MEASURED - 1:
            # beside the host time those steps had (a pure Python loop: Kineto records no event in it); a replay
            # spends that host time scaled by its own host's speed as it runs
            self.timing_spin_ns.append(spin_ns())
            self._stop_timing_profiler()
        if measured_plain and at == _ROUND - 1:
            self._settle_rounds()
            if round_ == self.timing_rounds - 1:  # the last round: none was added
                self._check_traced()

    def _check_traced(self) -> None:
        """After the host-time rounds, and after each block traced again: one more block traced in place of the
        last while the traced steps ran more or fewer ops a step than the rounds' steps, at the mean, by more
        than :data:`~workloads.trace_replay.fidelity.UNREPRESENTATIVE_PCT` (both counted as the spec counts
        them: :func:`~workloads.trace_replay.host_time.step_op_counts`), up to :data:`MAX_TRACED_AGAIN` blocks,
        each twice the steps of the last: the mean of a few steps of a program whose steps differ by chance
        lands on a few values only (Wav2Vec2's steps ran 905 ops, or 606 with a layer dropped, 858 at the mean:
        3 steps read 905 or 805, both more than 5 % off), and of more steps nearer the mean. Under torchrun every
        rank traces again where any rank's steps differ (the steps hold collectives)."""
        unlike = False
        if self.timing_ops and (path := self.out_dir / KINETO_FILE).is_file():
            traced = list(step_op_counts(read_kineto(path), self.timing_op_names).values())
            unlike = bool(traced) and steps_unlike(statistics.fmean(traced), statistics.fmean(self.timing_ops))
        if any(gather_to_all(unlike)) if dist.is_available() and dist.is_initialized() else unlike:
            if self.traced_again < MAX_TRACED_AGAIN:
                self.again_blocks.append(2 * (self.again_blocks[-1] if self.again_blocks else self.steps))

    def _settle_rounds(self) -> None:
        """After a round's plain steps: its host time per measured step (the profiler's cost taken against
        those plain steps, every op's time left out), and one more round while the rounds so far leave the
        median host time wider than ±:data:`HOST_TARGET_PCT` of the baseline's plain step, up to
        :data:`MAX_TIMING_ROUNDS` (past those, up to :data:`QUICK_TIMING_ROUNDS` while one more keeps the rounds
        within ``host_rounds_s`` seconds) and while one more round's trace keeps them within
        :data:`MAX_TIMING_TRACE_BYTES`. Under torchrun a round is added on every rank where any rank asks for
        one (the steps hold collectives; every rank takes part in that decision at each round's end, whatever its
        own limits say). The bundle's extraction measures the same host time again against the ops its spec
        replays, and brings it to one host speed."""
        gaps: dict[int, float] = {}
        if self._round_trace is not None:
            plain_us = 1e6 * statistics.median(self.timing_plain_times_s[-PLAIN_MEASURED:])
            gaps = kineto_host_gaps(self._round_trace, {None: plain_us}, is_op, self.event_weights)
            self.timing_ops += list(step_op_counts(self._round_trace).values())
            self.timing_op_names |= op_names(self._round_trace)
            self._round_trace = None
        self.round_host_us.append(gaps)  # on every rank alike, read or not
        rounds = len(self.round_host_us)
        if rounds < self.timing_rounds:
            return
        more = self._room_for_a_round(rounds)
        if more:
            self.host_half_width_pct = host_time_half_width_pct(self._rounds_at_one_speed(),
                                                                1e6 * statistics.median(self.plain_times_s))
            more = self.host_half_width_pct > HOST_TARGET_PCT
        if any(gather_to_all(more)) if dist.is_available() and dist.is_initialized() else more:
            self.timing_rounds += 1

    def _rounds_at_one_speed(self) -> list[list[float]]:
        """Each round's host times brought to one speed of the host as the spec will hold them
        (:func:`~workloads.trace_replay.host_time.steps_at_one_speed`; as measured where a step has no spin
        around it). Judged as measured, a capture of the sequence recommender stopped at 9 rounds, its median's
        interval ±1.0 % of the step, which its spec's samples, brought to one speed, held at ±3.0 %."""
        host = {k: gap for gaps in self.round_host_us for k, gap in gaps.items()}
        at_one = steps_at_one_speed(host, self.timing_step_spin_ns)
        if at_one is None:
            return [[gaps[k] for k in sorted(gaps)] for gaps in self.round_host_us]
        brought = dict(zip(sorted(host), at_one.samples_us, strict=True))
        return [[brought[k] for k in sorted(gaps)] for gaps in self.round_host_us]

    def _room_for_a_round(self, rounds: int) -> bool:
        """Whether one more host-time round keeps the rounds within their limits (:meth:`_settle_rounds`)."""
        if self._timing_bytes * (rounds + 1) / rounds > MAX_TIMING_TRACE_BYTES:
            return False
        if rounds < MAX_TIMING_ROUNDS:
            return True
        took = time.perf_counter() - (self._rounds_began or time.perf_counter())
        return rounds < QUICK_TIMING_ROUNDS and took * (rounds + 1) / rounds <= self.host_rounds_s

    def _stop_timing_profiler(self, keep: bool = True) -> None:
        """End a round's Kineto-alone block; its trace joins the others (one time base per process) unless
        not ``keep``."""
        if self._timing_profiler is None:
            return
        self._timing_profiler.stop()
        if not keep:
            self._timing_profiler = None
            return
        part = self.out_dir / f".{KINETO_TIMING_FILE}.part"
        self._timing_profiler.export_chrome_trace(str(part))
        self._timing_profiler = None
        self._timing_bytes += part.stat().st_size
        raw = json.loads(part.read_text())
        self._timing_parts.append(raw)
        self._round_trace = kineto_trace(raw, part)
        part.unlink()

    def write_timing_trace(self) -> None:
        """The rounds' Kineto-alone traces, as one chrome trace (``kineto_timing.json``)."""
        self._stop_timing_profiler()
        if not self._timing_parts:
            return
        merged = dict(self._timing_parts[0])
        merged["traceEvents"] = [e for part in self._timing_parts for e in part.get("traceEvents", [])]
        (self.out_dir / KINETO_TIMING_FILE).write_text(json.dumps(merged))
        self._timing_parts = []

    def _start_profiler(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        previous = {key: os.environ.get(key) for key in (_INT_RANGE_ENV, _INT_DATA_ENV)}
        os.environ[_INT_RANGE_ENV] = "1"
        os.environ[_INT_DATA_ENV] = ",".join(_data_ops())
        try:
            (self.out_dir / ET_RESOURCES).mkdir(exist_ok=True)  # the observer does not create it in time
            self._observer = ExecutionTraceObserver().register_callback(str(self.out_dir / ET_FILE))
            self._observer.set_extra_resource_collection(True)
            # memory events: when the program freed each buffer (the replay holds buffers as long)
            self._profiler = profile(activities=profiler_activities(self.device), record_shapes=True,
                                     profile_memory=True, execution_trace_observer=self._observer)
            self._profiler.start()
        finally:
            for key, value in previous.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value

    def _stop_profiler(self) -> None:
        if self._profiler is None or self._observer is None:
            return
        self._profiler.stop()
        self._profiler.export_chrome_trace(str(self.out_dir / KINETO_FILE))
        self._observer.unregister_callback()
        self._profiler = None

    def end_memory_steps(self) -> None:
        """After the steps run again for their memory, or where the loop ended among them (no figure then): the
        memory profiler ends and the program draws on as if those steps had not run."""
        self._peaks.abandon()
        if self._draws_after is not None:
            self._draws_after.restore()
            self._draws_after = None

    def abandon(self) -> None:
        """Stop an unfinished profiler (the loop failed); leaves no meta.json, so no bundle."""
        self.end_memory_steps()
        if self._timing_profiler is not None:
            self._timing_profiler.stop()
            self._timing_profiler = None
        if self._profiler is not None:
            self._profiler.stop()
            self._profiler = None
        if self._observer is not None:
            self._observer.unregister_callback()


def bundle_dir(out_dir: Path, rank: int, world_size: int) -> Path:
    return out_dir / f"rank{rank}" if world_size > 1 else out_dir


@contextmanager
def capture(
    out_dir: str | Path,
    *,
    steps: int = 3,
    warmup: int = 5,
    baseline_steps: int = 20,
    device: torch.device | str | None = None,
    config: dict[str, Any] | None = None,
    source: str = "program",
    source_run_id: str = "",
    model: torch.nn.Module | None = None,
    announce: bool = True,
    host_rounds_s: float = 0.0,
) -> Iterator[Capture]:
    """Capture a trace bundle of the steps marked with ``cap.step()``; see the module docstring.

    ``model``: your root module, to name module scopes by their path (``layers.0.attention``).
    ``announce``: when done, rank 0 prints where the bundle is, the overhead and the next command
    (stderr), as ``cobench trace capture`` does. ``host_rounds_s``: past the 32 host-time rounds any capture may
    run while the program's host time is not yet known within ±1 % of its step, more (up to 96) while all of them
    take at most this many seconds (a judgement gives half its budget).

    Raises :class:`TraceError` when the loop ends before a traced step completed.
    """
    device = torch.device(device) if device is not None else torch.device("cpu")
    rank = dist.get_rank() if dist.is_initialized() else 0
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    target = bundle_dir(Path(out_dir), rank, world_size)
    cap = Capture(target, steps, warmup, baseline_steps, device, model, host_rounds_s)
    started = time.perf_counter()
    try:
        yield cap
    except BaseException:
        cap.abandon()
        raise
    cap._stop_profiler()
    cap.write_timing_trace()  # also when the loop ended inside the timing phase
    cap.end_memory_steps()  # ... or inside the steps run again for their memory
    if not cap.traced_times_s or not cap.plain_times_s:
        raise TraceError(
            f"capture into {target}: the loop ran {cap.step_index} step(s), but a bundle needs "
            f"{cap.total_steps} (warm-up {warmup}, timed baseline {baseline_steps}, traced {steps}, "
            f"host-time rounds {SETTLE_ROUNDS} + {cap.timing_rounds} x {_ROUND}, traced again "
            f"{sum(cap.again_blocks)}, memory {cap.memory_steps}, value profile {VALUE_STEPS}); "
            f"loop until `cap.done`"
        )
    meta = BundleMeta(
        step_times_s=cap.plain_times_s,
        traced_step_times_s=cap.traced_times_s,
        platform=platform_record(device, world_size),
        config=config or {},
        rank=rank,
        world_size=world_size,
        source=source,
        source_run_id=source_run_id,
        capture_wall_s=time.perf_counter() - started,
        peak_memory_bytes=cap.memory.read(),
        timing_step_times_s=cap.timing_times_s,
        timing_plain_step_times_s=cap.timing_plain_times_s,
        timing_rounds=len(cap.timing_times_s) // TIMING_MEASURED,
        timing_spin_ns=cap.timing_spin_ns,
        timing_step_spin_ns=cap.timing_step_spin_ns,
        traced_again=cap.traced_again,
        step_peak_bytes=cap.step_peak_bytes,
        profiler_event_weights=list(cap.event_weights or ()),
    )
    if cap.values is not None:
        (target / VALUES_FILE).write_text(json.dumps(cap.values))
    (target / META_FILE).write_text(json.dumps(meta.to_json(), indent=2))
    if announce and rank == 0:
        print(capture_summary(meta, Path(out_dir)), file=sys.stderr)


def capture_summary(meta: BundleMeta, out_dir: Path) -> str:
    """What a capture says when it is done: where the bundle is, what it cost, what to run next."""
    plain_ms = meta.to_json()["step_time_ms_median"]
    return (f"captured {meta.source}: {out_dir}\n  step {plain_ms:.2f} ms plain, capture overhead "
            f"{meta.capture_overhead_pct:+.0f} %, host time over {meta.timing_rounds} rounds\n"
            + (f"  traced {meta.traced_again} more time{'s' if meta.traced_again > 1 else ''}: the steps traced before "
               f"ran more or fewer ops than the program's steps\n" if meta.traced_again else "")
            + f"to make its benchmark: cobench trace generate {out_dir}")


@dataclass
class SourceWorkload:
    """A registered workload set up to be captured (and, for a side-by-side judgement, run again)."""

    workload: Workload
    ctx: RunContext
    platform: Platform
    cfg: CobenchConfig

    def capture(self, out_dir: Path, *, steps: int, warmup: int, baseline_steps: int, announce: bool = True,
                host_rounds_s: float = 0.0) -> Path:
        """Capture this rank's bundle into ``out_dir``; returns the rank's bundle folder (``host_rounds_s``: see
        :func:`capture`)."""
        config = OmegaConf.to_container(OmegaConf.structured(self.cfg.workload), resolve=True)
        with capture(out_dir, steps=steps, warmup=warmup, baseline_steps=baseline_steps, device=self.ctx.device,
                     config={"workload": config, "platform": self.platform.name, "seed": self.cfg.seed},
                     source=self.cfg.workload.name, model=self.workload.root_module(), announce=announce,
                     host_rounds_s=host_rounds_s) as cap:
            hold = getattr(self.workload, "hold_batch", None)
            try:
                while not cap.done:
                    if hold is not None and cap.step_index == cap.warmup + cap.baseline_steps:
                        hold(True)  # the traced step's batch for the steps timed op by op after it
                    with cap.step():
                        self.workload.step()
            finally:
                if hold is not None:
                    hold(False)
        return bundle_dir(out_dir, self.ctx.rank, self.ctx.world_size)


def prepare_source(cfg: CobenchConfig, work_dir: Path) -> SourceWorkload:
    """Platform, process group and the workload ``cfg`` names, set up (validated before anything runs)."""
    if discover()[cfg.workload.name].replays_bundle:
        raise ValueError(f"capture a reference workload or your own program, not a replay "
                         f"(workload={cfg.workload.name})")
    opened = open_workload(cfg, work_dir)
    seed_everything(cfg.seed, cfg.deterministic)
    opened.workload.setup()
    return SourceWorkload(opened.workload, opened.ctx, opened.platform, cfg)


def default_trace_dir(cfg: CobenchConfig, label: str) -> Path:
    """``<results_dir>/traces/<label>-<time>``, the same on every rank."""
    name = f"{label}-{time.strftime('%Y%m%d-%H%M%S')}"
    return Path(broadcast_from_main(str(results_root(cfg) / "traces" / name) if env_dist_info().is_main else None))


def capture_benchmark(cfg: CobenchConfig, out_dir: Path | None, *, steps: int, warmup: int,
                      baseline_steps: int) -> Path:
    """``cobench trace capture``: capture the registered workload ``cfg`` describes.

    Returns this rank's bundle folder (``<results_dir>/traces/<workload>-<time>`` by default).
    """
    if out_dir is None:
        join_process_group(cfg)
        out_dir = default_trace_dir(cfg, cfg.workload.name)
    out_dir.mkdir(parents=True, exist_ok=True)
    source = prepare_source(cfg, out_dir)
    try:
        return source.capture(out_dir, steps=steps, warmup=warmup, baseline_steps=baseline_steps)
    finally:
        source.workload.teardown()
