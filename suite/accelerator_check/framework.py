"""The accelerator check's framework: a step, what every step is given (:class:`Check`: where to write,
the time left, how to run a child process) and the verdict it returns (:class:`Outcome`)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PASS, FAIL, SKIPPED = "PASS", "FAIL", "SKIPPED"
# a step's child process limit, where it is not the 240 s default
STEP_LIMITS = {"llama_medium_compile": 300.0, "moe_medium": 200.0, "llama_tiny_compile": 240.0}


@dataclass
class Outcome:
    """One step's verdict: PASS, FAIL or SKIPPED, why, and what it measured."""

    step: str
    status: str
    reason: str = ""
    figures: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    command: str = ""


@dataclass
class Check:
    """What every step needs: where to write, which platform, how much time is left."""

    out: Path
    dry_run: bool
    deadline: float
    portable_spec: Path | None
    env: dict[str, str]
    device_type: str = "cpu"

    @property
    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    def platform_overrides(self) -> list[str]:
        return ["platform=cpu"] if self.dry_run else []

    def child(self, step: str, argv: list[str], limit_s: float) -> tuple[int | None, str]:
        """Run ``python argv`` from the checkout, its output in ``logs/<step>.log``; (exit code or None on
        time-out, the log's last lines)."""
        log = self.out / "logs" / f"{step}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        timeout = max(1.0, min(limit_s, self.left_s))
        with log.open("w") as sink:
            try:
                proc = subprocess.run([sys.executable, *argv], cwd=ROOT, env=self.env, stdout=sink,
                                      stderr=subprocess.STDOUT, timeout=timeout, check=False)
                code: int | None = proc.returncode
            except subprocess.TimeoutExpired:
                code = None
        tail = log.read_text(errors="replace").strip().splitlines()[-12:]
        return code, "\n".join(tail)


@dataclass
class Step:
    """A named step: what it needs (about how long it takes, whether only an accelerator runs it)."""

    name: str
    what: str
    run: Callable[[Check], Outcome]
    needs_s: float  # about how long it takes on a device; a step that does not fit the time left is skipped
    accelerator_only: bool = False
    skip_if: Callable[[Check], str | None] | None = None  # why it cannot run here, or None


def child_env() -> dict[str, str]:
    """The steps' environment: this checkout importable (it need not be installed), output unbuffered."""
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}
