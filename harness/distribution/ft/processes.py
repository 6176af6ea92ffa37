"""The operating-system side of the failure scenario: torchft's lighthouse program, free ports, and
killing a replica group's whole process tree."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
from pathlib import Path

import psutil


def lighthouse_binary() -> str | None:
    """torchft's lighthouse program: beside this Python (a virtual environment's bin/), else on PATH."""
    beside = Path(sys.executable).parent / "torchft_lighthouse"
    return str(beside) if beside.exists() else shutil.which("torchft_lighthouse")


def port_is_free(port: int) -> bool:
    """Whether a server could bind ``port`` on every interface now."""
    with socket.socket(socket.AF_INET6 if socket.has_ipv6 else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a server binds: TIME_WAIT is no user
        try:
            sock.bind(("::" if socket.has_ipv6 else "", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port on localhost that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
