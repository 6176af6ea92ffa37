"""Timing maths: percentiles, olympic mean, coefficient of variation, the CPU step timer."""

from __future__ import annotations

import time

import pytest
import torch

from harness.running.timing import StepTimer, coefficient_of_variation, olympic_mean, step_stats


def test_step_stats_percentiles_and_cv():
    stats = step_stats([i / 1000 for i in range(1, 101)])  # 1..100 ms
    assert stats.steps == 100
    assert stats.p50_ms == pytest.approx(50.5)
    assert stats.p90_ms == pytest.approx(90.1)
    assert stats.p99_ms == pytest.approx(99.01)
    assert stats.mean_ms == pytest.approx(50.5)
    assert stats.total_s == pytest.approx(5.05)
    assert stats.cv == pytest.approx(29.011 / 50.5, rel=1e-3)


def test_olympic_mean_drops_fastest_and_slowest():
    assert olympic_mean([10, 1, 1000, 11, 12]) == pytest.approx(11)
    assert olympic_mean([3, 5]) == pytest.approx(4)  # too few to drop anything
    with pytest.raises(ValueError):
        olympic_mean([])


def test_coefficient_of_variation():
    assert coefficient_of_variation([5.0]) == 0.0
    assert coefficient_of_variation([1.0, 3.0]) == pytest.approx(2**0.5 / 2)


@pytest.mark.alone  # sleeps timed to within tens of milliseconds: a late wake-up on a busy CPU would miss them
def test_cpu_step_timer_measures_wall_time_per_step():
    timer = StepTimer(torch.device("cpu"))
    for pause in (0.01, 0.03):
        timer.start()
        time.sleep(pause)
        timer.stop()
    first, second = timer.durations_s()
    assert 0.009 < first < 0.05 and 0.029 < second < 0.08
    assert second > first
