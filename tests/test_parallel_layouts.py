"""Llama layouts on a device mesh (tensor, pipeline, sharded and replicated data parallelism, and a mixture of
experts split over expert- and tensor-parallel ranks) on CPU ranks with gloo: every layout trains like one rank
(same losses over 20 steps, same step-1 gradients), a DCP checkpoint saved in one layout loads in the others,
samples and FLOPs count once whatever the layout, each dimension's communication is measured, and a layout that
cannot work exits 2 naming its numbers before any process group exists."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import clean_env

from workloads.llama.args import PRESETS, training_flops_per_token
from workloads.llama.config import LlamaConfig
from workloads.llama.footprint import MetaModel, footprint
from workloads.llama.layout import Layout, ParallelConfig, check_model_fits, resolve_layout, stage_layers

WORKER = Path(__file__).resolve().parent / "layout_worker.py"
# float32 on CPU: the layouts sum the same numbers in other orders (sharded matmuls, reduce-scatters,
# microbatches), so they agree to rounding, not bit for bit. 1e-5 is ~10 float32 ulps of a loss near 6;
# a gradient entry is at most ~1e-2 here, and 1e-6 is ~100 ulps of it.
LOSS_TOL = 1e-5
GRAD_TOL = 1e-6
TWO_RANKS = ["tp=2", "pp=2", "dp_replicate=2", "tp=2,sequence_parallel=0",
             "pp=2,pp_schedule=gpipe,pp_microbatches=4,activation_checkpointing=1"]
FOUR_RANKS = ["dp_shard=2,tp=2", "dp_shard=2,pp=2", "tp=2,pp=2", "dp_replicate=2,dp_shard=2"]
# tiny_moe: experts over ep 2 and their width over tp 2; experts over ep 2 and held twice (edp 2) under HSDP;
# whole experts held by both replicas, their width over tp 2 without sequence parallelism
MOE_FOUR_RANKS = ["ep=2,tp=2", "dp_replicate=2,dp_shard=2,ep=2", "dp_replicate=2,tp=2,sequence_parallel=0"]


def _launch(ranks: int, *args: str) -> list[dict]:
    cmd = [sys.executable, str(WORKER), *args]
    if ranks > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--standalone", *cmd[1:]]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=clean_env())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]


def _reference(tmp_path_factory: pytest.TempPathFactory, preset: str) -> tuple[Path, dict]:
    grads = tmp_path_factory.mktemp("layouts") / "reference_grads.pt"
    (result,) = _launch(1, "--preset", preset, "--write-reference", str(grads))
    return grads, result


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """One rank's 20 steps and step-1 gradients."""
    return _reference(tmp_path_factory, "tiny")


@pytest.fixture(scope="module")
def moe_reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """One rank's 20 steps and step-1 gradients of the mixture of experts."""
    return _reference(tmp_path_factory, "tiny_moe")


