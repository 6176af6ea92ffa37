"""Structured configuration: the schema Hydra composes against, and value validation.

Types and unknown keys are checked by OmegaConf while composing (every node is a dataclass).
Values are checked in ``__post_init__``, which runs when :func:`to_run_config` turns the composed
config into objects: one place, before anything starts, naming the key and what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException, MissingConfigException
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError

from harness.cost import PlatformCost
from workloads import discover

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
DEVICE_CHOICES = ("auto", "cpu", "cuda", "xpu", "mps", "hpu", "mtia")
DIST_BACKENDS = ("auto", "gloo", "nccl", "xccl", "hccl")
HOST_ALLOCATORS = ("steady", "system")
DIVISIONS = ("open", "closed")
STATUSES = ("onprem", "cloud", "research", "preview", "available")


def _require(condition: bool, key: str, message: str) -> None:
    if not condition:
        raise ValueError(f"invalid config '{key}': {message}")


def _require_choice(value: Any, key: str, choices: tuple[str, ...]) -> None:
    _require(value in choices, key, f"got {value!r}, allowed values: {', '.join(choices)}")


@dataclass
class PlatformConfig:
    """Where a benchmark runs and what its peak is."""

    name: str = "auto"  # label in tags and reports; "auto" derives it from the device
    device: str = "auto"  # auto: the current torch.accelerator, else CPU
    num_threads: int = 0  # intra-op CPU threads; 0 keeps torch's default
    dist_backend: str = "auto"  # auto: nccl on CUDA (RCCL on ROCm), xccl on XPU, hccl on HPU, gloo otherwise
    # Declared peak FLOP/s per dtype for this platform (e.g. {bfloat16: 989e12}); wins over the
    # built-in table. Empty: the table for known parts, else a measured GEMM calibration.
    peak_flops: dict[str, float] = field(default_factory=dict)
    calibrate: bool = True  # measure an unknown part's peak (else MFU is reported unknown)
    calibration_cache: str = "~/.cache/cobench/calibration.json"
    # Host memory: "steady" keeps freed heap memory in the process (glibc: no trimming, no per-tensor
    # mmap), as a caching allocator does, so a step does not pay page faults for memory it freed one step
    # before; "system" leaves the C library's defaults (harness/platform.py: configure_host_allocator).
    host_allocator: str = "steady"
    cost: PlatformCost = field(default_factory=PlatformCost)  # one host's capex and power (harness/cost.py)
    # The machine a layout is planned for (`cobench plan`): how many devices, and one device's memory in GB
    # (1e9 bytes). None: the ranks torchrun would start here (1 without an accelerator), and the current
    # device's memory (host RAM on a CPU). A run itself takes its world size from torchrun.
    devices: int | None = None
    device_memory_gb: float | None = None

    def __post_init__(self) -> None:
        _require(self.devices is None or self.devices >= 1, "platform.devices",
                 f"got {self.devices}, must be >= 1 (or null: the devices here)")
        _require(self.device_memory_gb is None or (math.isfinite(self.device_memory_gb) and self.device_memory_gb > 0),
                 "platform.device_memory_gb", f"got {self.device_memory_gb}, must be > 0 GB (or null: this device's)")
        _require_choice(self.device.split(":")[0], "platform.device", DEVICE_CHOICES)
        _require_choice(self.dist_backend, "platform.dist_backend", DIST_BACKENDS)
        _require_choice(self.host_allocator, "platform.host_allocator", HOST_ALLOCATORS)
        _require(self.num_threads >= 0, "platform.num_threads", f"got {self.num_threads}, must be >= 0")
        for dtype, peak in self.peak_flops.items():
            _require(
                math.isfinite(peak) and peak > 0,
                f"platform.peak_flops.{dtype}",
                f"got {peak}, must be a positive FLOP/s figure",
            )


@dataclass
class RunnerConfig:
    """How the harness drives a workload."""

    warmup_steps: int = 3  # run, not timed: the first training steps of each repetition
    steps: int = 20  # timed training steps per repetition (the most, with stop_at_target)
    repetitions: int = 1  # independent runs; the result is their olympic mean
    eval_interval: int = 0  # evaluate every N timed steps; 0: once, at the end
    stop_at_target: bool = False  # stop a repetition once the quality target is reached
    progress: bool = True  # a progress bar on a terminal (always quiet otherwise)
    # A run is marked noisy (warning, tag noisy=1) beyond these: its figures are not to be trusted.
    noise_step_cv_max: float = 0.5  # step-time cv (fraction); variable-length workloads sit near 0.25
    noise_rep_cv_max: float = 0.25  # cv of the repetitions' throughputs (fraction)

    def __post_init__(self) -> None:
        _require(self.warmup_steps >= 0, "runner.warmup_steps", f"got {self.warmup_steps}, must be >= 0")
        _require(self.steps >= 1, "runner.steps", f"got {self.steps}, must be >= 1")
        _require(self.repetitions >= 1, "runner.repetitions", f"got {self.repetitions}, must be >= 1")
        _require(self.eval_interval >= 0, "runner.eval_interval", f"got {self.eval_interval}, must be >= 0")
        for key in ("noise_step_cv_max", "noise_rep_cv_max"):
            _require(getattr(self, key) > 0, f"runner.{key}", f"got {getattr(self, key)}, must be > 0")


CREDENTIALS_ADVICE = ("give a server's to MLflow through MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or a "
                      "token in MLFLOW_TRACKING_TOKEN), a database's through its own (PGPASSWORD, ~/.pgpass) instead: "
                      "a tracking URI is written into run folders, MLflow params, logs and reports")


def uri_has_credentials(uri: str) -> bool:
    """Whether a URI carries a password (``http://user:secret@host``; a user name alone is no secret)."""
    return urlsplit(uri).password is not None


def redacted_uri(uri: str) -> str:
    """``uri`` with its password replaced by ``***``: safe to print."""
    parts = urlsplit(uri)
    if parts.password is None:
        return uri
    user, host = parts.netloc.rsplit("@", 1)
    return urlunsplit(parts._replace(netloc=f"{user.split(':', 1)[0]}:***@{host}"))


@dataclass
class TrackingConfig:
    """MLflow tracking. The embedded default is an sqlite store under results_dir. Credentials never
    go in the URI (it is written down everywhere a run is): MLflow's own variables carry them."""

    enabled: bool = True
    uri: str | None = None  # None: $MLFLOW_TRACKING_URI, else sqlite:///<results_dir>/mlflow.db
    experiment: str = "cobench"
    connect_timeout_s: float = 5.0
    # an owner-only file in MLflow's layout ([mlflow] mlflow_tracking_username/_password or _token); None:
    # MLflow's variables, or its own ~/.mlflow/credentials (harness/recording/credentials.py)
    credentials_file: str | None = None
    server_cert: str | None = None  # PEM of the private CA of an https server; None: $MLFLOW_TRACKING_SERVER_CERT_PATH

    def __post_init__(self) -> None:
        _require(bool(self.experiment), "tracking.experiment", "must not be empty")
        _require(self.connect_timeout_s > 0, "tracking.connect_timeout_s", "must be > 0")
        _require(not (self.uri and uri_has_credentials(self.uri)), "tracking.uri",
                 f"{redacted_uri(self.uri or '')} carries credentials; {CREDENTIALS_ADVICE}")


@dataclass
class MLLogConfig:
    """Fields of the MLPerf log that describe the submitter, not the run."""

    org: str = "cobench"
    division: str = "open"
    status: str = "research"

    def __post_init__(self) -> None:
        _require_choice(self.division, "mllog.division", DIVISIONS)
        _require_choice(self.status, "mllog.status", STATUSES)
        _require(bool(self.org), "mllog.org", "must not be empty")


@dataclass
class SuiteBenchmark:
    """One entry of a suite: a named benchmark = a workload plus overrides."""

    name: str = MISSING
    workload: str = MISSING
    overrides: list[str] = field(default_factory=list)
    # A generated trace benchmark: the suite captures this source (Hydra overrides, e.g.
    # [workload=llama]) and judges the replay of its spec side by side with it, in one process
    # (harness/traces/judge.py): at least `rounds` interleaved rounds of `round_steps` samples of each, more
    # until the interval is within ±2.5 % or `budget_s` seconds are spent. The entry's workload must
    # be one that replays bundles (workload: generated).
    capture: list[str] | None = None
    rounds: int = 10
    round_steps: int = 10
    budget_s: float = 60.0


@dataclass
class SuiteConfig:
    name: str = MISSING
    version: int = 1
    description: str = ""
    benchmarks: list[SuiteBenchmark] = field(default_factory=list)
    # Optional: a benchmark the others are compared with; each metric in delta_metrics gets a
    # "<metric>_delta" (other − baseline) on every other benchmark's run.
    baseline: str | None = None
    delta_metrics: list[str] = field(default_factory=list)
    summary_metrics: list[str] = field(default_factory=list)  # extra columns in the summary table
    only: list[str] = field(default_factory=list)  # run just these benchmarks of the suite (empty: all)

    def __post_init__(self) -> None:
        _require(bool(self.benchmarks), "suite.benchmarks", "a suite needs at least one benchmark")
        names = [b.name for b in self.benchmarks]
        _require(len(set(names)) == len(names), "suite.benchmarks", f"duplicate names in {names}")
        for name in self.only:
            _require_choice(name, "suite.only", tuple(names))
        replays = [name for name, spec in discover().items() if spec.replays_bundle]
        for bench in self.benchmarks:
            _require(bench.capture is None or bench.workload in replays, f"suite.benchmarks.{bench.name}",
                     f"capture: needs a workload that replays bundles, {replays} (got {bench.workload!r})")
            _require(bench.rounds >= 2 and bench.round_steps >= 1, f"suite.benchmarks.{bench.name}",
                     f"rounds must be >= 2 and round_steps >= 1 (got {bench.rounds}, {bench.round_steps})")
            _require(bench.budget_s > 0, f"suite.benchmarks.{bench.name}",
                     f"budget_s must be > 0 seconds (got {bench.budget_s})")
        if self.baseline is not None:
            _require_choice(self.baseline, "suite.baseline", tuple(names))
        _require(not self.delta_metrics or self.baseline is not None, "suite.delta_metrics", "needs suite.baseline")


FT_MODES = ("none", "torchft")


@dataclass
class FTConfig:
    """Fault tolerance (config group ``ft``): the failure scenario of harness/distribution/ft/, or none."""

    name: str = "none"  # none: a plain run | torchft: R replica groups under torchft, one killed and restarted
    replicas: int = 2  # replica groups (at least 2: one must survive)
    procs_per_replica: int = 1  # ranks in each group; > 1: FSDP2 inside a group (shards healed rank by rank)
    max_processes: int = 0  # processes this machine may run at once; 0: its CPU count
    kill_at_step: int = 20  # SIGKILL one replica group once it has committed this step
    kill_replica: int = 1  # which group
    restart_delay_s: float = 2.0  # from the kill to the group's restart
    lighthouse_port: int = 0  # 0: a free port, the one the lighthouse binds when it starts
    heartbeat_timeout_ms: int = 1000  # the lighthouse declares a silent replica dead after this
    quorum_tick_ms: int = 100
    join_timeout_ms: int = 1000  # how long a quorum waits for stragglers
    checkpoint_interval: int = 8  # the baseline without torchft: a checkpoint every N steps
    baseline: bool = True  # also run the same failure without torchft (whole-job restart from checkpoint)
    timeout_s: float = 900.0  # the whole scenario; replicas still running then are killed

    def __post_init__(self) -> None:
        _require_choice(self.name, "ft.name", FT_MODES)
        _require(self.replicas >= 2, "ft.replicas", f"got {self.replicas}, must be >= 2 (one replica must survive)")
        _require(self.procs_per_replica >= 1, "ft.procs_per_replica", f"got {self.procs_per_replica}, must be >= 1")
        _require(0 <= self.kill_replica < self.replicas, "ft.kill_replica",
                 f"got {self.kill_replica}, must be a replica group in [0, {self.replicas - 1}]")
        _require(self.kill_at_step >= 1, "ft.kill_at_step", f"got {self.kill_at_step}, must be >= 1")
        _require(self.restart_delay_s >= 0, "ft.restart_delay_s", f"got {self.restart_delay_s}, must be >= 0")
        _require(0 <= self.lighthouse_port <= 65535, "ft.lighthouse_port",
                 f"got {self.lighthouse_port}, must be a port or 0 (a free one)")
        _require(self.checkpoint_interval >= 1, "ft.checkpoint_interval",
                 f"got {self.checkpoint_interval}, must be >= 1")
        for key in ("heartbeat_timeout_ms", "quorum_tick_ms", "join_timeout_ms", "timeout_s", "max_processes"):
            _require(getattr(self, key) >= 0, f"ft.{key}", f"got {getattr(self, key)}, must be >= 0")


@dataclass
class CobenchConfig:
    """The whole composed configuration of one run."""

    results_dir: str = "results"
    seed: int = 1234
    deterministic: bool = False  # torch.use_deterministic_algorithms; slower, bit-repeatable
    run_name: str | None = None
    platform: PlatformConfig = field(default_factory=PlatformConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    mllog: MLLogConfig = field(default_factory=MLLogConfig)
    workload: Any = MISSING
    suite: SuiteConfig | None = None
    ft: FTConfig = field(default_factory=FTConfig)

    def __post_init__(self) -> None:
        _require(bool(self.results_dir), "results_dir", "must not be empty")
        _require(self.seed >= 0, "seed", f"got {self.seed}, must be >= 0")


def register_configs() -> None:
    """Put the schemas in Hydra's ConfigStore; workload schemas come from the registry.

    Workload schemas live in group ``schema/workload`` (not ``workload``) so that the user's
    choices for ``workload=`` are exactly the files in ``conf/workload/``. Each is imported from its
    light module alone (``WorkloadSpec.config``): no workload's code, nor its libraries, is imported here.
    """
    store = ConfigStore.instance()
    store.store(name="cobench_schema", node=CobenchConfig)
    for name, spec in discover().items():
        try:
            node = spec.config_class
        except (ImportError, OSError) as err:  # its libraries are not here (TorchRec on a bare GPU image): the
            UNAVAILABLE[name] = f"{type(err).__name__}: {err}"  # other workloads still compose and run
            continue
        store.store(group="schema/workload", name=name, node=node)


# workload → why its module does not import on this machine (a library it needs is missing or broken)
UNAVAILABLE: dict[str, str] = {}


def _unavailable(name: str) -> str:
    return (f"workload {name} cannot run on this machine: {UNAVAILABLE[name]} "
            f"(`cobench doctor` lists what each workload needs)")


def require_workload_code(name: str) -> None:
    """Import workload ``name``'s own module (its model code and libraries); ValueError naming the import that
    failed when they are missing here, so a config that cannot run is refused before anything ran."""
    try:
        discover()[name].factory  # noqa: B018 - imports the module that binds the factory
    except (ImportError, OSError) as err:
        UNAVAILABLE[name] = f"{type(err).__name__}: {err}"
        raise ValueError(_unavailable(name)) from None


def compose_config(overrides: list[str]) -> DictConfig:
    """Compose ``conf/config.yaml`` with ``overrides``; errors are explained (ValueError)."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.initialize import get_gh_backup, restore_gh_from_backup

    register_configs()
    # inside a Hydra job (a suite's job on a cluster node plans its benchmark): compose beside it
    running = GlobalHydra.instance().is_initialized()
    backup = get_gh_backup() if running else None
    if running:
        GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return compose(config_name="config", overrides=overrides)
    except HydraException as err:
        missing = [name for name in UNAVAILABLE if f"schema/workload/{name}" in str(err)]
        if missing:
            raise ValueError(_unavailable(missing[0])) from err
        raise ValueError(explain_composition_error(err)) from err
    finally:
        if running:
            restore_gh_from_backup(backup)


def explain_composition_error(err: HydraException) -> str:
    """Hydra's message, plus what the user can write instead (valid keys or group options)."""
    if isinstance(err, MissingConfigException):
        # "In 'config': Could not find 'workload/x'\n\nAvailable options in 'workload':\n\tllama..."
        head, _, rest = str(err).split("Config search path:")[0].partition("Available options")
        options = [line.strip() for line in rest.splitlines()[1:] if line.strip()]
        missing = head.strip().removeprefix("In 'config': ")
        return f"{missing}; available: {', '.join(options)}" if options else missing
    cause = err.__cause__
    full_key = getattr(cause, "full_key", None)
    if not full_key:
        return str(err).splitlines()[0]
    if isinstance(cause, ConfigAttributeError | ConfigKeyError):
        object_type = getattr(cause, "object_type", None)
        fields = dataclasses.fields(object_type) if dataclasses.is_dataclass(object_type) else ()
        allowed = ", ".join(f.name for f in fields)
        return f"invalid config '{full_key}': unknown key. Keys allowed here: {allowed}"
    return f"invalid config '{full_key}': {str(cause).splitlines()[0]}"


def to_run_config(cfg: DictConfig) -> CobenchConfig:
    """Validate values and return typed objects; raises ValueError naming the bad key."""
    if OmegaConf.is_missing(cfg, "workload"):
        raise ValueError(f"no workload selected: pass workload=<name>, one of {sorted(discover())}")
    if OmegaConf.select(cfg, "workload.name") in discover():  # its checks may import its code
        require_workload_code(cfg.workload.name)
    run_cfg: CobenchConfig = OmegaConf.to_object(cfg)  # runs every __post_init__
    if not dataclasses.is_dataclass(run_cfg.workload):  # a plain mapping: no workload schema was selected
        raise ValueError("invalid config 'workload': it has no schema; pick one with workload=<name>")
    check_results_dir(run_cfg.results_dir)
    return run_cfg


def check_results_dir(results_dir: str) -> None:
    """A results folder this process can create and write, checked without creating anything."""
    path = Path(results_dir).expanduser().resolve()
    fix = "pass results_dir=DIR, a folder you can write"
    if path.exists() and not path.is_dir():
        raise ValueError(f"invalid config 'results_dir': {path} is a file, not a folder; {fix}")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"invalid config 'results_dir': {existing} (on the way to {path}) is a file; {fix}")
    so = "" if existing == path else f" (so {path} cannot be made)"
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"invalid config 'results_dir': {existing} is not writable{so}; {fix}")
    # os.access answers yes to root everywhere, and to anyone on a read-only or pseudo file system (/proc,
    # /sys): making (and removing) a scratch folder there is the one test that says what mkdir will do
    try:
        shutil.rmtree(tempfile.mkdtemp(prefix=".cobench-check-", dir=existing))
    except OSError as err:
        raise ValueError(f"invalid config 'results_dir': cannot make a folder in {existing}{so} "
                         f"({err.strerror or err}); {fix}") from None


def results_root(cfg: CobenchConfig) -> Path:
    return Path(cfg.results_dir).expanduser().resolve()


def run_hydra_app(task: Callable[[DictConfig], None], prog: str, argv: list[str]) -> None:
    """Run ``task`` as the Hydra app over ``conf/`` with ``argv`` as its command line (``prog`` names it
    in Hydra's help): Hydra reads ``sys.argv``, which is put back afterwards. Multirun, launchers,
    ``--cfg`` and ``--help`` are Hydra's own."""
    import hydra

    register_configs()
    app = hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")(task)
    saved_argv = sys.argv
    sys.argv = [prog, *argv]
    try:
        app()
    finally:
        sys.argv = saved_argv
