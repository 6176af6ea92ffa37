"""What-if prediction (`cobench trace predict`, `harness/whatif`): a real capture of tiny Llama, its graph,
the layer/batch/platform edits, the data-parallel degree, the edited graph as a Chakra trace, the CLI.

Timing figures are not asserted (a shared 2-core machine): the validation table comes from
`cobench trace predict-validate`. What a user relies on is asserted: the graph finds the repeated layers
and the backward ops that belong to them, the unchanged graph gives back the measured step, an edit
moves the prediction the right way and adds what it says it adds (the cloned layers' ops, one
all-reduce of the gradients), the output names what it assumed and where its figures came from, bad
input is refused naming the key or file."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import statistics
from pathlib import Path

import pytest


def refused(capsys: pytest.CaptureFixture, *args: str) -> str:
    """``cobench ARGS``, refused: through the command's own entry point (`suite.cli.main`) in this process, with
    no interpreter and library start per case; asserts exit 2 and returns what the command wrote to stderr."""
    from suite.cli import main

    capsys.readouterr()
    code = main(list(args))
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    return err


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


def _linear(name: str = "linear", speed: float = 1.0):
    """A made-up platform whose curves are linear: an edit's arithmetic is then exact to check."""
    from harness.whatif.costmodel import Calibration, Curve

    return Calibration(name, 1, Curve([1.0, 1e12], [1.0 / speed, 1e12 / speed]),
                       Curve([1.0, 1e12], [1.0 / speed, 1e12 / speed]))


def _sweep_table(path: Path, world: int, us_per_mb: float) -> Path:
    from dataclasses import asdict

    from workloads.collectives.table import COLUMNS, FORMAT, VERSION, SweepRow

    rows = [SweepRow("all_reduce", world, "gloo", "cpu", "float32", size, 20.0 + us_per_mb * size / 2**20,
                     30.0 + us_per_mb * size / 2**20, 1.0, 1.0, 10) for size in (2**10, 2**16, 2**20, 2**24)]
    path.write_text(json.dumps({"format": FORMAT, "version": VERSION, "columns": list(COLUMNS), "meta": {},
                                "rows": [asdict(r) for r in rows]}))
    return path


def test_the_graph_puts_forward_and_backward_ops_in_their_layers(bundle: Path):
    from harness.whatif.graph import load_graph, schedule

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
    from harness.whatif.costmodel import Calibration, Curve
    from harness.whatif.graph import load_graph
    from harness.whatif.predict import Change, predict

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


def test_a_flags_missing_or_foreign_file_is_refused_before_the_bundle_is_read(tmp_path: Path):
    """Each file a flag names is read first: one missing, or not what its flag takes, is refused at once, naming
    the flag and how to make the file, before the bundle's graph (seconds to load) is read."""
    from harness.whatif.run import PredictOptions, predict_bundle

    nowhere, nope, foreign = tmp_path / "no-bundle", tmp_path / "nope.json", tmp_path / "foreign.json"
    foreign.write_text('{"format": "something else"}')
    cases = [(PredictOptions(sharded_stage=nope), r"--sharded-stage .*nope.json does not exist.*--nproc-per-node 2 "),
             (PredictOptions(sharded_stage=foreign), "foreign.json: not a sharded-stage timing"),
             (PredictOptions(gradient_sync=nope), r"--gradient-sync .*nope.json does not exist.*sync_probe"),
             (PredictOptions(gradient_sync=foreign), "foreign.json: not a gradient-sync timing"),
             (PredictOptions(collectives=nope), r"--collectives .*nope.json does not exist"),
             (PredictOptions(collectives=foreign), "foreign.json: not a cobench.collectives.sweep"),
             (PredictOptions(target_calibration=nope), "does not exist: make it on the target"),
             (PredictOptions(target_calibration=foreign), "foreign.json: not a what-if calibration")]
    for options, message in cases:
        with pytest.raises(ValueError, match=message):
            predict_bundle(nowhere, ["world_size=2", "workload.parallelism=ddp"], options)
    with pytest.raises(ValueError, match="--nproc-per-node 4 "):  # the degree by any of its names
        predict_bundle(nowhere, ["dp=4"], PredictOptions(gradient_sync=nope))
    with pytest.raises(Exception, match="no-bundle"):  # with no flag, the bundle is what is refused
        predict_bundle(nowhere, ["world_size=2"], PredictOptions())


def test_cobench_trace_predict_writes_its_inputs_and_refuses_bad_changes(cobench, bundle: Path, tmp_path: Path,
                                                                         capsys):
    from harness.whatif.cache import cache_dir

    untouched = sorted(p.relative_to(bundle) for p in bundle.rglob("*"))
    out = tmp_path / "prediction.json"
    proc = cobench("trace", "predict", str(bundle), "workload.n_layers=4", "--json", str(out),
                   "--calibration", str(tmp_path / "calibration.json"))
    assert proc.returncode == 0, proc.stderr
    assert "predicted step" in proc.stdout and "naive linear scaling" in proc.stdout
    record = json.loads(out.read_text())
    assert record["predicted_step_ms"] > 0 and record["inputs"]["change"] == {"layers": 4}
    assert record["inputs"]["captured"]["layers"] == 2 and "compute_gemm" in record["breakdown_ms"]
    assert (tmp_path / "calibration.json").exists()  # measured once, reused next time
    # the curves were measured with host memory as the capture had it (the harness's steady default)
    if platform.libc_ver()[0] == "glibc":
        assert record["inputs"]["host_allocator"].startswith("steady (glibc")
    # another platform's curves, made there with its runs' host memory, predict for it
    target = tmp_path / "target.json"
    proc = cobench("trace", "calibrate", "--out", str(target), "--threads", "1", "--host-allocator", "system")
    assert proc.returncode == 0 and "1 threads, host memory system" in proc.stdout, proc.stderr
    assert json.loads(target.read_text())["host_allocator"].startswith("system")
    proc = cobench("trace", "predict", str(bundle), "--target-calibration", str(target))
    assert proc.returncode == 0 and "predicted step" in proc.stdout, proc.stderr
    # this machine's curves, measured for that prediction, are kept beside the bundle; the bundle is the user's
    assert (cache_dir(bundle) / "calibration.json").is_file()
    assert str(cache_dir(bundle)).startswith(os.environ["COBENCH_CACHE_DIR"])
    assert cache_dir(bundle).parent.name == "whatif"
    assert sorted(p.relative_to(bundle) for p in bundle.rglob("*")) == untouched

    err = refused(capsys, "trace", "predict", str(bundle), "workload.nlayers=4")
    assert "workload.n_layers" in err
    err = refused(capsys, "trace", "predict", str(bundle), "workload.batch_size=-3")
    assert "positive integer" in err
    foreign = tmp_path / "foreign.json"
    foreign.write_text('{"schema": "something else"}')
    err = refused(capsys, "trace", "predict", str(bundle), "--target-calibration", str(foreign))
    assert "not a what-if calibration" in err


