"""workload=dlrm: config checks, planted data, the model's learning signal, and real runs (1 rank here; 2 ranks
in test_dlrm_codecs_suite.py, beside the codec suite whose runs they share)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from conftest import TINY, mlflow_runs
from torchrec.distributed.types import QuantizedCommCodecs

from workloads.base import PlatformUnsupported, RunContext
from workloads.dlrm import codec_registry
from workloads.dlrm.config import DLRMConfig
from workloads.dlrm.data import SyntheticCriteo, zipf_ranks
from workloads.dlrm.model import PRESETS, count_params, dense_training_flops
from workloads.dlrm.workload import DLRMWorkload, roc_auc

CPU = torch.device("cpu")


def context(world_size: int = 1, device: torch.device = CPU) -> RunContext:
    return RunContext(device=device, seed=7, world_size=world_size)


# -- configuration ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"preset": "huge"}, "'workload.preset'.*allowed values: tiny, a2a, mlperf_dcnv2"),
        ({"lr": -1.0}, "'workload.lr'"),
        ({"sharding": "diagonal"}, "'workload.sharding'.*allowed values: table_wise, column_wise, row_wise"),
        ({"comm_codec": "zstd"}, "'workload.comm_codec'.*allowed values: none, fp16, bf16, fp8, int8"),
        ({"zipf_exponent": -0.5}, "'workload.zipf_exponent'"),
        ({"auc_target": 0.4}, "'workload.auc_target'"),
        ({"num_tables": 3, "table_rows": [10, 20]}, "'workload.table_rows'.*num_tables is 3"),
        ({"embedding_dim": 6}, "multiple of 4"),
        ({"bottom_mlp": [64, 32]}, "bottom_mlp must end in embedding_dim=16"),
        ({"top_mlp": [64, 2]}, "top_mlp"),
        ({"train_batches": 0}, "'workload.train_batches'"),
        ({"data": "kaggle"}, "'workload.data'.*allowed values: synthetic, criteo_1tb"),
        ({"criteo_sparse": "two_hot"}, "'workload.criteo_sparse'.*allowed values: multi_hot, one_hot"),
        ({"criteo_id_check": "none"}, "'workload.criteo_id_check'.*allowed values: full, batch"),
        ({"eval_batches": None}, "'workload.eval_batches': null .* is for workload.data=criteo_1tb"),
    ],
)
def test_config_rejects_bad_values(overrides, message):
    with pytest.raises(ValueError, match=message):
        DLRMConfig(**overrides)


@pytest.mark.parametrize(
    ("overrides", "world_size", "message"),
    [
        ({"sharding": "row_wise"}, 2, "'workload.sharding': row_wise needs CUDA"),
        ({"sharding": "row_wise"}, 1, "'workload.sharding': row_wise needs CUDA"),
        ({"comm_codec": "fp8"}, 2, "'workload.comm_codec': comm_codec=fp8 does not run on CPU"),
        ({"comm_codec": "int8"}, 1, "'workload.comm_codec': comm_codec=int8 needs >1 rank"),
        ({"comm_codec": "fp16", "codec_options": {"x": 1}}, 2, "codec_options are for codecs registered"),
        ({"sharding": "column_wise"}, 8, "'workload.sharding': column_wise .* multiple of 32"),
        ({"sharding": "table_wise", "num_tables": 1}, 2, "'workload.sharding': table_wise .* 1 tables"),
        ({"batch_size": 513}, 2, "'workload.batch_size': 513 is not divisible by the world size 2"),
    ],
)
def test_workload_rejects_what_cannot_run_here(overrides, world_size, message):
    with pytest.raises(ValueError, match=message) as raised:
        DLRMWorkload(DLRMConfig(**overrides), context(world_size))
    # what this platform or launch cannot run is told apart from a wrong setting (a suite SKIPs the first)
    platform_bound = overrides.get("sharding") == "row_wise" or overrides.get("comm_codec") in ("fp8", "int8")
    assert isinstance(raised.value, PlatformUnsupported) == platform_bound


def test_mlperf_preset_has_the_reference_shape_and_builds_on_meta():
    shape = DLRMConfig(preset="mlperf_dcnv2").shape()
    assert shape.num_tables == 26 and shape.embedding_dim == 128 and shape.batch_size == 65_536
    assert shape.bottom_mlp == (512, 256, 128) and shape.top_mlp == (1024, 1024, 512, 256, 1)
    assert max(shape.table_rows) == 40_000_000
    embedding_params, _ = count_params(shape)  # on meta: no 100 GB allocation
    assert embedding_params == sum(shape.table_rows) * 128
    capped = DLRMConfig(preset="mlperf_dcnv2", max_table_rows=1_000_000).shape()
    assert max(capped.table_rows) == 1_000_000 and min(capped.table_rows) == 3


def test_flops_are_counted_forward_and_backward_and_scale_with_batch():
    shape = PRESETS["mlperf_dcnv2"]
    per_sample = dense_training_flops(shape, 1)
    assert dense_training_flops(shape, 8) == pytest.approx(8 * per_sample)
    # forward matmul FLOPs of one sample: bottom MLP, 3 low-rank DCN layers, top MLP
    width = shape.interaction_dim
    forward_macs = (13 * 512 + 512 * 256 + 256 * 128 + 3 * 2 * width * 512
                    + width * 1024 + 1024 * 1024 + 1024 * 512 + 512 * 256 + 256)
    # backward = input grads (all but the first layer) + weight grads: a bit under 2x forward
    assert 2.8 * 2 * forward_macs < per_sample <= 3 * 2 * forward_macs


@pytest.mark.parametrize(
    ("codec", "forward", "backward"),
    [
        ("fp16", torch.float16, torch.float16),
        ("bf16", torch.bfloat16, torch.bfloat16),
        ("int8", torch.uint8, torch.uint8),
    ],
)
def test_builtin_codecs_send_the_dtype_they_are_named_after_on_cpu(codec, forward, backward):
    (codecs,) = codec_registry.build_qcomm_registry(codec, CPU).values()  # CPU: the all-to-all only
    assert (codecs.forward.quantized_dtype, codecs.backward.quantized_dtype) == (forward, backward)
    assert codec_registry.build_qcomm_registry("none", CPU) is None


def test_custom_codecs_register_by_name_and_receive_their_options(monkeypatch):
    received = {}

    def factory(options, process_group):
        received.update(options=options, process_group=process_group)
        return QuantizedCommCodecs()

    monkeypatch.setitem(codec_registry.CUSTOM_CODECS, "eb", factory)
    config = DLRMConfig(comm_codec="eb", codec_options={"error_bound": 0.01})
    DLRMWorkload(config, context(world_size=2))  # options allowed for a custom codec
    registry = codec_registry.build_qcomm_registry("eb", CPU, {"error_bound": 0.01}, process_group="pg")
    assert list(registry) == ["POOLED_EMBEDDINGS_ALL_TO_ALL"]
    assert received == {"options": {"error_bound": 0.01}, "process_group": "pg"}


def test_codec_hooks_advance_the_schedule_and_report_stats():
    class ScheduledCodec(codec_registry.CustomCodec):  # one of ours: gets the schedule and reports its statistics
        def __init__(self):
            self.calls = []

        def set_iteration(self, step, loss=None):
            self.calls.append((step, loss))

        def stats_dict(self):
            return {"compression_ratio": 5.0, "last_bits": float("nan")}

    codecs = QuantizedCommCodecs()
    codecs.forward, codecs.backward = ScheduledCodec(), ScheduledCodec()
    registry = {"POOLED_EMBEDDINGS_ALL_TO_ALL": codecs}
    codec_registry.advance_codecs(registry, 0, None)
    codec_registry.advance_codecs(registry, 1, torch.tensor(0.5))
    assert codecs.forward.calls == codecs.backward.calls == [(0, None), (1, 0.5)]
    assert codec_registry.codec_metrics(registry) == {"codec_forward_compression_ratio": 5.0,
                                                      "codec_backward_compression_ratio": 5.0}
    # FBGEMM's codecs keep no stats
    assert codec_registry.codec_metrics(codec_registry.build_qcomm_registry("int8", CPU)) == {}


# -- data and quality ---------------------------------------------------------------------------


def test_zipf_ids_are_skewed_and_exponent_zero_is_uniform():
    g = torch.Generator().manual_seed(0)
    rows = 10_000
    skewed = torch.bincount(zipf_ranks(rows, 1.1, 200_000, g), minlength=rows)
    uniform = torch.bincount(zipf_ranks(rows, 0.0, 200_000, g), minlength=rows)
    top_1pct = rows // 100
    assert skewed.sort(descending=True).values[:top_1pct].sum() > 0.4 * 200_000
    assert uniform.sort(descending=True).values[:top_1pct].sum() < 0.02 * 200_000
    assert skewed[0] > skewed[10] > skewed[1000]  # rank 0 is the most popular


def test_batches_are_deterministic_per_seed_and_differ_across_streams():
    shape = PRESETS["tiny"]
    data = SyntheticCriteo(shape.table_rows, shape.multi_hot_sizes, shape.num_dense, 1.1, seed=0)

    def batch(seed):
        return data.batch(64, torch.Generator().manual_seed(seed))

    a, b, c = batch(1), batch(1), batch(2)
    assert torch.equal(a.sparse.values(), b.sparse.values()) and torch.equal(a.labels, b.labels)
    assert not torch.equal(a.sparse.values(), c.sparse.values())
    assert a.sparse.keys() == [f"cat_{i}" for i in range(8)]
    assert a.sparse.lengths().tolist() == list(itertools.chain.from_iterable([h] * 64 for h in shape.multi_hot_sizes))
    for t, rows in enumerate(shape.table_rows):
        assert 0 <= int(a.sparse[f"cat_{t}"].values().min()) and int(a.sparse[f"cat_{t}"].values().max()) < rows


def test_roc_auc_is_exact_with_ties():
    scores = torch.tensor([0.1, 0.4, 0.4, 0.8, 0.3, 0.4])
    labels = torch.tensor([0.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    pairs = [(s_p > s_n) + 0.5 * (s_p == s_n) for s_p, y_p in zip(scores, labels, strict=True) if y_p == 1
             for s_n, y_n in zip(scores, labels, strict=True) if y_n == 0]
    assert roc_auc(scores, labels) == pytest.approx(float(sum(pairs)) / len(pairs))
    assert math.isnan(roc_auc(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 1.0])))  # one class only


def test_planted_labels_are_learnable_and_the_model_reaches_the_target(one_thread):
    workload = DLRMWorkload(DLRMConfig(), context())
    workload.setup()
    assert workload.oracle_auc > 0.8  # the planted model itself separates clicks well
    quality = workload.evaluate()
    assert quality["auc"] < 0.6  # before training: chance
    # train until the target, evaluating every 10 steps: it takes ~100 steps, and float summation order
    # moves the AUC at a fixed step by more than the last few steps' gain, so the margin is the budget
    target, budget, steps = workload.quality_target(), 300, 0
    while steps < budget and not target.reached(quality["auc"]):
        for _ in range(10):
            assert workload.step().data_wait_s is not None  # the synthetic pool's lookup is timed too
        steps += 10
        quality = workload.evaluate()
    assert target.reached(quality["auc"]), f"AUC {quality['auc']:.5f} below {target.value:.5f} after {budget} steps"
    assert quality["auc"] > 0.75 and quality["log_loss"] < 0.6
    assert workload.flops_per_step() > 0


# -- end-to-end runs through the CLI ------------------------------------------------------------


def test_single_process_run_logs_auc_and_throughput(cobench, tmp_path):
    proc = cobench("run", "workload=dlrm", "platform.num_threads=1", *TINY)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (run,) = mlflow_runs(tmp_path / "results")
    assert run.info.status == "FINISHED"
    metrics = run.data.metrics
    assert 0.0 < metrics["auc"] <= 1.0 and metrics["throughput"] > 0 and metrics["log_loss"] > 0
    assert metrics["achieved_tflops"] > 0  # flops_per_step was counted
    assert metrics["data_wait_ms_p50"] >= 0  # the synthetic pool's lookup, timed like a real source's wait
    assert run.data.tags["throughput_unit"] == "samples/s"
    assert not any(name.startswith("a2a_") for name in metrics)  # one process: no all-to-all


def test_bad_codec_setup_fails_before_any_mlflow_run(cobench, tmp_path):
    proc = cobench("run", "workload=dlrm", "workload.comm_codec=int8", *TINY)
    assert proc.returncode != 0
    assert "comm_codec=int8 needs >1 rank" in proc.stderr + proc.stdout
    assert mlflow_runs(tmp_path / "results") == []


def test_bad_error_bound_options_are_refused_before_the_run():
    from workloads.dlrm.codec_registry import codec_problem

    for options, fragment in (({"eb": -1}, "eb must be"), ({"eb": float("nan")}, "eb must be"),
                              ({"mode": "fuzzy"}, "mode"), ({"bogus": 1}, "unknown compression options")):
        problem = codec_problem("eb", options)
        assert problem is not None and fragment in problem, (options, problem)
    assert codec_problem("eb", {"eb": 0.01, "packing": "agreed"}) is None
