"""Suite mechanics that do not need a model: comparison with a baseline benchmark."""

from __future__ import annotations

import pytest

from harness.config import SuiteBenchmark, SuiteConfig
from harness.running.runner import STATUS_FAILED, STATUS_FINISHED, STATUS_SKIPPED, BenchmarkResult
from suite.runner import baseline_deltas


def _result(name: str, status: str = STATUS_FINISHED, **metrics: float) -> BenchmarkResult:
    return BenchmarkResult(name, "w", "cpu", status, "samples/s", None, metrics=metrics)


def _suite(**kw) -> SuiteConfig:
    benches = [SuiteBenchmark(name=n, workload="w") for n in ("none", "int8", "eb", "fp8")]
    return SuiteConfig(name="s", benchmarks=benches, **kw)


def test_deltas_are_against_the_baseline_benchmark():
    suite = _suite(baseline="none", delta_metrics=["auc", "throughput"])
    results = [_result("none", auc=0.80, throughput=100.0), _result("int8", auc=0.79, throughput=120.0),
               _result("eb", auc=0.805), _result("fp8", STATUS_SKIPPED)]
    deltas = baseline_deltas(suite, results)
    assert deltas["int8"] == {"auc_delta": pytest.approx(-0.01), "throughput_delta": pytest.approx(20.0)}
    assert deltas["eb"] == {"auc_delta": pytest.approx(0.005)}  # only metrics both runs have
    assert "fp8" not in deltas and "none" not in deltas


def test_no_deltas_when_the_baseline_did_not_finish():
    suite = _suite(baseline="none", delta_metrics=["auc"])
    assert baseline_deltas(suite, [_result("none", STATUS_FAILED, auc=0.5), _result("int8", auc=0.7)]) == {}


def test_suite_config_rejects_an_unknown_baseline_and_deltas_without_one():
    with pytest.raises(ValueError, match="suite.baseline"):
        _suite(baseline="nope")
    with pytest.raises(ValueError, match="suite.delta_metrics"):
        _suite(delta_metrics=["auc"])


def test_workload_overrides_reach_the_suites_workloads_not_the_default_one(tmp_path):
    """`suite dlrm_codecs workload.preset=a2a`: a preset llama does not have is DLRM's to take."""
    from suite.runner import plan_suite

    base, plans = plan_suite("dlrm_codecs", ["workload.preset=a2a", f"results_dir={tmp_path}", "tracking=off"])
    assert {plan.cfg.workload.preset for plan in plans} == {"a2a"}
    with pytest.raises(ValueError, match="benchmark 'llama_tiny_train'.*preset"):
        plan_suite("smoke", ["workload.preset=a2a", f"results_dir={tmp_path}", "tracking=off"])


def test_a_workload_override_goes_to_the_benchmarks_that_have_the_key_and_a_typo_to_none(tmp_path):
    """`suite smoke workload.train_batches=2`: the training workloads take it, the serving one (which has no
    training batches) is planned without it; a key no benchmark has is a typo, refused naming it."""
    from suite.runner import plan_suite

    common = [f"results_dir={tmp_path}", "tracking=off", "suite.only=[dlrm_tiny_train,llama_infer_tiny]"]
    _, plans = plan_suite("smoke", ["workload.train_batches=2", *common])
    by_name = {plan.name: plan.cfg.workload for plan in plans}
    assert by_name["dlrm_tiny_train"].train_batches == 2 and not hasattr(by_name["llama_infer_tiny"], "train_batches")
    with pytest.raises(ValueError, match=r"'workload.train_bathces': no benchmark of suite 'smoke' has this key"):
        plan_suite("smoke", ["workload.train_bathces=2", *common])
    with pytest.raises(ValueError, match=r"suite.only.*'seqrec'"):
        plan_suite("smoke", [f"results_dir={tmp_path}", "tracking=off", "suite.only=[seqrec]"])
