"""The workload protocol: the one contract between the harness and a benchmark.

A workload knows its model and data and nothing else. Everything it needs from the outside world
(device, dtype policy, process group, seed, paths) arrives in a :class:`RunContext`, built by the
harness. A workload never imports from ``harness`` or ``suite``.

Life cycle, driven by the harness runner::

    workload = REGISTRY[name].factory(config, ctx)   # cheap; validates config against ctx
    workload.setup()                                  # build model, optimiser, data
    for each step: workload.step() -> StepResult      # one training/inference iteration
                   workload.between_steps()           # optional, untimed housekeeping (the training loop)
    workload.evaluate() -> {"eval_loss": ...}         # optional, quality metrics
    workload.observe_step_times(times)                # optional, the timed steps' durations
    workload.extra_metrics() -> {...}                 # the workload's own metrics
    workload.teardown()
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch


def invalid_config(key: str, message: str) -> ValueError:
    """The error for a bad workload config value; ``key`` is relative to ``workload.``."""
    return ValueError(f"invalid config 'workload.{key}': {message}")


@contextmanager
def library_log_to(path: Path, *loggers: str) -> Iterator[None]:
    """Send what these libraries' loggers say meanwhile (e.g. TorchRec's sharding-plan tables) to
    ``path`` in the run's folder instead of the terminal. ``py.warnings`` among them: Python warnings
    raised meanwhile go there too (deprecation notices of the libraries being set up)."""
    path.parent.mkdir(parents=True, exist_ok=True)  # another node's rank may not have the run folder yet
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    saved = []
    for name in loggers:
        logger = logging.getLogger(name)
        saved.append((logger, logger.propagate, logger.handlers[:], logger.level))
        logger.handlers, logger.propagate = [handler], False
        logger.setLevel(logging.DEBUG)
    if "py.warnings" in loggers:
        logging.captureWarnings(True)
    try:
        yield
    finally:
        if "py.warnings" in loggers:
            logging.captureWarnings(False)
        for logger, propagate, handlers, level in saved:
            logger.handlers, logger.propagate = handlers, propagate
            logger.setLevel(level)
        handler.close()


class PlatformUnsupported(ValueError):
    """A valid configuration this platform or launch cannot run (e.g. a CUDA-only sharding on a CPU, a
    codec that needs >1 rank in one process). A suite SKIPs such a benchmark with this reason; any
    other error from a workload's constructor is a bad configuration and stops the suite before it runs."""


def unsupported(key: str, message: str) -> PlatformUnsupported:
    """:class:`PlatformUnsupported` for the setting ``workload.<key>``."""
    return PlatformUnsupported(f"cannot run here: 'workload.{key}': {message}")


@dataclass(frozen=True)
class RunContext:
    """What the harness hands a workload."""

    device: torch.device
    seed: int
    rank: int = 0
    world_size: int = 1
    process_group: Any = None  # torch.distributed ProcessGroup, or None when not distributed
    deterministic: bool = False
    work_dir: Path = Path(".")  # per-run scratch/output folder, already created
    device_name: str = ""  # what the hardware calls itself, e.g. "NVIDIA H100 80GB HBM3"
    warmup_steps: int = 0  # the untimed first steps of each repetition (a workload may measure itself in them)
    # one replica group of a fault-tolerant job (workloads/fault_tolerance.py: FaultTolerance), else None
    fault_tolerance: Any = None

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_accelerator(self) -> bool:
        return self.device.type != "cpu"


@dataclass
class StepResult:
    """What one call of :meth:`Workload.step` processed.

    ``samples`` and ``tokens`` count this rank's local work. ``loss`` may stay a tensor so the
    harness decides when to synchronise with the device.
    """

    samples: int
    tokens: int = 0
    loss: torch.Tensor | float | None = None
    # seconds the step waited for its batch (reading, tokenizing, moving it to the device): the harness
    # reports the timed steps' median as data_wait_ms_p50; None: the workload does not measure it
    data_wait_s: float | None = None


@dataclass(frozen=True)
class QualityTarget:
    """A quality goal, MLPerf style: ``metric`` must reach ``value`` (``mode`` says which way)."""

    metric: str
    value: float
    mode: str = "min"  # "min": metric <= value is good; "max": metric >= value

    def reached(self, measured: float) -> bool:
        return measured <= self.value if self.mode == "min" else measured >= self.value


@dataclass(frozen=True)
class MLPerfInfo:
    """Hyper-parameters a workload declares for the MLPerf log (keys of ``mllog.constants``)."""

    benchmark: str  # e.g. "llama31_8b" when the workload mirrors an MLPerf one
    global_batch_size: int
    train_samples: int
    eval_samples: int
    gradient_accumulation_steps: int = 1
    hyperparameters: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of_batches(cls, benchmark: str, global_batch_size: int, train_batches: int, eval_batches: int,
                   **rest: Any) -> MLPerfInfo:
        """For a workload whose train and eval sets are whole global batches."""
        return cls(benchmark, global_batch_size, train_batches * global_batch_size,
                   eval_batches * global_batch_size, **rest)