def test_a_second_prediction_on_the_same_bundle_gives_the_same_figures(cobench, bundle: Path, tmp_path: Path):
    """The curves the first prediction measured are kept in the bundle's what-if cache: the next prediction of
    the same changes takes them and gives the same record, figure for figure."""
    records = []
    for name in ("first", "again"):
        out = tmp_path / f"{name}.json"
        proc = cobench("trace", "predict", str(bundle), "workload.n_layers=4", "workload.batch_size=16", "--json",
                       str(out))
        assert proc.returncode == 0, proc.stderr[-2000:]
        records.append(json.loads(out.read_text()))
    assert records[0]["inputs"]["change"] == {"layers": 4, "batch_size": 16}
    assert records[0] == records[1]


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
    from harness.whatif.graph import Graph, Op

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
    # a module list of the same length elsewhere (DLRM's bottom MLP: 3 linear layers) is not among them
    mlp = [Op(200 + i, name, "gemm", 5.0, 0.0, [], module=f"bottom.{i // 2}", anchor=200 + i)
           for i, name in enumerate(["aten::addmm", "aten::relu"] * 3)]
    with_mlp = Graph("dlrm", {}, [*mlp, *ops], 0.0, 1.0, (0.0, 0.0), {})
    assert with_mlp.assign_layers(3) == ("net.cross", 3)
    assert all(o.layer is None for o in mlp)


@pytest.mark.slow
def test_the_unchanged_graph_gives_back_the_measured_step(bundle: Path):
    """No change: the prediction is the captured step; the raw replay of the graph is reported beside it
    (its error is not asserted: on a quiet machine a few %, but the capture's Kineto-alone and plain steps
    run at different moments, so a busy shared machine moves it by tens of %)."""
    from harness.whatif.dataparallel import predict_data_parallel
    from harness.whatif.graph import load_graph
    from harness.whatif.predict import Change, predict

    graph = load_graph(bundle)
    same = predict(graph, Change(), _linear())
    assert same.predicted_step_ms == pytest.approx(same.measured_step_ms)
    assert math.isfinite(same.to_json()["unchanged_error_pct"]) and same.unchanged_step_ms > 0
    one_rank = predict_data_parallel(graph, 1, _linear())
    assert one_rank.predicted_step_ms == pytest.approx(same.predicted_step_ms)
    assert one_rank.inputs["data_parallel"]["allreduce_ms"] == 0


@pytest.mark.slow
def test_two_ranks_split_the_batch_and_all_reduce_every_gradient_once(bundle: Path, tmp_path: Path):
    from harness.whatif.dataparallel import allreduce_cost, gradient_bytes, predict_data_parallel
    from harness.whatif.graph import load_graph
    from harness.whatif.predict import Change, predict
    from workloads.llama.args import PRESETS, count_total_params

    graph = load_graph(bundle)
    # every parameter's gradient, float32: what DDP all-reduces
    assert gradient_bytes(graph) == 4 * count_total_params(PRESETS["tiny"])
    half = predict(graph, Change(batch_size=4), _linear())
    table = _sweep_table(tmp_path / "collectives_all_reduce.json", 2, us_per_mb=1000.0)
    two = predict_data_parallel(graph, 2, _linear(), allreduce=allreduce_cost(2, table))
    dp = two.inputs["data_parallel"]
    assert dp["batch_per_rank"] == 4 and dp["buckets"] == 1 and dp["allreduce"]["source"] == str(table)
    # the rank's step is the half batch's, plus the all-reduce read off the table at the gradients' size
    expected_ms = (20.0 + 1000.0 * gradient_bytes(graph) / 2**20) / 1e3
    assert dp["allreduce_ms"] == pytest.approx(expected_ms, rel=0.05)
    assert two.predicted_step_ms == pytest.approx(half.predicted_step_ms + dp["allreduce_ms"])
    assert two.breakdown_ms["communication"] == pytest.approx(dp["allreduce_ms"])
    assert two.naive_step_ms == pytest.approx(two.measured_step_ms / 2)  # perfect strong scaling
    assert "not_modelled" not in dp
    # a workload whose tables TorchRec shards at 2 ranks, with no timing of that stage: the prediction says
    # what it cannot see
    sharded = predict_data_parallel(graph, 2, _linear(), allreduce=allreduce_cost(2, table), sharded=True)
    assert "DistributedModelParallel" in sharded.inputs["data_parallel"]["not_modelled"]
    # a rank that gets half the cores runs slower: the per-rank curves are what it is re-timed by
    slower = predict_data_parallel(graph, 2, _linear(), rank_calibration=_linear("half", 0.5),
                                   allreduce=allreduce_cost(2, table))
    assert slower.predicted_step_ms > two.predicted_step_ms
    assumed = allreduce_cost(2, None, busbw_gbps=0.1, latency_us=10.0)
    assert assumed.describe() == {"source": "assumed", "world_size": 2, "busbw_gbps": 0.1, "latency_us": 10.0}
    assert assumed.at(1e6) == pytest.approx(10.0 + 1e6 / 1e2)  # 2(n-1)/n = 1 at two ranks

    with pytest.raises(ValueError, match=r"collectives_all_reduce.json: no all_reduce rows at world size 4"):
        allreduce_cost(4, table)
    with pytest.raises(ValueError, match="batch_size=8 is not divisible by world_size=3"):
        predict_data_parallel(graph, 3, _linear())


