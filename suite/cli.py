"""The ``cobench`` command: one dispatcher, one way to fail.

Every subcommand is a function ``run(argv) -> exit code`` in its own module, imported only when
it is called (``cobench --help`` and ``cobench list`` import no workload). Errors take one path
here, whatever the command: bad input (a config or argument error, an unreachable store, a
refused trace) prints ``cobench <command>: error: ...`` and exits 2 before anything ran; an
interruption (Ctrl-C, or a scheduler's SIGTERM) exits 130 after the command closed its MLflow
runs as KILLED; a run that failed exits 1 (its reason is in its MLflow run).

Settings every command shares are written the same way everywhere, as ``key=value``
(``results_dir=DIR``, ``tracking.uri=URI``, ``tracking.experiment=NAME``); commands that also take
flags keep them (``--results-dir DIR`` is the same as ``results_dir=DIR`` for ``compare``).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable

from harness.cli import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, CommandFailed
from harness.running.interrupts import deferred_interrupts, signal_name, sigterm_as_interrupt

USAGE = """usage: cobench COMMAND [ARGS]

commands:
  run   [OVERRIDES] [-m]   run one benchmark, e.g. `cobench run workload=llama runner.steps=50`;
                           -m sweeps: `cobench run -m workload.batch_size=2,4`
  suite NAME [OVERRIDES]   run a suite (conf/suite/NAME.yaml) under one MLflow parent run,
                           e.g. `cobench suite smoke results_dir=/tmp/res`
  list                     the workloads, suites and platforms this checkout knows
  trace capture|generate|fidelity|export ...
                           generated trace benchmarks: `cobench trace --help`
  qualify [OVERRIDES]      run the qualification suite and check the platform's gates:
                           `cobench qualify --help`
  compare [OPTIONS]        platform x benchmark table from MLflow: `cobench compare --help`
  report [OPTIONS]         MLPerf-style submission folder + HTML report: `cobench report --help`
  data prepare NAME [OPTIONS]
                           turn a dataset as distributed (C4 JSON, Criteo TSV) into the layout a
                           workload reads, once: `cobench data prepare --help`
  upload RUN_DIR... [tracking.uri=URI tracking.credentials_file=F tracking.server_cert=CA]
                           record run folders whose MLflow store was away when they ended
                           (they hold upload_pending.json) in their MLflow runs
  ft-scale [OPTIONS]       effective training time vs cluster size, synchronous vs replica-level
                           recovery (a model; runs nothing): `cobench ft-scale --help`
  calibrate [--force] [OVERRIDES]
                           this platform's measured peak FLOP/s behind MFU, with
                           when and under what load it was measured; --force measures again
  plan [--json] [OVERRIDES] which parallel layouts of a workload fit a machine (computed, nothing runs):
                           `cobench plan workload=llama workload.preset=llama3_405b platform.devices=512
                           platform.device_memory_gb=80`
  doctor [--json] [--measure]
                           what this machine is to cobench: host, device, versions, peaks, and
                           which workloads and options run here (and why not)
  reap [SETTINGS]          close as FAILED the MLflow runs left RUNNING by processes of this host that
                           are gone (every command does it when it connects), and list the RUNNING
                           runs of other hosts, with their host and pid