@runtime_checkable
class Workload(Protocol):
    """One benchmark. See the module docstring for the life cycle."""

    throughput_unit: str  # "tokens/s" or "samples/s"
    compute_dtype: torch.dtype  # what the matmuls run in: MFU is measured against its peak

    def setup(self) -> None: ...

    def step(self) -> StepResult: ...

    def between_steps(self) -> None: ...

    def evaluate(self) -> dict[str, float]: ...

    def flops_per_step(self) -> float | None: ...

    def quality_target(self) -> QualityTarget | None: ...

    def mlperf_info(self) -> MLPerfInfo: ...

    def extra_metrics(self) -> dict[str, float]: ...

    def observe_step_times(self, step_times_s: list[float]) -> None: ...

    def run_tags(self) -> dict[str, str]: ...

    def root_module(self) -> torch.nn.Module | None: ...

    def teardown(self) -> None: ...


class _Float32:
    """``torch.float32``, looked up when read: this module (which every workload package imports to declare
    itself, and every config schema imports) needs no torch. A subclass or an instance sets its own."""

    def __get__(self, instance: object, owner: type) -> torch.dtype:
        import torch

        return torch.float32


class WorkloadBase:
    """Defaults for the optional parts of the protocol."""

    throughput_unit = "samples/s"
    compute_dtype = _Float32()

    def evaluate(self) -> dict[str, float]:
        return {}

    def between_steps(self) -> None:
        """Called after each step, outside its timing: housekeeping that is not the step's work (a replay puts
        its carried state back as it was made once it has run every captured step)."""

    def flops_per_step(self) -> float | None:
        return None

    def quality_target(self) -> QualityTarget | None:
        return None

    def extra_metrics(self) -> dict[str, float]:
        return {}

    def teardown(self) -> None:
        pass

    def observe_step_times(self, step_times_s: list[float]) -> None:
        """Called with this rank's timed step durations just before :meth:`extra_metrics`."""

    def run_tags(self) -> dict[str, str]:
        """Extra MLflow tags for the run (e.g. where a replayed trace came from)."""
        return {}

    def root_module(self) -> torch.nn.Module | None:
        """The model, when there is one: a capture names each op's module scope from its hooks."""
        return None

    def hold_batch(self, hold: bool) -> None:
        """While held, every step trains on the batch the next step trains on. A capture holds it from its
        traced step on, so the steps it times op by op run the traced step's shapes: a workload whose op
        shapes follow its data (jagged sequences in length buckets) implements it; others need not."""

    def sharded_stage(self) -> ShardedStage | None:
        """The part of a step that TorchRec's ``DistributedModelParallel`` shards across ranks, as a stage that
        runs alone (what-if prediction times it at W ranks: a single-rank trace cannot show it). None: the
        workload has no such part."""
        return None


@dataclass(frozen=True)
class ShardedStage:
    """A workload's sharded embedding stage: ``module`` is its path under :meth:`WorkloadBase.root_module`
    (the ops a capture names with it are the stage's, forward and backward), ``run`` one pass over the next
    training batch — input distribution, lookups, output distribution, backward with the tables' fused
    optimizer — as the step runs it."""

    module: str
    run: Callable[[], None]


@dataclass(frozen=True)
class WorkloadSpec:
    """A registry entry: the workload's name, its config schema and how to build it.

    A workload package declares its entry (:func:`declare`) without importing its code: listing
    workloads is cheap. Its config schema lives in a light module of its own (``config``), imported
    alone when configs are composed; the workload's module (TorchRec, for some) is imported the first
    time its factory is asked for.
    """

    name: str
    module: str  # imported on first use; it binds the classes with @register
    description: str = ""
    # Replays trace bundles (``factory.from_bundle(bundle, ctx, **options)`` builds one from a
    # capture): the harness finds the replay by this property, never by a workload's name.
    replays_bundle: bool = False
    # "package.module:Class", the config schema, importable without the workload's module; None: the
    # class @register binds (the workload's module is imported to find it)
    config: str | None = None

    @property
    def config_class(self) -> type:
        if self.config is None:
            return self._bound()[0]
        module, _, name = self.config.partition(":")
        return getattr(importlib.import_module(module), name)

    @property
    def factory(self) -> Callable[[Any, RunContext], Workload]:
        return self._bound()[1]

    def _bound(self) -> tuple[type, Callable[[Any, RunContext], Workload]]:
        if self.name not in _BOUND:
            importlib.import_module(self.module)
        if self.name not in _BOUND:
            raise RuntimeError(f"workload {self.name!r}: importing {self.module} registered no class "
                               f"(decorate it with @register({self.name!r}, ConfigClass))")
        bound = _BOUND[self.name]
        if self.config is not None and bound[0] is not self.config_class:
            raise RuntimeError(f"workload {self.name!r} is declared with config {self.config} but @register binds "
                               f"{bound[0].__module__}:{bound[0].__qualname__}")
        return bound