def test_the_all_reduce_fit_rides_over_one_disturbed_size():
    """A sweep of latency 500 µs and 1 GB/s whose 16 KB point a busy host made 4x slower: the fit still gives
    about the machine's figures at 2 MB (interpolating between the neighbours of a disturbed point follows it)."""
    from harness.whatif.dataparallel import AllReduceCost, fit_latency_bandwidth

    sizes = [2.0**k for k in range(10, 25, 2)]
    times = [500.0 + n / 1e3 for n in sizes]
    assert fit_latency_bandwidth(sizes, times) == pytest.approx((500.0, 1e-3))
    times[2] *= 4  # 16 KB
    cost = AllReduceCost(2, "table", sizes, times)
    assert cost.at(2**21) == pytest.approx(500.0 + 2**21 / 1e3, rel=0.15)
    described = cost.describe()
    assert described["fit_residual_pct"][0] < -60 and described["points"] == 8
    alpha, beta = fit_latency_bandwidth([1024.0, 4096.0], [900.0, 800.0])  # no growth with size: all latency
    assert 800.0 < alpha < 900.0 and beta == 0.0
    assert fit_latency_bandwidth([1024.0], [700.0]) == (700.0, 0.0)


@pytest.mark.slow
def test_the_edited_graph_exports_as_chakra(bundle: Path, tmp_path: Path):
    """2 → 4 layers: the last layer's ops appear twice more (forward and backward), their durations
    with them; at two ranks the all-reduce is one collective node of the gradients' size."""
    from harness.whatif.chakra_export import edited_ops, export_edited_chakra
    from harness.whatif.dataparallel import gradient_bytes
    from harness.whatif.graph import load_graph
    from harness.whatif.predict import Change
    from workloads.trace_replay.chakra import read_chakra

    graph = load_graph(bundle)
    graph.assign_layers(2)
    last = [op for op in graph.ops if op.layer is not None and op.layer[1] == 1]
    ops = edited_ops(graph, Change(layers=4), _linear())
    assert len(ops) == len(graph.ops) + 2 * len(last)
    added = sum(d for _, d, _ in ops) - sum(d for _, d, k in ops if k == 0)
    assert added == pytest.approx(2 * sum(op.dur_us for op in last))
    path = export_edited_chakra(graph, ops, tmp_path / "chakra" / "rank0.et", [(gradient_bytes(graph), 500.0)])
    metadata, nodes = read_chakra(path)
    assert metadata["version"] and len(nodes) == len(ops) + 1
    clones = [n for n in nodes if "layer clone" in n["name"]]
    assert len(clones) == 2 * len(last)
    comm = nodes[-1]
    assert comm["type"] == "COMM_COLL_NODE" and comm["durationMicros"] == "500"
    assert {a["name"]: a for a in comm["attr"]}["comm_size"]["int64Val"] == str(gradient_bytes(graph))
    ids = {n["id"] for n in nodes}
    assert all(d in ids for n in nodes for d in n.get("dataDeps", []) + n.get("ctrlDeps", []))
    fewer = edited_ops(graph, Change(layers=1), _linear())
    assert len(fewer) == len(graph.ops) - len(last)


