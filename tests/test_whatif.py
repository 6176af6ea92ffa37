"""What-if prediction (`cobench trace predict`): a real capture of tiny Llama, its graph, edits, the CLI.

Timing figures are not asserted (a shared 2-core machine); what a user relies on is: the graph finds the
repeated layers and the backward ops that belong to them, an edit moves the prediction the right way
and by no more than naive scaling would, the output says what it assumed, bad input is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import subprocess
    import sys

    from conftest import clean_env

    tmp = tmp_path_factory.mktemp("whatif")
    out = tmp / "bundle"
    proc = subprocess.run([sys.executable, "-m", "suite.cli", "trace", "capture", "--out", str(out),
                           "--baseline-steps", "20", "workload=llama", "workload.preset=tiny", "tracking=off",
                           f"results_dir={tmp / 'results'}"], capture_output=True, text=True, timeout=300,
                          env=clean_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


def test_the_graph_puts_forward_and_backward_ops_in_their_layers(bundle: Path):
    from workloads.whatif.graph import load_graph, schedule

    graph = load_graph(bundle)
    assert graph.stacks == {"layers": 2}
    assert graph.assign_layers(2) == ("layers", 2)
    in_layers = [op for op in graph.ops if op.layer is not None]
    # backward ops reach their layer through the forward op's sequence number (their own scope is autograd's)
    assert any(op.backward and op.category == "gemm" for op in in_layers)
    assert {op.layer for op in in_layers} == {("layers", 0), ("layers", 1)}
    # a gradient's accumulation goes with the layer that made it; the optimizer's work over every
    # parameter is shared with the layers by parameter count
    assert any(op.layer is not None and any("AccumulateGrad" in s for s in op.scopes) for op in graph.ops)
    assert 0 < next(op.layer_share for op in graph.ops if op.category == "optimizer") < 1
    with pytest.raises(ValueError, match="found no 3 repeated layers"):
        graph.assign_layers(3)
    assert any(op.category == "gemm" and op.layer is None for op in graph.ops)  # the output head is outside
    replayed = schedule(graph)
    assert replayed["step_us"] > 0 and set(replayed["compute_us"]) >= {"gemm", "elementwise"}


def test_edits_move_the_prediction_the_right_way(bundle: Path, tmp_path: Path):
    from workloads.whatif.costmodel import Calibration, Curve
    from workloads.whatif.graph import load_graph
    from workloads.whatif.predict import Change, predict

    graph = load_graph(bundle)
    # a made-up platform whose curves are linear: the edits' arithmetic is then exact to check
    linear = Calibration("linear", 1, Curve([1.0, 1e12], [1.0, 1e12]), Curve([1.0, 1e12], [1.0, 1e12]))
    same = predict(graph, Change(), linear)
    assert same.predicted_step_ms == pytest.approx(same.measured_step_ms)
    more_layers = predict(graph, Change(layers=4), linear)
    assert same.predicted_step_ms < more_layers.predicted_step_ms < more_layers.naive_step_ms
    bigger_batch = predict(graph, Change(batch_size=16), linear)
    # parameters, optimizer state and host time do not grow with the batch: less than twice the step
    assert same.predicted_step_ms < bigger_batch.predicted_step_ms < 2 * same.predicted_step_ms
    faster = Calibration("2x", 1, Curve([1.0, 1e12], [0.5, 0.5e12]), Curve([1.0, 1e12], [0.5, 0.5e12]))
    on_faster = predict(graph, Change(calibration=faster), linear)
    compute = sum(v for k, v in same.breakdown_ms.items() if k.startswith("compute_") and k != "compute_view")
    # ops with tensors run twice as fast there (views and ops without tensors as captured), host time stays
    assert same.predicted_step_ms - compute / 2 <= on_faster.predicted_step_ms < same.predicted_step_ms - compute / 4


def test_cobench_trace_predict_writes_its_inputs_and_refuses_bad_changes(cobench, bundle: Path, tmp_path: Path):
    out = tmp_path / "prediction.json"
    proc = cobench("trace", "predict", str(bundle), "workload.n_layers=4", "--json", str(out),
                   "--calibration", str(tmp_path / "calibration.json"))
    assert proc.returncode == 0, proc.stderr
    assert "predicted step" in proc.stdout and "naive linear scaling" in proc.stdout
    record = json.loads(out.read_text())
    assert record["predicted_step_ms"] > 0 and record["inputs"]["change"] == {"layers": 4}
    assert record["inputs"]["captured"]["layers"] == 2 and "compute_gemm" in record["breakdown_ms"]
    assert (tmp_path / "calibration.json").exists()  # measured once, reused next time

    proc = cobench("trace", "predict", str(bundle), "workload.nlayers=4")
    assert proc.returncode == 2 and "workload.n_layers" in proc.stderr
    proc = cobench("trace", "predict", str(bundle), "workload.batch_size=-3")
    assert proc.returncode == 2 and "positive integer" in proc.stderr
    foreign = tmp_path / "foreign.json"
    foreign.write_text('{"schema": "something else"}')
    proc = cobench("trace", "predict", str(bundle), "--target-calibration", str(foreign))
    assert proc.returncode == 2 and "not a what-if calibration" in proc.stderr


def test_predict_then_measure_logs_the_error_with_the_real_run(cobench, bundle: Path, tmp_path: Path):
    """`--measure`: the changed configuration runs for real, its MLflow run carries the prediction's error
    and naive scaling's."""
    from conftest import mlflow_runs

    results = tmp_path / "results"
    proc = cobench("trace", "predict", str(bundle), "workload.n_layers=3", "--calibration",
                   str(tmp_path / "calibration.json"), "--measure", "runner.warmup_steps=2", "runner.steps=6",
                   "runner.progress=false", f"results_dir={results}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "prediction error" in proc.stdout
    (run,) = mlflow_runs(results)
    assert run.info.status == "FINISHED" and run.data.params["workload.n_layers"] == "3"
    m = run.data.metrics
    assert m["predicted_step_ms"] > 0 and m["naive_step_ms"] > m["predicted_step_ms"]
    assert m["prediction_error_pct"] == pytest.approx(100 * (m["predicted_step_ms"] / m["step_time_ms_p50"] - 1))


def test_layers_looped_inside_one_module_are_found_by_their_repeats():
    """A model that loops over its layers inside one module (DLRM's cross network) has no module list:
    the layers are the stretch of N identical consecutive blocks of forward ops; a shorter repeat (three
    projections in a row) is not taken for layers."""
    from workloads.whatif.graph import Graph, Op

    def op(i: int, name: str, dur: float, backward: bool = False, anchor: int | None = None) -> Op:
        return Op(i, name, "elementwise", dur, 0.0, [], module="net.cross", anchor=anchor or i, backward=backward)

    body = ["aten::mm", "aten::mm", "aten::add", "aten::mul", "aten::add"]
    ops = [op(1, "aten::embedding_bag", 50.0)]
    for layer in range(3):
        ops += [op(10 + 10 * layer + k, name, 10.0) for k, name in enumerate(body)]
    ops.append(op(90, "aten::sigmoid", 5.0))
    ops += [op(100 + k, "aten::mm", 10.0, backward=True, anchor=10 + 10 * layer) for k, layer in enumerate((2, 1, 0))]
    graph = Graph("dlrm", {}, ops, 0.0, 1.0, (0.0, 0.0), {})
    assert graph.assign_layers(3) == ("net.cross", 3)
    assert [o.layer for o in ops if o.backward] == [("net.cross", 2), ("net.cross", 1), ("net.cross", 0)]
    assert ops[0].layer is None and ops[-4].layer is None  # before and after the layers
    with pytest.raises(ValueError, match="found no 5 repeated layers"):
        graph.assign_layers(5)