REGISTRY: dict[str, WorkloadSpec] = {}
_BOUND: dict[str, tuple[type, Callable[[Any, RunContext], Workload]]] = {}


def declare(name: str, module: str, description: str, *, config: str | None = None,
            replays_bundle: bool = False) -> None:
    """Declare workload ``name``, implemented (``@register``) in ``module``, imported on first use;
    ``config`` ("package.module:Class") names its config schema, imported alone to compose configs."""
    existing = REGISTRY.get(name)
    if existing is not None and existing.module != module:
        raise ValueError(f"workload {name!r} is declared twice ({existing.module}, {module})")
    REGISTRY[name] = WorkloadSpec(name, module, description, replays_bundle=replays_bundle, config=config)


def lazy_attributes(package: str, exports: dict[str, list[str]]) -> Callable[[str], Any]:
    """A package's ``__getattr__`` serving its public names from their modules, imported on first use
    (``exports``: module → names), so importing the package (to :func:`declare` it) stays cheap."""
    where = {name: module for module, names in exports.items() for name in names}

    def attribute(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(where[name]), name)

    return attribute


class Progress(Protocol):
    """How a long preparation reports progress (the CLI draws it with ``rich``)."""

    def task(self, description: str, total: float | None = None, unit: str = "") -> Callable[[float], None]:
        """Start a task; returns the function that advances it by an amount."""
        ...


@dataclass(frozen=True)
class PreparerSpec:
    """A data preparation ``cobench data prepare NAME`` runs: ``module`` defines ``Options`` (a dataclass
    whose fields become the command's options; ``field(metadata={"help": ...})`` documents each) and
    ``prepare(options, progress) -> dict`` (what it wrote, printed as the command's summary). Declared
    by the workload package whose data it prepares; imported only when run."""

    name: str
    module: str
    description: str


PREPARERS: dict[str, PreparerSpec] = {}


def declare_preparer(name: str, module: str, description: str) -> None:
    """Declare ``cobench data prepare NAME``, implemented in ``module`` (see :class:`PreparerSpec`)."""
    existing = PREPARERS.get(name)
    if existing is not None and existing.module != module:
        raise ValueError(f"data preparer {name!r} is declared twice ({existing.module}, {module})")
    PREPARERS[name] = PreparerSpec(name, module, description)


@dataclass(frozen=True)
class PlannerSpec:
    """``cobench plan workload=NAME``: the layout planner a workload package declares. ``module`` defines
    ``plan(config, devices, device_memory_bytes, memory_source, on_cpu)`` (the workload's config, the device
    count, one device's memory in bytes, where that figure came from, whether the devices are CPUs), which
    returns an object with ``format(top, verbose) -> str``, ``to_json() -> dict`` and ``fitting`` (the layouts
    that fit) and raises ValueError for input it cannot plan. It runs no model; imported only when run."""

    workload: str
    module: str


PLANNERS: dict[str, PlannerSpec] = {}


def declare_planner(workload: str, module: str) -> None:
    """Declare the layout planner of ``workload``, implemented in ``module`` (see :class:`PlannerSpec`)."""
    existing = PLANNERS.get(workload)
    if existing is not None and existing.module != module:
        raise ValueError(f"workload {workload!r} declares two planners ({existing.module}, {module})")
    PLANNERS[workload] = PlannerSpec(workload, module)


def register(name: str, config_class: type, description: str = "", *,
             replays_bundle: bool = False) -> Callable[[type], type]:
    """Class decorator: ``@register("llama", LlamaConfig)`` binds a workload's classes to its entry
    (made here for a workload nobody declared, e.g. one defined in a test or a user's module)."""
    if not dataclasses.is_dataclass(config_class):
        raise TypeError(f"workload {name!r}: config_class must be a dataclass")

    def decorate(cls: type) -> type:
        if name in _BOUND and _BOUND[name][1] is not cls:
            raise ValueError(f"workload {name!r} is registered twice")
        if name not in REGISTRY:
            REGISTRY[name] = WorkloadSpec(name, cls.__module__, description or (cls.__doc__ or "").strip(),
                                          replays_bundle=replays_bundle)
        _BOUND[name] = (config_class, cls)
        return cls

    return decorate