@pytest.mark.slow
def test_cobench_trace_predict_ranks_json_chakra_and_refusals(cobench, bundle: Path, tmp_path: Path, capsys):
    import subprocess
    import sys

    from conftest import clean_env

    calibration = tmp_path / "calibration.json"
    _linear_json = _linear().to_json()
    calibration.write_text(json.dumps(_linear_json))
    table = _sweep_table(tmp_path / "collectives_all_reduce.json", 2, us_per_mb=1000.0)
    out = tmp_path / "prediction.json"
    proc = cobench("trace", "predict", str(bundle), "world_size=2", "workload.parallelism=ddp", "workload.n_layers=4",
                   "--calibration", str(calibration), "--collectives", str(table), "--json", str(out), "--chakra",
                   str(tmp_path / "chakra"), "--sync-from", "table")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "2 data-parallel ranks" in proc.stdout and "measured sweep table" in proc.stdout
    assert "synchronisation beyond the collective is not modelled" in proc.stdout
    record = json.loads(out.read_text())
    assert record["predicted_step_ms"] > 0 and record["breakdown_ms"]["communication"] > 0
    assert record["inputs"]["changes"] == ["world_size=2", "workload.parallelism=ddp", "workload.n_layers=4"]
    assert record["inputs"]["data_parallel"]["allreduce"]["source"] == str(table)
    assert Path(record["chakra"]).exists()
    # the skeleton of that step: 4 layers' gradients where the capture had 2, at their predicted times
    spec = record["inputs"]["data_parallel"]["sync_spec"]
    assert spec["world_size"] == 2 and spec["ready_ms"] == sorted(spec["ready_ms"])
    assert 0 < spec["ready_ms"][0] and spec["ready_ms"][-1] <= spec["step_ms"]
    assert sum(math.prod(shape) * 4 for shape, _ in spec["gradients"]) == \
        record["inputs"]["data_parallel"]["gradient_bytes"]

    # by default DDP's synchronisation is timed at 2 ranks on the skeleton (3 torchrun launches), kept in the bundle
    proc = cobench("trace", "predict", str(bundle), "world_size=2", "workload.parallelism=ddp",
                   "--calibration", str(calibration), "--collectives", str(table), "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "timing DDP's gradient synchronisation at 2 ranks" in proc.stdout
    assert "DDP's gradient synchronisation: +" in proc.stdout
    record = json.loads(out.read_text())
    dp = record["inputs"]["data_parallel"]
    timing = dp["gradient_sync"]["timing"]
    assert timing["launches"] == 3 and len(timing["launch_sync_ms"]) == 3 and timing["world_size"] == 2
    assert timing["gradients"] == len(dp["sync_spec"]["gradients"]) and timing["gradient_bytes"] == dp["gradient_bytes"]
    assert len(timing["plain_ms_p50"]) == len(timing["ddp_ms_p50"]) == 2  # every rank's medians
    # the job's step (the slowest rank's at each pass) is what a real run reports: never below a rank's own median
    assert timing["job_ddp_ms_p50"] >= min(timing["ddp_ms_p50"])
    for sync, job, plain in zip(timing["launch_sync_ms"], timing["launch_job_ddp_ms_p50"],
                                timing["launch_plain_ms_p50"], strict=True):
        assert sync == pytest.approx(job - sum(plain) / 2)
    assert timing["sync_ms"] == pytest.approx(statistics.median(timing["launch_sync_ms"]))
    assert record["breakdown_ms"]["communication"] == pytest.approx(dp["gradient_sync_ms"]) == \
        pytest.approx(timing["sync_ms"])
    rest = record["predicted_step_ms"] - dp["gradient_sync_ms"]
    assert rest == pytest.approx(sum(v for k, v in record["breakdown_ms"].items() if k != "communication"))
    from harness.whatif.cache import cache_dir

    assert Path(dp["gradient_sync"]["source"]).parent == cache_dir(bundle)  # kept beside the bundle, not in it
    again = cobench("trace", "predict", str(bundle), "world_size=2", "workload.parallelism=ddp",
                    "--calibration", str(calibration), "--json", str(tmp_path / "again.json"))
    assert again.returncode == 0 and "timing DDP's" not in again.stdout  # the cached timing of this skeleton
    assert json.loads((tmp_path / "again.json").read_text())["inputs"]["data_parallel"]["gradient_sync_ms"] == \
        dp["gradient_sync_ms"]
    # a timing made elsewhere (the sync probe on the prediction's JSON) is taken; one of another step refused
    made = tmp_path / "sync.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m",
                           "harness.whatif.sync_probe", str(out), "--out", str(made), "--passes", "6", "--warmup", "2"],
                          capture_output=True, text=True, timeout=300, env=clean_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "DDP gradient sync at 2 ranks" in proc.stdout and json.loads(made.read_text())["passes"] == 6
    proc = cobench("trace", "predict", str(bundle), "world_size=2", "workload.parallelism=ddp",
                   "--calibration", str(calibration), "--gradient-sync", str(made))
    assert proc.returncode == 0 and str(made) in proc.stdout
    err = refused(capsys, "trace", "predict", str(bundle), "world_size=2", "workload.parallelism=ddp",
                  "workload.n_layers=4", "--calibration", str(calibration), "--gradient-sync", str(made))
    assert "timed for 21 gradients" in err and "harness.whatif.sync_probe" in err
    # a timing of each rank's own median (no job step: an earlier cobench's) is refused, not taken as the job's
    older = tmp_path / "older_sync.json"
    older.write_text(json.dumps({k: v for k, v in json.loads(made.read_text()).items() if k != "job_ddp_ms_p50"}))
    err = refused(capsys, "trace", "predict", str(bundle), "world_size=2", "workload.parallelism=ddp",
                  "--calibration", str(calibration), "--gradient-sync", str(older))
    assert "slowest rank's" in err and "time it again" in err
    from harness.whatif.sync_probe import main as sync_probe

    capsys.readouterr()
    assert sync_probe([str(calibration), "--out", str(made)]) == 2 and "sync_spec" in capsys.readouterr().err

    ddp = ["world_size=2", "workload.parallelism=ddp"]
    proc = cobench("trace", "predict", str(bundle), *ddp, "--calibration", str(calibration), "--sync-from", "table")
    assert proc.returncode == 0 and "ASSUMED bus bandwidth" in proc.stdout  # no table: the assumption is said
    # Llama's default parallelism shards parameters at 2 ranks (FSDP2), which the prediction does not model
    err = refused(capsys, "trace", "predict", str(bundle), "world_size=2", "--calibration", str(calibration))
    assert "workload.parallelism=ddp" in err

    err = refused(capsys, "trace", "predict", str(bundle), "workload.world=2")
    assert "'workload.world'" in err and "world_size" in err
    foreign = tmp_path / "foreign.json"
    foreign.write_text('{"format": "something else"}')
    err = refused(capsys, "trace", "predict", str(bundle), *ddp, "--calibration", str(calibration),
                  "--collectives", str(foreign))
    assert "foreign.json" in err and "cobench.collectives.sweep" in err
    err = refused(capsys, "trace", "predict", str(bundle), *ddp, "--collectives", str(tmp_path / "nope.json"))
    assert "nope.json does not exist" in err
    err = refused(capsys, "trace", "predict", str(tmp_path), "world_size=2")
    assert str(tmp_path) in err


def test_validation_judges_each_rounds_predicted_ratio_against_its_measured_ratio():
    """Drift common to a round's base and changed run cancels: a prediction of the right ratio has no error
    however much the machine's speed moved between rounds; naive scaling's ratio is judged the same way."""
    from harness.whatif.validate import CaseResult

    drifting = CaseResult("llama", "layers", ["workload.n_layers=4"], predicted_ms=[18.0, 21.6, 14.4],
                          predicted_ratios=[1.8, 1.8, 1.8], naive_ratio=2.0, base_ms=[10.0, 12.0, 8.0],
                          changed_ms=[18.0, 21.6, 14.4])
    figures = drifting.summary()
    assert figures["prediction_error_pct"] == pytest.approx(0.0)
    assert figures["prediction_error_min_pct"] == pytest.approx(0.0) == figures["prediction_error_max_pct"]
    assert figures["naive_error_pct"] == pytest.approx(100 * (2.0 / 1.8 - 1))
    assert figures["measured_step_ms"] == 18.0 and figures["absolute_error_pct"] == pytest.approx(0.0)
    off = CaseResult("llama", "batch", [], [10.0, 10.0], [1.5, 1.5], 2.0, [10.0, 10.0], [12.0, 15.0])
    assert off.errors(off.predicted_ratios) == pytest.approx([25.0, 0.0])
    assert off.summary()["prediction_error_pct"] == pytest.approx(12.5)
    # each round is judged on its own capture's ratio: a capture in a slow moment predicts for that moment
    paired = CaseResult("llama", "batch", [], [12.0, 16.0], [1.2, 1.6], 2.0, [10.0, 10.0], [12.0, 16.0])
    assert paired.errors(paired.predicted_ratios) == pytest.approx([0.0, 0.0])
    assert paired.summary()["predicted_ratio_min"] == 1.2 and paired.summary()["predicted_ratio_max"] == 1.6