def _assert_like_one_rank(one: dict, results: list[dict], layouts: list[str], preset: str) -> None:
    """Every layout's losses, step-1 gradients, eval loss, counted samples and FLOPs, and communication figures
    against one rank's, and the first layout's checkpoint loaded by the others; prints the errors."""
    assert len(results) == len(layouts)
    table = []
    for layout, result in zip(layouts, results, strict=True):
        loss_err = max(abs(a - b) for a, b in zip(result["losses"], one["losses"], strict=True))
        table.append((layout, loss_err, result["grad_max_err"]))
        assert loss_err <= LOSS_TOL, (layout, result["losses"], one["losses"])
        assert result["grad_max_err"] <= GRAD_TOL, (layout, result["grad_max_err"])
        assert result["grad_tensors_this_rank"] > 0
        assert abs(result["eval_loss"] - one["eval_loss"]) <= LOSS_TOL
        # the harness sums the ranks' samples and FLOPs: each sequence and the model's FLOPs count once
        assert result["samples_per_step"] == 8
        assert result["flops_per_step"] == pytest.approx(
            training_flops_per_token(replace(PRESETS[preset], n_layers=3), 64) * 8 * 64)
        # each dimension's communication, measured in the last warm-up step: in (0, 1) of the step, bytes moved
        dims = {"tp": "tp_comm_share", "pp": "pp_bubble_share", "dp": "dp_comm_share", "ep": "ep_comm_share"}
        present = {dim for dim in ("tp", "pp", "ep") if f"{dim} " in result["layout"]} | (
            {"dp"} if "dp_" in result["layout"] else set())
        assert {k for k in result["comm"] if k.endswith("_share")} == {dims[d] for d in present}, result["comm"]
        for dim in present:
            assert 0 < result["comm"][dims[dim]] < 1 and result["comm"][f"{dim}_comm_mb_per_step"] > 0
        # a MoE's experts saw the same load as on one rank (the bias moved alike everywhere), none dropped
        assert result["expert_load"] == pytest.approx(one["expert_load"], abs=1e-6)
        if "loaded_eval_loss" in result:  # the first layout's trained model, saved (DCP) and loaded in this one
            assert abs(result["loaded_eval_loss"] - results[0]["eval_loss"]) <= LOSS_TOL, layout
    assert sum("loaded_eval_loss" in r for r in results) == len(layouts) - 1
    # training really moved: the last loss is well below the first
    assert one["losses"][-1] < one["losses"][0] - 0.5
    print("\n".join(f"{name:66s} max |loss - 1 rank| {le:.2e}  step-1 grad max err {ge:.2e}" for name, le, ge in table))


@pytest.mark.parametrize(("ranks", "layouts"), [(2, TWO_RANKS), (4, FOUR_RANKS)], ids=["2 ranks", "4 ranks"])
def test_every_layout_trains_like_one_rank_and_loads_the_others_checkpoint(reference, tmp_path, ranks, layouts):
    grads, one = reference
    assert one["comm"] == {} and one["samples_per_step"] == 8
    results = _launch(ranks, "--reference", str(grads), "--checkpoint", str(tmp_path / "ckpt"), *layouts)
    _assert_like_one_rank(one, results, layouts, "tiny")


def test_moe_layouts_train_like_one_rank_and_load_the_others_checkpoint(moe_reference, tmp_path):
    """The mixture of experts with its experts split over ep ranks and their width over tp ranks (and held by
    several data-parallel ranks) trains like one rank: losses, step-1 gradients (the experts' gathered whole),
    the experts' load, and a checkpoint saved in one layout loads in the others."""
    grads, one = moe_reference
    assert one["expert_load"]["tokens_dropped"] == 0
    results = _launch(4, "--preset", "tiny_moe", "--reference", str(grads), "--checkpoint", str(tmp_path / "ckpt"),
                      *MOE_FOUR_RANKS)
    _assert_like_one_rank(one, results, MOE_FOUR_RANKS, "tiny_moe")
    # the planner's parameter bytes per device are what the busiest rank holds (experts left out of FSDP2)
    args = replace(PRESETS["tiny_moe"], n_layers=3)
    meta = MetaModel.build(args)
    for layout, result in zip(MOE_FOUR_RANKS, results, strict=True):
        values = {key: int(value) for key, value in (item.split("=") for item in layout.split(","))}
        resolved = resolve_layout(ParallelConfig(**values), 4, args, batch_size=8, seq_len=64)
        assert footprint(meta, resolved, 8, 64, compute_bytes=4).params == result["param_bytes_max_rank"], layout