Shared settings, the same in every command: results_dir=DIR, tracking.uri=URI,
tracking.experiment=NAME (`cobench compare results_dir=/data/res`).
`cobench run --help` shows the composed config and every override group.
Exit codes: 0 done, 1 a run failed, 2 bad input (nothing ran), 130 interrupted.
"""

# command → (module, function): imported only when the command runs
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("harness.cli", "run_main"),
    "suite": ("suite.launch", "suite_main"),
    "list": ("suite.cli", "list_main"),
    "trace": ("suite.trace_cli", "run"),
    "qualify": ("suite.qualify", "run"),
    "compare": ("suite.compare", "run"),
    "report": ("suite.report", "run"),
    "reap": ("suite.cli", "reap_main"),
    "upload": ("suite.cli", "upload_main"),
    "ft-scale": ("suite.ft_scale", "run"),
    "data": ("suite.data_cli", "run"),
    "calibrate": ("suite.cli", "calibrate_main"),
    "doctor": ("suite.doctor", "run"),
    "plan": ("suite.plan", "run"),
}

# key=value settings shared by every command → the flag of the commands that parse flags
SHARED_SETTINGS = {"results_dir": "--results-dir", "tracking.uri": "--tracking-uri",
                   "tracking.experiment": "--experiment"}
FLAG_COMMANDS = ("compare", "report")  # argparse-only commands: shared settings become their flags


def shared_settings_as_flags(command: str, args: list[str]) -> list[str]:
    """``results_dir=DIR`` → ``--results-dir DIR`` for commands that take flags only.

    Raises ValueError for any other ``key=value`` there, naming the ones it takes.
    """
    out = []
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep or arg.startswith("-"):
            out.append(arg)
        elif key in SHARED_SETTINGS:
            out += [SHARED_SETTINGS[key], value]
        else:
            raise ValueError(f"{arg!r}: `cobench {command}` takes the shared settings "
                             f"{', '.join(k + '=' for k in SHARED_SETTINGS)} as key=value, and its own options "
                             f"as flags (`cobench {command} --help`)")
    return out


UPLOAD_SETTINGS = ("tracking.uri", "tracking.credentials_file", "tracking.server_cert")


def upload_main(args: list[str]) -> int:
    """``cobench upload RUN_DIR [RUN_DIR ...] [tracking.uri=URI]``: exit 0 when every folder is recorded.
    Uploading a folder again, or twice at once, records it once: in the same MLflow run, with the same rows."""
    import fcntl
    import json
    from pathlib import Path

    from harness.config import TrackingConfig
    from harness.recording.credentials import apply_tracking_credentials
    from harness.recording.tracking import Tracker, check_server_reachable
    from harness.running.runner import UPLOAD_PENDING, publish, results_root_of

    settings = dict(a.split("=", 1) for a in args if "=" in a)
    unknown = sorted(set(settings) - set(UPLOAD_SETTINGS))
    if unknown:
        raise ValueError(f"`cobench upload` takes {', '.join(k + '=' for k in UPLOAD_SETTINGS)}, got {unknown}")
    tracking = TrackingConfig(**{key.removeprefix("tracking."): value for key, value in settings.items()})
    uri = tracking.uri
    folders = [Path(a) for a in args if "=" not in a]
    if not folders:
        raise ValueError("`cobench upload` needs run folders, e.g. `cobench upload results/runs/<run>`")
    failed = []
    for folder in folders:
        record_path = folder / "metrics.json"
        if not record_path.is_file():
            raise ValueError(f"{folder} is not a run folder (no metrics.json)")
        mlflow = json.loads(record_path.read_text()).get("mlflow")
        if not mlflow:
            raise ValueError(f"{folder}: this run was made without MLflow tracking; there is nothing to upload")
        # one upload of a folder at a time (two shells, a retry loop): the second waits, then finds it recorded
        with open(record_path) as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (folder / UPLOAD_PENDING).exists():
                print(f"{folder}: already recorded in MLflow run {mlflow['run_id']}")
                continue
            target = uri or mlflow["uri"]
            apply_tracking_credentials(tracking, target)
            check_server_reachable(target, 10.0)
            tracker = Tracker(target, mlflow["experiment_id"], results_root_of(folder))
            try:
                publish(tracker, folder)
            except Exception as err:  # noqa: BLE001 - say which folder, keep going with the others
                failed.append(folder)
                print(f"{folder}: still not recorded ({tracker.failure(err)})", file=sys.stderr)
                continue
        print(f"{folder}: recorded in MLflow run {mlflow['run_id']} at {target}")
    if failed:
        raise CommandFailed(f"{len(failed)} run folder(s) not recorded; they keep upload_pending.json")
    return EXIT_OK


def reap_main(args: list[str]) -> int:
    """``cobench reap [results_dir=DIR] [tracking.uri=URI] [tracking.experiment=NAME]``."""
    from harness.config import compose_config, results_root, to_run_config
    from harness.recording.tracking import HOST_TAG, PID_TAG, Tracker

    unknown = [a for a in args if a.partition("=")[0] not in SHARED_SETTINGS]
    if unknown:
        raise ValueError(f"`cobench reap` takes {', '.join(k + '=' for k in SHARED_SETTINGS)} only, got {unknown}")
    cfg = to_run_config(compose_config(list(args)))
    tracker = Tracker.connect(cfg.tracking, results_root(cfg), reap=False)
    closed = tracker.reap_stale()
    for run_id, name, reason in closed:
        print(f"closed {name} ({run_id}) as FAILED: {reason}")
    elsewhere = tracker.client.search_runs([tracker.experiment_id], filter_string="attributes.status = 'RUNNING'",
                                           max_results=1000)
    for run in elsewhere:
        tags = run.data.tags
        print(f"still RUNNING: {run.info.run_name} ({run.info.run_id}) on {tags.get(HOST_TAG, '?')}, "
              f"pid {tags.get(PID_TAG, '?')}: its process is alive, or on another host (run `cobench reap` there)")
    if not closed and not elsewhere:
        print(f"no RUNNING MLflow run in {tracker.uri} (experiment {cfg.tracking.experiment})")
    return EXIT_OK


def list_main(args: list[str]) -> int:
    """``cobench list``: what this checkout knows, without importing any workload's code."""
    from harness.config import CONF_DIR
    from workloads import discover

    if args:
        raise ValueError(f"`cobench list` takes no arguments, got {' '.join(args)}")
    print("workloads:")
    for name, spec in sorted(discover().items()):
        print(f"  {name:12s} {spec.description}")
    from workloads.base import PREPARERS

    print("data preparers (cobench data prepare NAME):")
    for name, spec in sorted(PREPARERS.items()):
        print(f"  {name:12s} {spec.description}")
    for group in ("suite", "platform", "tracking"):
        names = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
        print(f"{group}s: {', '.join(names)}")
    return EXIT_OK