def test_a_world_size_change_is_measured_between_two_base_runs(tmp_path: Path, monkeypatch):
    """A 2-rank run cannot share a process with its base: it runs between two base runs, and its ratio is to
    their geometric mean, so a host that slows down over the three runs moves both sides alike."""
    import harness.whatif.validate as validate

    ran = []

    def step_ms(root: Path, command: list[str]) -> tuple[float, bool]:
        ran.append((root.name, command))
        return {"r-base": 10.0, "r-changed": 18.0, "r-base-after": 12.1}[root.name], root.name == "r-changed"

    monkeypatch.setattr(validate, "_step_ms", step_ms)
    (base, changed), noisy = validate._measure(tmp_path / "r", 2, ["workload=llama"], ["workload.parallelism=ddp"],
                                               ["runner.steps=8"], 8, 2, "suite.cli")
    assert [name for name, _ in ran] == ["r-base", "r-changed", "r-base-after"]
    assert "torch.distributed.run" in ran[1][1] and "workload.parallelism=ddp" in ran[1][1]
    assert all("torch.distributed.run" not in c and "workload.parallelism=ddp" not in c for _, c in (ran[0], ran[2]))
    assert base == pytest.approx(11.0) and changed == 18.0 and noisy


def test_a_batch_change_resizes_data_the_step_made_in_shapes_it_does_not_name():
    """Jagged data (seqrec): a length bucket's histories and Σ(length − 1) target rows are no batch-sized
    dimension, yet grow with the batch; a gradient in a parameter's shape (or transposed) does not."""
    from harness.whatif.graph import TensorUse
    from harness.whatif.predict import Resize, _rescaled

    resize = Resize({32: 2.0, 512: 1.0}, 2.0, frozenset({(96, 32), (32, 96)}), single=(32, 512))
    assert _rescaled(TensorUse((2, 2, 156, 16), 4, False), resize).shape == (4, 2, 156, 16)  # a bucket
    assert _rescaled(TensorUse((866, 64), 4, False), resize).shape == (1732, 64)  # target rows
    assert _rescaled(TensorUse((866, 32), 4, False), resize).shape == (1732, 32)  # not its width of 32
    assert _rescaled(TensorUse((32, 512, 16), 4, False), resize).shape == (64, 512, 16)  # the named batch
    assert _rescaled(TensorUse((96, 32), 4, False), resize).shape == (96, 32)  # a weight's gradient
    assert _rescaled(TensorUse((96, 7), 4, False), Resize({32: 2.0}, 2.0, frozenset({(96, 7)}), single=(32,))).shape \
        == (96, 7)  # W.t() (dimension_factors puts 2-D parameter shapes in transposed too)
    # a known size wins over a parameter's shape: 8 × 64 tokens of width 64 beside a 512 × 64 table
    assert _rescaled(TensorUse((512, 64), 4, False), Resize({512: 2.0, 8: 2.0}, 2.0, frozenset({(512, 64)}),
                                                            combined=(512,), single=(8,))).shape == (1024, 64)
    assert _rescaled(TensorUse((512, 16), 4, False), resize).shape == (512, 16)  # a sequence-long tensor
    assert _rescaled(TensorUse((7, 16), 4, True), resize).shape == (7, 16)  # lives across steps
    assert _rescaled(TensorUse((32, 3, 32), 4, False), resize).shape == (64, 3, 32)  # batch 32, width 32
    assert _rescaled(TensorUse((7, 16), 4, False), Resize({512: 2.0}, 1.0, single=(512,))).shape == (7, 16)


@pytest.fixture(scope="module")
def seqrec_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import subprocess
    import sys

    from conftest import clean_env

    tmp = tmp_path_factory.mktemp("whatif_seqrec")
    out = tmp / "bundle"
    proc = subprocess.run([sys.executable, "-m", "suite.cli", "trace", "capture", "--out", str(out),
                           "--baseline-steps", "10", "--warmup", "3", "workload=seqrec", "workload.preset=tiny",
                           "workload.train_batches=8", "tracking=off", f"results_dir={tmp / 'results'}"],
                          capture_output=True, text=True, timeout=300, env=clean_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


@pytest.mark.slow
def test_a_jagged_batch_is_predicted_from_the_runs_own_batches_bucket_by_bucket(seqrec_bundle: Path):
    """seqrec pads attention within power-of-two length buckets: the graph's bucket groups are found, the
    capture's op-by-op timed steps ran the traced step's buckets (the batch held), and a 2x batch is costed
    on the batches the changed run trains on — more and longer buckets, not the traced ones doubled."""
    from omegaconf import OmegaConf

    from harness.whatif.graph import load_graph
    from harness.whatif.jagged import buckets_of, find_groups
    from harness.whatif.predict import Change, predict
    from workloads.seqrec.config import SeqRecConfig
    from workloads.trace_bundle import KINETO_TIMING_FILE, STEP_ANNOTATION

    graph = load_graph(seqrec_bundle)
    config = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(SeqRecConfig), graph.config["workload"]))
    groups = find_groups(graph, config.shape().num_heads)
    traced = {g.index: (g.count, g.longest, g.tokens) for g in groups}
    assert len(traced) == len(groups) >= 3 and len({len(g.ops) for g in groups}) == 1
    seed = graph.config["seed"]
    assert traced in [buckets_of(b) for b in config.train_lengths(seed)]  # the traced step is a run's batch
    # every op-by-op timed step ran the traced step's buckets: as many attention calls as the traced step
    events = json.loads((seqrec_bundle / KINETO_TIMING_FILE).read_text())["traceEvents"]
    steps = [e for e in events if str(e.get("name", "")).startswith(STEP_ANNOTATION)]
    attention = [sum(1 for e in events if e.get("cat") == "cpu_op" and "flash_attention" in e["name"]
                     and not e["name"].endswith("backward") and s["ts"] <= e["ts"] < s["ts"] + s["dur"])
                 for s in steps]
    assert len(steps) >= 2 and set(attention) == {len(traced) * config.shape().num_layers}, attention

    doubled = predict(graph, Change(batch_size=2 * config.batch_size), _linear())
    drawn = doubled.inputs["jagged_buckets"]["representative_draw"]
    assert "training batches" in drawn["changed"]["batches"]
    big = dataclasses.replace(config, batch_size=2 * config.batch_size)
    assert drawn["changed"]["tokens"] in [int(b.sum()) for b in big.train_lengths(seed)]
    assert drawn["captured"]["tokens"] in [int(b.sum()) for b in config.train_lengths(seed)]
    assert doubled.predicted_step_ms > doubled.measured_step_ms
    same = predict(graph, Change(batch_size=config.batch_size), _linear())
    assert same.predicted_step_ms == pytest.approx(same.measured_step_ms, rel=1e-9)


