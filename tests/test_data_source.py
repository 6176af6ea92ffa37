"""The pieces every real-data source shares: path errors, rank shards, the background prefetcher, the
``data_wait_ms_p50`` metric and the ``cobench data prepare`` command built from a preparer's options."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from harness.running.loop import RepetitionState
from harness.running.metrics import benchmark_metrics
from suite.cli import main
from suite.data_cli import options_parser
from workloads.data_source import DataError, Prefetcher, rank_shard, require_path


def test_a_missing_path_names_the_key_and_where_the_data_comes_from(tmp_path):
    with pytest.raises(DataError, match=r"'workload.data_path' is not set.*nothing is downloaded.*from the shop"):
        require_path("data_path", None, "a folder of day files", "get them from the shop")
    with pytest.raises(DataError, match=r"'workload.data_path': .*nope does not exist; expected a folder"):
        require_path("data_path", tmp_path / "nope", "a folder of day files", "get them from the shop")
    assert require_path("data_path", tmp_path, "a folder", "anywhere") == tmp_path


@pytest.mark.parametrize("count,world", [(10, 2), (7, 3), (2, 4), (0, 2)])
def test_rank_shards_are_disjoint_and_cover_every_item(count, world):
    shares = [set(rank_shard(count, rank, world)) for rank in range(world)]
    assert sum(len(s) for s in shares) == count
    assert set().union(*shares) == set(range(count))


def test_the_prefetcher_reads_ahead_so_a_step_waits_only_for_what_is_not_ready():
    def slow_batches():
        for i in range(6):
            time.sleep(0.05)
            yield i

    with Prefetcher(slow_batches, depth=8) as prefetch:
        time.sleep(0.5)  # the producer fills the queue while the "model" works
        got = [prefetch.next() for _ in range(6)]
        with pytest.raises(StopIteration):
            prefetch.next()
    assert [item for item, _ in got] == list(range(6))
    assert max(wait for _, wait in got) < 0.02  # everything was ready
    with Prefetcher(slow_batches, depth=1) as cold:
        item, wait = cold.next()
    assert item == 0 and wait >= 0.04  # nothing ready: the step waited for the read


def test_the_prefetchers_prepare_runs_on_the_producer_thread_and_transfer_on_the_callers():
    """Pinning a batch (prepare) is host work the step must not wait for; the copy (transfer) stays in the
    step's stream."""
    import threading

    seen = {}

    def prepare(item):
        seen.setdefault("prepare", set()).add(threading.current_thread().name)
        return item * 10

    def transfer(item):
        seen.setdefault("transfer", set()).add(threading.current_thread().name)
        return item + 1

    with Prefetcher(lambda: iter(range(3)), depth=2, name="t", transfer=transfer, prepare=prepare) as prefetch:
        assert [prefetch.next()[0] for _ in range(3)] == [1, 11, 21]
    assert seen == {"prepare": {"cobench-t-prefetch"}, "transfer": {threading.current_thread().name}}


def test_a_source_that_fails_mid_run_fails_the_step_that_asked_with_its_reason():
    def breaks():
        yield 1
        raise DataError("day_3_sparse.npy: unexpected end of file")

    prefetch = Prefetcher(breaks, depth=2)
    assert prefetch.next()[0] == 1
    with pytest.raises(DataError, match="day_3_sparse.npy: unexpected end of file"):
        prefetch.next()
    prefetch.close()


def test_closing_stops_a_producer_blocked_on_a_full_queue():
    def endless():
        i = 0
        while True:
            yield i
            i += 1

    prefetch = Prefetcher(endless, depth=2, name="endless")
    prefetch.next()
    prefetch.close()
    assert not any(t.name == "cobench-endless-prefetch" for t in threading.enumerate())


def test_data_wait_is_reported_as_the_slowest_ranks_median_when_every_rank_measured_it():
    def state(waits):
        return RepetitionState(0, step_times_s=[0.01] * len(waits), data_wait_s=waits, timed_samples=8,
                               global_batch_size=8)

    metrics = benchmark_metrics([[state([0.001, 0.002, 0.003]), state([0.004, 0.004, 0.009])]], "samples/s", None)
    assert metrics["data_wait_ms_p50"] == pytest.approx(4.0)
    assert "data_wait_ms_p50" not in benchmark_metrics([[state([])]], "samples/s", None)


@dataclass
class _Options:
    source: Path = field(metadata={"help": "the raw files"})
    out: str = field(metadata={"help": "output prefix"})
    workers: int = 2
    days: list[int] = field(default_factory=lambda: [0, 1])
    shuffle: bool = True


def test_a_preparers_options_dataclass_becomes_its_command_line():
    parser = options_parser("demo", _Options, "a demo")
    parsed = vars(parser.parse_args(["--source", "/raw", "--out", "x", "--days", "3", "4", "--no-shuffle"]))
    assert _Options(**parsed) == _Options(Path("/raw"), "x", 2, [3, 4], False)
    with pytest.raises(SystemExit):
        parser.parse_args(["--out", "x"])  # --source is required


def test_the_data_command_lists_its_preparers_and_refuses_an_unknown_one(capsys):
    assert main(["data", "prepare", "--help"]) == 0
    assert "preparers:" in capsys.readouterr().out
    assert main(["data", "prepare", "imagenet"]) == 2
    assert "unknown data preparer 'imagenet'" in capsys.readouterr().err