@pytest.mark.parametrize(("world", "preset", "parallel", "expected"), [
    (4, "tiny", {"tp": 2, "pp": 2, "dp_shard": 2}, "pp 2 × dp_replicate 1 × dp_shard 2 × tp 2 = 8 ranks, but the world "
                                                   "size is 4"),
    (3, "tiny", {"tp": 3}, "n_heads 4 is not divisible by tp 3"),
    (3, "tiny", {"pp": 3}, "2 layers cannot be split into 3 stages: each stage needs at least one layer"),
    (2, "tiny", {"pp": 2, "pp_microbatches": 1}, "1 microbatches for 2 stages"),
    (3, "tiny_moe", {"ep": 3}, "8 experts cannot be split evenly over ep 3 ranks"),
    (4, "tiny_moe", {"tp": 2, "ep": 4}, "ep 4 must divide the data-parallel ranks (2)"),
    (4, "tiny_moe", {"pp": 2}, "pp 2 with a mixture of experts: its layers are not split into pipeline stages"),
    (4, "tiny", {"tp": 2, "dp_replicate": 3}, "dp_replicate 3 × tp 2 × pp 1 = 6 does not divide the world size 4"),
])
def test_a_layout_that_cannot_work_names_its_numbers(monkeypatch, world, preset, parallel, expected):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(ValueError, match="invalid config 'workload.parallel") as err:
        LlamaConfig(preset=preset, batch_size=12, parallel=ParallelConfig(**parallel))
    assert expected in str(err.value)


def test_experts_whose_width_tp_does_not_divide_are_refused_with_the_numbers():
    # every dense width divisible by tp 3, the experts' 64 not
    args = replace(PRESETS["tiny_moe"], dim=96, n_heads=6, n_kv_heads=3, vocab_size=516, ffn_hidden_dim=192)
    with pytest.raises(ValueError, match="the experts' width 64 is not divisible by tp 3"):
        check_model_fits(Layout(dp_shard=1, tp=3), args, batch_size=8, seq_len=66)


@pytest.mark.parametrize(("n_layers", "pp", "sizes"), [
    (126, 16, [7] + [8] * 14 + [7]), (32, 4, [8, 8, 8, 8]), (3, 2, [2, 1]), (5, 4, [1, 2, 1, 1]), (4, 4, [1] * 4)])
def test_stages_split_the_layers_as_evenly_as_they_go_the_ends_lighter(n_layers, pp, sizes):
    stages = [stage_layers(n_layers, pp, s) for s in range(pp)]
    assert [len(s) for s in stages] == sizes
    assert [i for s in stages for i in s] == list(range(n_layers))  # every layer once, in order


def test_cobench_run_refuses_a_bad_layout_before_any_process_group(cobench):
    """Four ranks announced by the launcher, a layout for eight: exit 2 at once (no rendezvous is attempted:
    nothing here could answer one)."""
    proc = cobench("run", "workload=llama", "workload.parallel.tp=2", "workload.parallel.pp=2",
                   "workload.parallel.dp_shard=2", extra_env={"WORLD_SIZE": "4", "RANK": "0", "LOCAL_RANK": "0"},
                   timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "8 ranks, but the world size is 4" in proc.stderr



def test_cobench_run_on_a_mesh_logs_the_layout_and_its_communication(tmp_path):
    """`cobench run` under torchrun with tp 2: one FINISHED MLflow run tagged with its layout, the
    tensor-parallel share logged, and MFU from the model's FLOPs counted once."""
    from conftest import mlflow_runs

    results = tmp_path / "results"
    peak = 1e12  # declared, so MFU is computed (its value is not the point: how the FLOPs are counted is)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", "-m", "suite.cli",
         "run", "workload=llama", "workload.parallel.tp=2", "runner.steps=4", "runner.warmup_steps=2",
         "runner.repetitions=1", "runner.eval_interval=0", "platform=cpu", f"+platform.peak_flops.float32={peak}",
         "runner.progress=false", f"results_dir={results}"],
        capture_output=True, text=True, timeout=600, env=clean_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (run,) = mlflow_runs(results)
    metrics = run.data.metrics
    assert run.info.status == "FINISHED" and run.data.tags["layout"] == "tp 2"
    assert 0 < metrics["tp_comm_share"] < 1 and metrics["tp_comm_mb_per_step"] > 0
    assert metrics["throughput"] == pytest.approx(64 * metrics["samples_per_s"], rel=1e-6)
    achieved = training_flops_per_token(PRESETS["tiny"], 64) * metrics["throughput"]
    assert metrics["mfu"] == pytest.approx(achieved / (peak * 2), rel=1e-3)
