"""A rich progress bar for long work; silent when output is not a terminal (CI, pipes, logs)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


@contextmanager
def step_progress(description: str, total: int, enabled: bool = True) -> Iterator[Callable[[], None]]:
    """Yields ``advance()``, to call once per step."""
    console = Console(stderr=True)
    if not (enabled and console.is_terminal):
        yield lambda: None
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(description, total=total)
        yield lambda: progress.advance(task)