def calibrate_main(args: list[str]) -> int:
    """``cobench calibrate [--force] [platform overrides]``: the measured peaks MFU is taken against."""
    import torch

    from harness.config import compose_config, to_run_config
    from harness.platform import calibrated_gemm_entry, discover_platform

    if any(a in ("-h", "--help") for a in args):
        print("usage: cobench calibrate [--force] [platform=NAME platform.num_threads=N ...]\n\n"
              "Measures (or reads from platform.calibration_cache) this platform's GEMM peak per dtype, the peak\n"
              "MFU is measured against where the platform declares none; a cached figure taken on a busy machine,\n"
              "without its conditions, or slower than fewer threads measured is measured again. --force: always.")
        return EXIT_OK
    force = "--force" in args
    cfg = to_run_config(compose_config([a for a in args if a != "--force"]))
    platform = discover_platform(cfg.platform)
    if platform.is_accelerator or cfg.platform.peak_flops:
        print(f"{platform.name}: peaks come from " + ("platform.peak_flops" if cfg.platform.peak_flops
                                                     else "the table of known parts, or are measured at run time"))
    print(f"{platform.device_name} ({platform.name}), {torch.get_num_threads()} threads:")
    # the dtypes runs measure MFU in here: float32 on a CPU (the workloads' auto dtype), bfloat16 too on accelerators
    for dtype in (torch.float32, torch.bfloat16) if platform.is_accelerator else (torch.float32,):
        entry = calibrated_gemm_entry(platform, dtype, force=force)
        doubt = f"  DOUBTFUL: {entry['doubt']}" if entry.get("doubt") else ""
        print(f"  {str(dtype).removeprefix('torch.'):9s} {entry['flops'] / 1e9:9.1f} GFLOP/s  measured "
              f"{entry['measured_at']} at load {entry['loadavg']:.2f} on {entry['cores']} cores{doubt}")
    print(f"cache: {cfg.platform.calibration_cache}")
    return EXIT_OK


def guarded(command: str, fn: Callable[[list[str]], int], args: list[str]) -> int:
    """Run a command's function with the one error path every command shares (see the module doc)."""
    from harness.recording.tracking import TrackingError, close_open_runs, closed_runs

    sigterm_as_interrupt()
    already_closed = len(closed_runs())
    try:
        if command in FLAG_COMMANDS:
            args = shared_settings_as_flags(command, args)
        return _leave_process_group(fn(args))
    except SystemExit as exit_:  # argparse: --help (0) or a usage error (2); the run path's own exits
        if exit_.code is None:
            return EXIT_OK
        return exit_.code if isinstance(exit_.code, int) else EXIT_BAD_INPUT
    except (ValueError, TrackingError) as err:  # config, gates, trace and store errors: nothing ran
        close_open_runs("FAILED", f"{type(err).__name__}: {err}")
        print(f"cobench {command}: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except CommandFailed as err:
        print(f"cobench {command}: failed: {err}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt as err:
        with deferred_interrupts():  # a second Ctrl-C while closing must not leave a run half-closed
            close_open_runs("KILLED", f"interrupted by {signal_name(err)}")
        print(f"cobench {command}: interrupted by {signal_name(err)}; {_runs_said(already_closed)}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BaseException as err:
        close_open_runs("FAILED", f"{type(err).__name__}: {err}")  # a crash leaves no run RUNNING
        raise


def _leave_process_group(code: int) -> int:
    """Destroy the process group once a command is done, while the interpreter is whole: left to the
    interpreter's exit, gloo's worker threads can still hold tensors whose release then needs the GIL
    of an interpreter being torn down — a rank that finished everything aborted (SIGABRT, "terminate
    called without an active exception") and torchrun failed the job (pytorch/pytorch#179291). A rank
    under torchrun ends here, past that teardown (:func:`harness.distributed.exit_rank`): even with its group
    destroyed first, a rank could abort in it."""
    if "torch.distributed" in sys.modules:
        import torch.distributed as dist

        from harness.distributed import exit_rank, shutdown_distributed

        if dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            exit_rank(code)
        shutdown_distributed()
    return code


def _runs_said(since: int) -> str:
    """What happened to the MLflow runs this command started, for the interrupt message."""
    from harness.recording.tracking import closed_runs

    runs = closed_runs(since)
    if not runs:
        return "no MLflow run had been started"
    return "MLflow runs: " + ", ".join(f"{name} {status}" + (f" ({reason})" if status == "FAILED" and reason else "")
                                       for name, status, reason in runs)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # the profiler's start/stop lines; set it to see them
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return EXIT_OK
    command, rest = args[0], args[1:]
    if command not in COMMANDS:
        print(f"cobench: error: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        return EXIT_BAD_INPUT
    module, function = COMMANDS[command]
    return guarded(command, getattr(importlib.import_module(module), function), rest)


if __name__ == "__main__":
    raise SystemExit(main())
