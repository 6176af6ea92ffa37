"""The operating-system side of the failure scenario: torchft's lighthouse program and its port, and
killing a replica group's whole process tree."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

if TYPE_CHECKING:
    from harness.config import FTConfig

LIGHTHOUSE_START_S = 60.0  # from its start to its "listening on" line
_LISTENING = re.compile(r"Lighthouse listening on: \S+:(\d+)")


def lighthouse_binary() -> str | None:
    """torchft's lighthouse program: beside this Python (a virtual environment's bin/), else on PATH."""
    beside = Path(sys.executable).parent / "torchft_lighthouse"
    return str(beside) if beside.exists() else shutil.which("torchft_lighthouse")


def start_lighthouse(ft: FTConfig, log: Path, wait_s: float = LIGHTHOUSE_START_S) -> tuple[subprocess.Popen, int]:
    """torchft's lighthouse on ``ft.lighthouse_port`` (0: a free port it binds itself), writing to ``log``, once
    it listens: the process and its port. A lighthouse that ends or stays silent first is stopped and raised
    with what its log says (a port taken between the checks and its start reads "Address already in use")."""
    proc = subprocess.Popen(
        [lighthouse_binary(), "--min_replicas", "1", "--bind", f"[::]:{ft.lighthouse_port}",
         "--quorum_tick_ms", str(ft.quorum_tick_ms), "--join_timeout_ms", str(ft.join_timeout_ms),
         "--heartbeat_timeout_ms", str(ft.heartbeat_timeout_ms)],
        stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        listening = _LISTENING.search(log.read_text(errors="replace"))
        if listening:
            return proc, int(listening.group(1))
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    said = log.read_text(errors="replace").strip().splitlines()
    why = said[-1] if said else "it printed nothing"
    hint = ("; pass a free ft.lighthouse_port, or 0 for one it picks" if "Address already in use" in why else "")
    raise RuntimeError(f"torchft's lighthouse did not start on port {ft.lighthouse_port or '(any free one)'} "
                       f"(exit {proc.returncode} within {wait_s:.0f} s): {why}{hint}; see {log}")


def port_is_free(port: int) -> bool:
    """Whether a server could bind ``port`` on every interface now."""
    with socket.socket(socket.AF_INET6 if socket.has_ipv6 else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a server binds: TIME_WAIT is no user
        try:
            sock.bind(("::" if socket.has_ipv6 else "", port))
        except OSError:
            return False
    return True


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants (torchrun puts its ranks in sessions of their own, so a
    process group kill would leave them running); the caller, if among them, dies last."""
    try:
        root = psutil.Process(pid)
        victims = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    me = os.getpid()
    for victim in sorted(victims, key=lambda p: p.pid == me):
        try:
            victim.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
