"""Find the ops that crash the process, in a throw-away child process, before the real replay.

Some kernels (fbgemm's among them) trust their inputs; fed values they were never meant to see they
can crash the process (SIGSEGV) instead of raising. A crash would take the run with it: no error,
no MLflow status. So a single-process replay first dry-runs the spec in a child process that writes
the index of each op before running it; if the child dies of a signal, the last index names the op,
which is then excluded (recorded with the reason) and the child tries again.

    python -m workloads.trace_replay.probe SPEC RANK TRUST PROGRESS_FILE [EXCLUDED_INDEX ...]

It is started only for a spec the workload has already checked (``safety.check_spec``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

MAX_CRASHES = 8


def find_crashing_ops(spec_path: str, rank: int, timeout_s: float = 600.0, *, trust: bool = False) -> dict[int, str]:
    """Op index → why it is excluded, for every op that crashed a probe process."""
    crashed: dict[int, str] = {}
    with tempfile.TemporaryDirectory(prefix="cobench-probe-") as tmp:
        progress = Path(tmp) / "progress"
        for _ in range(MAX_CRASHES):
            progress.write_text("")
            cmd = [sys.executable, "-m", __name__, spec_path, str(rank), str(int(trust)), str(progress),
                   *map(str, crashed)]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                                  env=os.environ | {"CUDA_LAUNCH_BLOCKING": "1"})
            if proc.returncode >= 0:
                if proc.returncode != 0:
                    raise RuntimeError(f"the replay probe of {spec_path} failed: {proc.stderr.strip()[-2000:]}")
                return crashed
            last = progress.read_text().split()
            if not last:
                raise RuntimeError(f"the replay probe of {spec_path} died of signal {-proc.returncode} "
                                   f"before running any op")
            name = signal.Signals(-proc.returncode).name
            crashed[int(last[-1])] = f"crashed the replay process ({name}) in a probe run: skipped"
    raise RuntimeError(f"more than {MAX_CRASHES} ops of {spec_path} crash the replay process")


def _main(argv: list[str]) -> int:
    import torch

    from workloads.trace_replay.records import SpecRecord
    from workloads.trace_replay.replay import Replayer
    from workloads.trace_replay.spec import load_spec

    spec_path, rank, trust, progress_path, *excluded = argv
    spec = SpecRecord.from_json(load_spec(spec_path))  # the parent checked this file before probing
    replayer = Replayer(spec.ranks[int(rank)], torch.device("cpu"), repeat=spec.repeat, trust=trust == "1")
    replayer.exclude({int(i): "excluded" for i in excluded})
    replayer.materialize()
    with open(progress_path, "w", buffering=1) as progress:
        replayer.dry_run(before_op=lambda index: (progress.write(f"{index}\n"), progress.flush()))
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
