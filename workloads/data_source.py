"""What every real-data source shares: refusing a bad path clearly, sharding by rank, and reading ahead.

A workload's data source (``workload.data=c4|megatron|criteo_1tb|movielens``, the synthetic planted
sources being the default) lives with the workload; this module holds the few pieces they all need:

- :class:`DataError` and :func:`require_path`: a missing or unusable file is a bad configuration
  (exit 2 before any MLflow run exists), named with the key that set it, what was expected and where
  the data comes from; nothing is ever downloaded at run time.
- :func:`rank_shard`: a rank's disjoint share of a list of items (together the whole list).
- :class:`Prefetcher`: batches made on a background thread, ``depth`` ahead, so a step never waits on
  reading or tokenizing; each :meth:`Prefetcher.next` says how long the step waited for its batch (the
  harness reports it as ``data_wait_ms_p50``). An error on the thread (a file that went bad mid-run)
  is raised in the step that asked for the batch, with the reason.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Generic, TypeVar

T = TypeVar("T")


class DataError(ValueError):
    """A data file or folder that cannot be used; the message names the file and what to do.

    A ValueError: raised while the workload is built, the command exits 2 and no run exists."""


def require_path(key: str, path: str | os.PathLike | None, what: str, where_from: str) -> Path:
    """``path`` (the value of ``workload.<key>``) as an existing :class:`Path`, else a :class:`DataError`
    saying what was expected there (``what``) and where such data comes from (``where_from``)."""
    if path is None or str(path) == "":
        raise DataError(f"'workload.{key}' is not set: give {what}. Only local files are read (nothing is "
                        f"downloaded at run time); {where_from}")
    resolved = Path(path).expanduser()
    if not resolved.exists():
        raise DataError(f"'workload.{key}': {resolved} does not exist; expected {what}. Only local files are read "
                        f"(nothing is downloaded at run time); {where_from}")
    return resolved


def rank_shard(count: int, rank: int, world_size: int) -> range:
    """The indices of ``count`` items that rank ``rank`` of ``world_size`` reads: every ``world_size``-th
    from ``rank`` on. The ranks' shares are disjoint and together cover every item once."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size}")
    return range(rank, count, world_size)


def cache_dir() -> Path:
    """Where data sources keep what they worked out once about a file (e.g. a full check of its ids):
    ``$COBENCH_CACHE_DIR/data``, by default ``~/.cache/cobench/data``."""
    root = os.environ.get("COBENCH_CACHE_DIR") or Path.home() / ".cache" / "cobench"
    return Path(root) / "data"


_END = object()


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


class Prefetcher(Generic[T]):
    """Items of ``make()``'s iterator, produced ``depth`` ahead on a daemon thread.

    ``transfer`` (e.g. moving a batch to the device) runs on the caller's thread in :meth:`next`, so
    device work stays in the step's stream. The wait a step sees is the time :meth:`next` took,
    ``transfer`` included: what the step would not have spent had its batch been ready on the device.
    ``prepare`` runs on the producer thread, on each item as it is made: e.g. copying a batch into pinned
    host memory (``pin_memory``), so that ``transfer``'s ``non_blocking`` copy only queues an asynchronous
    copy instead of the step paying a synchronous one.
    """

    def __init__(self, make: Callable[[], Iterator[T]], depth: int = 4, name: str = "data",
                 transfer: Callable[[T], T] | None = None, prepare: Callable[[T], T] | None = None):
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth}")
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._transfer = transfer
        self._prepare = prepare
        self._done = False
        self._thread = threading.Thread(target=self._produce, args=(make,), name=f"cobench-{name}-prefetch",
                                        daemon=True)
        self._thread.start()

    def _produce(self, make: Callable[[], Iterator[T]]) -> None:
        try:
            for item in make():
                if self._prepare is not None:
                    item = self._prepare(item)
                if not self._put(item):
                    return
            self._put(_END)
        except BaseException as err:  # noqa: BLE001 - handed over: the step that asked for the batch fails with it
            self._put(_Failure(err))

    def _put(self, item: object) -> bool:
        """Queue ``item`` unless closed meanwhile; False when closed."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def next(self) -> tuple[T, float]:
        """The next item and the seconds this call waited for it. StopIteration once the iterator is
        exhausted; the producer's exception (with its own message) if it failed."""
        if self._done:
            raise StopIteration
        start = time.perf_counter()
        item = self._queue.get()
        if item is _END:
            self._done = True
            raise StopIteration
        if isinstance(item, _Failure):
            self._done = True
            raise item.error
        if self._transfer is not None:
            item = self._transfer(item)
        return item, time.perf_counter() - start

    def __iter__(self) -> Iterator[T]:
        while True:
            try:
                yield self.next()[0]
            except StopIteration:
                return

    def close(self) -> None:
        """Stop the producer thread (it finishes the item it is making)."""
        self._stop.set()
        while True:  # unblock a producer waiting on a full queue
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=5)

    def __enter__(self) -> Prefetcher[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["DataError", "Prefetcher", "cache_dir", "rank_shard", "require_path"]
