"""One host of a fleet, for the concurrency test: ``python tests/fleet_writer.py RESULTS_DIR RUNS [OVERRIDES]``.

Opens the tracking store as ``cobench run`` does (:meth:`Tracker.connect`, credentials from MLflow's
variables), then records RUNS runs at once, one thread each, through the path every run takes
(:func:`harness.running.runner.open_run`, then :func:`harness.running.runner.write_and_publish`: folder, params, tags,
metrics, loss curve, end status, artifacts). What a run measured is made up (``RUN_METRICS`` metrics and a
``RUN_STEPS``-step loss curve): what is tested is the writing, and a model would only add CPU time.
Prints one JSON line per run: its name, run id, and whether the store took it.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import sys
import threading
from pathlib import Path

RUN_METRICS = 8
RUN_STEPS = 20


def main(results: Path, runs: int, overrides: list[str]) -> None:
    from harness.config import compose_config, to_run_config
    from harness.platform import discover_platform
    from harness.recording.tracking import Tracker
    from harness.running.runner import STATUS_FINISHED, BenchmarkResult, new_run_dir, open_run, write_and_publish

    cfg = to_run_config(compose_config([*overrides, f"results_dir={results}"]))
    tracker = Tracker.connect(cfg.tracking, results)
    platform = discover_platform(cfg.platform)
    host = socket.gethostname()
    outcomes: list[dict] = []

    def record(i: int) -> None:
        name = f"{cfg.run_name}-{i}"
        result = BenchmarkResult(name, cfg.workload.name, platform.name, STATUS_FINISHED, "tokens/s",
                                 Path(new_run_dir(results, name)))
        open_run(dataclasses.replace(cfg, run_name=name), result, platform, 1, tracker, tags={"fleet_host": host})
        metrics = {f"fleet_metric_{k}": float(i * 100 + k) for k in range(RUN_METRICS)}
        write_and_publish(result, tracker, {"status": STATUS_FINISHED, "error": None, "metrics": metrics,
                                            "losses": [1.0 / (step + 1) for step in range(RUN_STEPS)]})
        outcomes.append({"name": name, "run_id": result.run_id, "upload_error": result.upload_error})

    threads = [threading.Thread(target=record, args=(i,)) for i in range(runs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for outcome in outcomes:
        print(json.dumps(outcome))
    sys.exit(0 if len(outcomes) == runs and not any(o["upload_error"] for o in outcomes) else 1)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:])