@pytest.mark.slow
def test_a_sharded_stage_timed_at_two_ranks_replaces_the_captured_embeddings(cobench, seqrec_bundle: Path,
                                                                            tmp_path: Path, capsys):
    """TorchRec's DMP at 2 ranks: seqrec's sharded embedding stage is timed alone under torchrun (2 gloo ranks,
    the workload's own plan and batches), and the prediction puts it in place of the capture's embedding ops
    — forward and backward by module, the tables' in-backward Adagrad by their shapes — whose gradients DDP
    then does not all-reduce."""
    import subprocess
    import sys

    from conftest import clean_env

    from harness.whatif.dataparallel import (
        ShardedStageCost,
        allreduce_cost,
        gradient_bytes,
        predict_data_parallel,
        stage_ops,
    )
    from harness.whatif.graph import load_graph
    from harness.whatif.predict import Change, predict

    timing = tmp_path / "stage.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m",
                           "harness.whatif.stage_probe", str(seqrec_bundle), "--out", str(timing), "--passes", "12",
                           "--warmup", "2"], capture_output=True, text=True, timeout=300, env=clean_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(timing.read_text())
    assert record["world_size"] == 2 and record["module"] == "embeddings" and record["passes"] == 12
    assert record["threads_per_rank"] == 1  # torchrun's default for 2 ranks on one host, as the real run has
    assert 0 < record["ms_p10"] <= record["ms_p50"] <= record["ms_p90"] and len(record["rank_ms_p50"]) == 2
    assert "at 2 rank(s)" in proc.stdout

    graph = load_graph(seqrec_bundle)
    replaced = stage_ops(graph, "embeddings")
    ops = {op.id: op for op in graph.ops}
    names = {ops[i].name for i in replaced}
    # the lookups with their backward, and the tables' Adagrad that runs inside the autograd engine
    assert any(ops[i].backward for i in replaced) and any(not ops[i].backward for i in replaced)
    assert any("Optimizer.step#Adagrad.step" in s for i in replaced for s in ops[i].scopes)
    assert not any("AdamW" in s for i in replaced for s in ops[i].scopes)  # the dense optimizer stays
    assert "aten::embedding" in names or "aten::embedding_backward" in names or "aten::index_select" in names
    assert gradient_bytes(graph, replaced) <= gradient_bytes(graph)

    stage = ShardedStageCost.from_timing(record, str(timing))
    table = _sweep_table(tmp_path / "collectives_all_reduce.json", 2, us_per_mb=1000.0)
    allreduce = allreduce_cost(2, table)
    two = predict_data_parallel(graph, 2, _linear(), allreduce=allreduce, stage=stage, sharded=True)
    dp = two.inputs["data_parallel"]
    assert "not_modelled" not in dp and dp["sharded_stage"]["ops_replaced"] == len(replaced)
    batch = graph.config["workload"]["batch_size"]
    rest = predict(graph, Change(batch_size=batch // 2), _linear(), replaced)
    assert two.predicted_step_ms == pytest.approx(rest.predicted_step_ms + dp["allreduce_ms"] + record["ms_p50"])
    assert two.breakdown_ms["sharded_stage"] == pytest.approx(record["ms_p50"])
    # DDP's skeleton: the dense gradients only (the tables' Adagrad runs in backward: DDP leaves them out), the
    # stage's time back where it ran, and its stretches' starts where the ranks meet
    spec = dp["sync_spec"]
    tables = {u.shape for op in graph.ops if any("Adagrad" in s for s in op.scopes) for u in op.inputs
              if u.persistent and u.shape}
    assert tables and not {tuple(shape) for shape, _ in spec["gradients"]} & tables
    assert sum(math.prod(shape) * 4 for shape, _ in spec["gradients"]) == dp["gradient_bytes"] == \
        gradient_bytes(graph, replaced)
    assert spec["ddp"]["static_graph"] and spec["ddp"]["gradient_as_bucket_view"]  # TorchRec's DDP wrapper
    assert spec["step_ms"] == pytest.approx(rest.predicted_step_ms + record["ms_p50"])
    assert spec["collectives_ms"] and all(0 <= t <= spec["step_ms"] for t in spec["collectives_ms"])
    with pytest.raises(ValueError, match="timed at 2 ranks, not 4"):
        predict_data_parallel(graph, 4, _linear(), stage=stage, sharded=True)
    with pytest.raises(ValueError, match="no ops of module 'sparse_arch'"):
        predict_data_parallel(graph, 2, _linear(), stage=dataclasses.replace(stage, module="sparse_arch"))

    calibration = tmp_path / "calibration.json"
    calibration.write_text(json.dumps(_linear().to_json()))
    out = tmp_path / "prediction.json"
    proc = cobench("trace", "predict", str(seqrec_bundle), "world_size=2", "--calibration", str(calibration),
                   "--collectives", str(table), "--sharded-stage", str(timing), "--json", str(out),
                   "--chakra", str(tmp_path / "chakra"), "--sync-from", "table")
    assert proc.returncode == 0, proc.stderr[-2000:]
    from workloads.trace_replay.chakra import read_chakra

    _, nodes = read_chakra(tmp_path / "chakra" / "rank0.et")  # the stage is one node of its measured time
    (node,) = [n for n in nodes if n["name"].startswith("sharded embedding stage")]
    assert int(node["durationMicros"]) == round(1e3 * record["ms_p50"])
    assert len(nodes) == len(graph.ops) - len(replaced) + 1 + 1  # + the stage, + the all-reduce bucket
    ids = {n["id"] for n in nodes}
    assert all(d in ids for n in nodes for d in n.get("dataDeps", []) + n.get("ctrlDeps", []))
    assert "sharded embedding stage (embeddings" in proc.stdout and "warning: not modelled" not in proc.stdout
    cli = json.loads(out.read_text())  # (its ranks re-timed on this host's measured 1-thread curves)
    assert cli["inputs"]["data_parallel"]["sharded_stage"]["ops_replaced"] == len(replaced)
    assert cli["breakdown_ms"]["sharded_stage"] == pytest.approx(record["ms_p50"])
    assert cli["predicted_step_ms"] > record["ms_p50"] + cli["inputs"]["data_parallel"]["allreduce_ms"]
    err = refused(capsys, "trace", "predict", str(seqrec_bundle), "world_size=2", "--calibration",
                  str(calibration), "--sharded-stage", str(tmp_path / "nope.json"))
    assert "nope.json does not exist" in err and "harness.whatif.stage_probe" in err
    err = refused(capsys, "trace", "predict", str(seqrec_bundle), "world_size=2", "--calibration",
                  str(calibration), "--sharded-stage", str(table))
    assert "not a sharded-stage timing" in err
    err = refused(capsys, "trace", "predict", str(seqrec_bundle), "world_size=2", "--calibration",
                  str(calibration), "--target-calibration", str(calibration))
    assert "timed there" in err
    err = refused(capsys, "trace", "predict", str(seqrec_bundle), "world_size=2", "workload.batch_size=64",
                  "--calibration", str(calibration), "--sharded-stage", str(timing))
    assert "timed with changes []" in err


_CRASHING_PROBE = """
import argparse, json, os, sys
from pathlib import Path
parser = argparse.ArgumentParser()
parser.add_argument("plan", type=Path)
parser.add_argument("--out", type=Path, required=True)
args = parser.parse_args()
plan = json.loads(args.plan.read_text())
launch = len(list(args.plan.parent.glob(f"ran_{os.environ['RANK']}_*")))
(args.plan.parent / f"ran_{os.environ['RANK']}_{launch}").touch()
what = plan[min(launch, len(plan) - 1)]
if os.environ["RANK"] == "0":
    if what == "bad":
        print("probe: error: no such skeleton", file=sys.stderr)
        raise SystemExit(2)
    if what == "abort":
        print(f"rank 0 aborting in launch {launch}", file=sys.stderr, flush=True)
        os.abort()
    args.out.write_text(json.dumps({"launch": launch}))
    if what == "abort_after":
        os.abort()
"""


@pytest.mark.parametrize("plan, launched, crashes, error", [
    (["abort", "ok"], 2, [("SIGABRT", False)], None),  # crashed once: run again, the crash kept in the record
    (["abort_after"], 1, [("SIGABRT", True)], None),  # crashed after writing its timing: the timing stands
    (["abort", "abort"], 2, [], "a rank ended by SIGABRT"),  # crashed twice: fails, with the rank's own words
    (["bad"], 1, [], "exit 1): [rank 0] probe: error: no such skeleton"),  # a rank's own error: not run again
])
def test_a_probe_launch_a_signal_ends_runs_once_more_and_says_what_the_ranks_said(tmp_path: Path, monkeypatch, plan,
                                                                                  launched, crashes, error):
    """Real torchrun launches of a probe whose rank 0 aborts, or refuses its input, in a planned launch."""
    from harness.whatif.costs import launch_pooled

    (tmp_path / "crashing_probe.py").write_text(_CRASHING_PROBE)
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    cached = tmp_path / "timing.json"

    def pool(records: list[dict]) -> dict:
        return {"launches": [r["launch"] for r in records]}

    if error is None:
        launch_pooled(2, "crashing_probe", [str(tmp_path / "plan.json")], cached, 1, pool, "a crashing probe")
        record = json.loads(cached.read_text())
        assert record["launches"] == [launched - 1]
        assert [(c["signal"], c["after_timing"]) for c in record["crashed_launches"]] == crashes
        if not crashes[0][1]:
            assert "rank 0 aborting in launch 0" in record["crashed_launches"][0]["ranks"]
    else:
        with pytest.raises(RuntimeError, match="timing a crashing probe at 2 ranks failed") as failed:
            launch_pooled(2, "crashing_probe", [str(tmp_path / "plan.json")], cached, 1, pool, "a crashing probe")
        assert error in str(failed.value)
        assert "Root Cause" not in str(failed.value)  # the ranks' words, not torchrun's report
        assert not cached.exists()
    assert len(list(tmp_path.glob("ran_0_*"))) == launched


def test_the_skeleton_cuts_the_step_at_its_gradients_with_the_collectives_inside():
    from harness.whatif.sync_probe import _stretches

    # gradients made at 2 and 3 ms of a 5 ms step, the stage's collectives at 0.5 and 4 ms; 10 products a ms
    stretches = _stretches(10.0, [2.0, 3.0], 5.0, [0.5, 4.0])
    assert stretches == [[5, None, 15], [10], [10, None, 10]]  # before the first, between, after the last
    assert sum(p for s in stretches for p in s if p) == 50  # the whole step, nothing twice
    assert _stretches(10.0, [5.0], 5.0, []) == [[50], [0]]


def test_a_calibration_spike_is_lowered_not_carried_to_larger_sizes():
    from harness.whatif.costmodel import Curve, monotone

    spiked = monotone(Curve([1.0, 2.0, 4.0, 8.0], [1.0, 500.0, 3.0, 7.0]))  # a pre-empted point at size 2
    assert spiked.times_us == [1.0, 3.0, 3.0, 7.0]


@pytest.mark.slow
def test_predict_validate_captures_every_round_and_logs_each_case(tmp_path: Path, cobench, capsys):
    """Each round captures afresh and judges that capture's prediction against a base and a changed run made
    right after it; the case lands in MLflow with the figures the table shows."""
    from conftest import mlflow_runs

    out, store = tmp_path / "val", tmp_path / "store"
    proc = cobench("trace", "predict-validate", "--out", str(out), "--rounds", "2", "--steps", "8", "--warmup", "2",
                   "--cases", "layers", "workload=llama", "workload.preset=tiny", f"results_dir={store}",
                   timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "bundle-0" / "meta.json").exists() and (out / "bundle-1" / "meta.json").exists()
    summary = json.loads((out / "validation.json").read_text())
    (row,) = summary["rows"]
    assert row["case"] == "layers" and row["changes"] == ["workload.n_layers=4"] and row["rounds"] == 2
    assert len(row["predicted_ratios"]) == len(row["base_ms"]) == len(row["changed_ms"]) == 2
    assert row["naive_ratio"] == 2.0 and 1.0 < row["predicted_ratio"] < 2.0  # embeddings and head are not layers
    assert row["prediction_error_pct"] == pytest.approx(
        100 * (row["predicted_ratios"][0] * row["base_ms"][0] / row["changed_ms"][0]
               + row["predicted_ratios"][1] * row["base_ms"][1] / row["changed_ms"][1] - 2) / 2)
    assert "layers" in proc.stdout and "mean absolute error" in proc.stdout
    # a one-process change is measured side by side in one process, each round's pair in its own record
    for r in range(2):
        pairs = [json.loads(p.read_text()) for p in sorted((out / "rounds").glob(f"layers-{r}-*-pair.json"))]
        # the pair's own figure: the ratio within rounds, and the changed step as the base's at that ratio
        assert pairs and pairs[-1]["base_ms"] == row["base_ms"][r]
        assert row["changed_ms"][r] == pytest.approx(pairs[-1]["base_ms"] * pairs[-1]["ratio"])
        assert pairs[-1]["rounds"] == 2 and len(pairs[-1]["base_round_ms"]) == 2  # 8 steps: two rounds of 10
        low, high = pairs[-1]["ratio_ci"]
        assert low <= pairs[-1]["ratio"] <= high and pairs[-1]["ratio"] == pytest.approx(math.exp(statistics.median(
            [math.log(c / b) for b, c in zip(pairs[-1]["base_round_ms"], pairs[-1]["changed_round_ms"], strict=True)])))
    err = refused(capsys, "trace", "measure-pair", "--out", str(tmp_path / "pair.json"), "workload=llama",
                  "--changed", "world_size=2")
    assert "one process" in err
    (run,) = [r for r in mlflow_runs(store) if r.info.run_name == "whatif-validate-llama-layers"]
    assert run.info.status == "FINISHED" and run.data.metrics["prediction_error_pct"] == pytest.approx(
        row["prediction_error_pct"]) and row["run_id"] == run.info.run_id
    fresh = tmp_path / "fresh"
    err = refused(capsys, "trace", "predict-validate", "--out", str(fresh), "--cases", "heads", "workload=llama",
                  "workload.preset=tiny", "tracking=off")
    assert "unknown case 'heads'" in err and "layers, batch, ranks" in err
    assert not (fresh / "bundle-0").exists()  # refused before any capture


def test_a_programs_own_bundle_says_once_what_it_can_predict_and_how_to_name_its_batch(tmp_path: Path):
    """A program captured with ``harness.traces.capture.capture``: without sizes in its config only the rank count
    can change, and every refused key says so (the same list, and how to name the batch); with its batch
    size named at capture, a batch change is predicted."""
    import torch
    from torch import nn

    from harness.traces.capture import capture
    from harness.whatif.changes import parse_changes
    from harness.whatif.costmodel import Calibration, Curve
    from harness.whatif.graph import load_graph
    from harness.whatif.predict import predict

    def captured(out: Path, config: dict | None) -> Path:
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with capture(out, steps=2, warmup=1, baseline_steps=2, config=config, announce=False) as cap:
            while not cap.done:
                with cap.step():
                    model(torch.randn(16, 32)).square().mean().backward()
                    opt.step()
                    opt.zero_grad()
        return out

    plain = load_graph(captured(tmp_path / "plain", None))
    for item in ("workload.n_layers=4", "workload.batch_size=32"):
        with pytest.raises(ValueError, match=r"supported: world_size; the capture's config names no batch size") as err:
            parse_changes(plain, [item])
        assert "config={'workload': {'batch_size': N" in str(err.value)
    assert parse_changes(plain, ["world_size=2"]).world_size == 2

    named = load_graph(captured(tmp_path / "named", {"workload": {"batch_size": 16}}))
    changes = parse_changes(named, ["workload.batch_size=32"])
    linear = Calibration("linear", 1, Curve([1.0, 1e12], [1.0, 1e12]), Curve([1.0, 1e12], [1.0, 1e12]))
    same, bigger = predict(named, changes.change.__class__(), linear), predict(named, changes.change, linear)
    assert same.predicted_step_ms < bigger.predicted_step_ms < 2 * same.predicted_step_ms
