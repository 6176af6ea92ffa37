"""workload=seqrec: jagged data path, balancer, cost model, simulator, and real runs (1 and 2 ranks)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import TINY, clean_env, mlflow_runs

from harness.config import compose_config, to_run_config
from workloads.base import RunContext
from workloads.seqrec.balance import (
    BALANCERS,
    CostModel,
    CostModelError,
    PartitionError,
    bubble_fraction,
    even_split,
    fit_cost_model,
    karmarkar_karp_partition,
    partition,
)
from workloads.seqrec.batch import build_batch
from workloads.seqrec.config import SeqRecConfig
from workloads.seqrec.data import (
    FEATURES,
    LengthDistribution,
    PlantedPreferences,
    validate_lengths,
)
from workloads.seqrec.model import PRESETS, SequenceEncoder, build_embedding_collection
from workloads.seqrec.simulate import simulate_scaling
from workloads.seqrec.workload import SeqRecWorkload

CPU = torch.device("cpu")
SHAPE = PRESETS["tiny"]
# Fast in-process runs: no simulation, no timing-based fit unless a test asks for it.
QUICK = {"simulate_batches": 0, "cost_model": "tokens", "train_batches": 4, "eval_batches": 2}


def lognormal(max_len: int = 128) -> LengthDistribution:
    return LengthDistribution("lognormal", max_len, median=16.0, sigma=1.0)


def workload(tmp_path: Path, **overrides) -> SeqRecWorkload:
    ctx = RunContext(device=CPU, seed=1, work_dir=tmp_path)
    return SeqRecWorkload(SeqRecConfig(**(QUICK | overrides)), ctx)


# -- config ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("workload.balancer=round_robin", "allowed values: greedy, greedy_swap, karmarkar_karp"),
        ("workload.length_distribution=pareto", "allowed values: lognormal, zipf"),
        ("workload.cost_model=guess", "allowed values: fit, tokens"),
        ("workload.max_tokens_per_rank=64", "at least max_len (512)"),
        ("workload.length_median=600", "must be <= max_len 512"),
        ("workload.num_heads=3", "not divisible by num_heads 3"),
    ],
)
def test_bad_config_is_rejected_naming_the_key(override, fragment):
    with pytest.raises(ValueError) as err:
        to_run_config(compose_config(["workload=seqrec", override]))
    key = override.split("=")[0]
    assert f"invalid config '{key}'" in str(err.value) or "invalid config 'workload'" in str(err.value)
    assert fragment in str(err.value)


def test_yaml_lists_every_field_with_the_schema_default():
    text = (Path(__file__).parent.parent / "conf/workload/seqrec.yaml").read_text()
    values = yaml.safe_load(text)["workload"]  # (the file also sets the runner's default steps)
    fields = {f.name: f for f in dataclasses.fields(SeqRecConfig)}
    assert set(values) - {"defaults"} == set(fields)
    defaults = SeqRecConfig()
    for name in fields:
        if name != "stats_skip_steps":  # follows runner.warmup_steps by interpolation
            assert values[name] == getattr(defaults, name), name
    cfg = to_run_config(compose_config(["workload=seqrec", "runner.warmup_steps=5"]))
    assert cfg.workload.stats_skip_steps == 5


def test_the_accelerator_preset_validates():
    cfg = to_run_config(compose_config(["workload=seqrec", "workload.preset=base"]))
    assert cfg.workload.shape().max_len == 1024 and cfg.workload.shape().num_items % cfg.workload.num_topics == 0


def test_a_batch_smaller_than_the_world_is_refused_before_anything_runs():
    ctx = RunContext(device=CPU, seed=0, rank=0, world_size=8)
    with pytest.raises(ValueError, match=r"'workload.batch_size': 4 .* 8 ranks"):
        SeqRecWorkload(SeqRecConfig(batch_size=4), ctx)


# -- data -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["lognormal", "zipf"])
def test_lengths_are_heavy_tailed_and_capped(kind):
    dist = LengthDistribution(kind, max_len=128, median=16.0, sigma=1.0, zipf_exponent=1.2)
    lengths = dist.sample(20_000, np.random.default_rng(0))
    assert lengths.min() >= 2 and lengths.max() <= 128
    assert abs(dist.pmf().sum() - 1) < 1e-9
    assert lengths.mean() > 1.3 * np.median(lengths)  # right-skewed
    assert np.quantile(lengths, 0.99) > 5 * np.median(lengths)  # a long tail
    if kind == "lognormal":  # the tail beyond max_len is capped onto max_len, not dropped
        assert (lengths == 128).mean() > 0.005


def test_histories_are_deterministic_and_bad_lengths_are_refused():
    prefs = PlantedPreferences(500, 3, 10, 4, 0.9, seed=0)
    lengths = lognormal().sample(64, np.random.default_rng(1))
    first = prefs.histories(lengths, np.random.default_rng(2))
    again = PlantedPreferences(500, 3, 10, 4, 0.9, seed=0).histories(lengths, np.random.default_rng(2))
    assert np.array_equal(first.items, again.items) and np.array_equal(first.actions, again.actions)
    assert first.items.size == lengths.sum() and first.items.max() < 500
    with pytest.raises(ValueError, match="above workload.max_len=128"):
        validate_lengths([5, 300], max_len=128)
    with pytest.raises(ValueError, match="at least 2"):
        validate_lengths([5, 0], max_len=128)
    with pytest.raises(ValueError, match="no history"):
        validate_lengths([], max_len=128)


def test_train_lengths_are_the_batches_a_run_trains_on_and_a_held_batch_repeats(tmp_path):
    """What-if prediction reads ``train_lengths(seed)`` as the data a configuration trains on, and a capture
    holds the batch so its op-by-op timed steps run the traced step's length buckets."""
    w = workload(tmp_path, train_batches=6)
    w.setup()
    assert [e.lengths.tolist() for e in w.schedule] == [b.tolist() for b in w.config.train_lengths(w.ctx.seed)]
    assert w.config.train_lengths(w.ctx.seed + 1)[0].tolist() != w.schedule[0].lengths.tolist()
    w.step()
    w.hold_batch(True)
    held = [w.step().tokens for _ in range(4)]
    w.hold_batch(False)
    after = [w.step().tokens for _ in range(4)]
    assert len(set(held)) == 1, held
    assert len(set(after)) > 1, after  # the cycle again
    w.teardown()


def test_planted_preferences_are_learnable(tmp_path):
    """The oracle ranks far above chance, and a short training run already does better than chance."""
    w = workload(tmp_path, train_batches=8)
    w.setup()
    chance = 10 / SHAPE.num_items
    assert w.oracle_hr > 20 * chance
    before = w.evaluate()["hr_at_10"]
    for _ in range(50):
        w.step()
    after = w.evaluate()
    assert after["hr_at_10"] > 4 * chance and after["hr_at_10"] > before
    assert 0 < after["ndcg_at_10"] <= after["hr_at_10"]


# -- jagged path ----------------------------------------------------------------------------------


def test_kjt_round_trip_through_the_embedding_collection():
    prefs = PlantedPreferences(500, 3, 10, 4, 0.9, seed=0)
    rng = np.random.default_rng(0)
    histories = prefs.histories(np.array([3, 9, 2, 5]), rng)
    negatives = rng.integers(500, size=(4, 6))
    batch = build_batch(histories, negatives, num_targets=15, split="even", index=0, max_len=128)
    kjt = batch.features
    assert kjt.keys() == list(FEATURES) and batch.samples == 4
    assert kjt["item_ids"].lengths().tolist() == [9, 5, 3, 2]  # longest first, no padding
    order = [1, 3, 0, 2]
    assert kjt["item_ids"].values().tolist() == histories.select(order).items.tolist()
    assert kjt["actions"].values().tolist() == histories.select(order).actions.tolist()
    assert kjt["negatives"].values().tolist() == negatives[order].reshape(-1).tolist()
    collection = build_embedding_collection(SHAPE, CPU)
    out = collection(kjt)
    table = collection.embeddings["item"].weight
    assert torch.equal(out["item_ids"].values(), table[kjt["item_ids"].values()])
    assert torch.equal(out["negatives"].values(), table[kjt["negatives"].values()])
    assert out["item_ids"].lengths().tolist() == [9, 5, 3, 2]


def test_encoder_is_causal_and_blind_to_other_histories():
    """No padding leaks: a history's outputs are the same alone or padded beside a longer one."""
    torch.manual_seed(0)
    encoder = SequenceEncoder(SHAPE).eval()
    lengths = torch.tensor([70, 33, 12, 9, 2])  # 12 and 9 share an attention bucket: 9 is padded to 12
    x = torch.randn(int(lengths.sum()), SHAPE.embedding_dim)
    together = encoder(x, lengths)
    alone = encoder(x[115:124], torch.tensor([9]))
    torch.testing.assert_close(together[115:124], alone, atol=1e-5, rtol=1e-5)
    perturbed = x.clone()
    perturbed[10] += torch.randn(SHAPE.embedding_dim)
    changed = (encoder(perturbed, lengths) - together).abs().sum(dim=1) > 1e-6
    assert torch.equal(torch.nonzero(changed).squeeze(1), torch.arange(10, 70))


def test_gradients_do_not_depend_on_the_partition(tmp_path):
    """Loss sums divided by the global target count: two shares add up to the full batch's gradient."""
    from torchrec.sparse.jagged_tensor import JaggedTensor

    w = workload(tmp_path)
    w.setup()
    histories, negatives = w.train_set[0]
    targets = int(histories.lengths.sum()) - histories.lengths.size

    def dense_grads(shares: list[np.ndarray]) -> torch.Tensor:
        w.head.zero_grad()
        for share in shares:
            batch = build_batch(histories.select(share), negatives[share], targets, "x", 0, SHAPE.max_len)
            with torch.no_grad():  # fixed embeddings: the tables' in-backward optimizer stays out of it
                looked_up = w.model.embeddings(batch.features)
            embeddings = {k: JaggedTensor(values=v.values().clone().requires_grad_(), lengths=v.lengths())
                          for k, v in looked_up.items()}
            loss, _ = w.head(embeddings, batch)
            loss.backward()
        return torch.cat([p.grad.flatten() for p in w.head.parameters()])

    full = dense_grads([np.arange(histories.lengths.size)])
    shares = partition(histories.lengths, CostModel.tokens(), 2, "karmarkar_karp")
    torch.testing.assert_close(dense_grads(shares), full, atol=1e-6, rtol=1e-4)


# -- balancer -------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", BALANCERS)
def test_balancer_properties_over_random_batches(method):
    rng = np.random.default_rng(7)
    model = CostModel(a=2e-8, b=1.2e-5, c=4e-5, fixed=3e-3)
    for _ in range(60):
        world = int(rng.choice([2, 3, 4, 8, 16]))
        n = int(rng.integers(world, 12 * world))
        lengths = lognormal(256).sample(n, rng)
        budget = int(np.ceil(n / world)) * 256 if rng.random() < 0.5 else None
        parts = partition(lengths, model, world, method, budget)
        merged = np.concatenate(parts)
        assert np.array_equal(np.sort(merged), np.arange(n)), "a sample was lost or duplicated"
        assert all(part.size > 0 for part in parts)
        even = model.rank_times(lengths, even_split(n, world)).max()
        assert model.rank_times(lengths, parts).max() <= even + 1e-15
        if budget is not None:
            assert max(lengths[p].sum() for p in parts) <= budget


def test_balancing_removes_most_of_a_skewed_imbalance():
    lengths = np.array([128, 120, 100, 90] + [4] * 28)  # the long ones all land on rank 0 when split evenly
    model = CostModel(a=1e-8, b=1e-5, c=1e-5)
    even = bubble_fraction(model.rank_times(lengths, even_split(32, 2)))
    balanced = bubble_fraction(model.rank_times(lengths, partition(lengths, model, 2, "karmarkar_karp")))
    assert even > 0.3 and balanced < 0.01


def test_impossible_partitions_raise_clear_errors():
    model = CostModel.tokens()
    with pytest.raises(PartitionError, match="3 samples cannot give each of 4 ranks"):
        partition([5, 6, 7], model, 4, "greedy")
    with pytest.raises(PartitionError, match="exceeds the budget of 100 tokens"):
        partition([120, 5, 6, 7], model, 2, "greedy", token_budget=100)
    with pytest.raises(PartitionError, match="no rank has room"):
        partition([90, 90, 90, 5], model, 2, "greedy", token_budget=100)


def test_local_swaps_finish_what_karmarkar_karp_leaves():
    costs = [8, 7, 6, 5, 4]  # the textbook case: differencing alone ends 16 / 14, the optimum is 15 / 15
    plain = karmarkar_karp_partition(np.array(costs, dtype=float), 2)
    assert sorted(sum(costs[i] for i in part) for part in plain) == [14, 16]
    refined = partition(costs, CostModel(a=0.0, b=1.0, c=0.0), 2, "karmarkar_karp")
    assert sorted(sum(costs[i] for i in part) for part in refined) == [15, 15]


# -- cost model -----------------------------------------------------------------------------------


def test_cost_model_fit_recovers_measured_coefficients():
    rng = np.random.default_rng(0)
    true = CostModel(a=3e-8, b=1e-5, c=5e-5, fixed=2e-3)
    batches = [lognormal().sample(int(rng.integers(4, 40)), rng) for _ in range(20)]
    times = [true.rank_times(b, [np.arange(b.size)])[0] * (1 + 0.01 * rng.standard_normal()) for b in batches]
    fit = fit_cost_model(batches, times, max_len=128)
    assert fit.source == "fit" and fit.r2 > 0.99 and min(fit.a, fit.b, fit.c, fit.fixed) >= 0
    fresh = [lognormal().sample(16, rng) for _ in range(10)]
    predicted = [fit.rank_times(b, [np.arange(b.size)])[0] for b in fresh]
    np.testing.assert_allclose(predicted, [true.rank_times(b, [np.arange(b.size)])[0] for b in fresh], rtol=0.03)
    assert fit.b == pytest.approx(true.b, rel=0.2)


def test_unusable_fits_are_refused():
    rng = np.random.default_rng(0)
    batches = [lognormal().sample(16, rng) for _ in range(12)]
    with pytest.raises(CostModelError, match="R²"):
        fit_cost_model(batches, rng.uniform(1e-3, 2e-3, size=12), max_len=128)
    with pytest.raises(CostModelError, match="finite and positive"):
        fit_cost_model(batches, [1e-3] * 11 + [float("nan")], max_len=128)
    sized = [lognormal().sample(int(n), rng) for n in rng.integers(4, 40, size=12)]
    shrinking = [5e-3 - 2e-6 * b.sum() for b in sized]  # more tokens, less time: no usable cost per sample
    with pytest.raises(CostModelError, match="not positive"):
        fit_cost_model(sized, shrinking, max_len=128, min_r2=0.0)


def test_a_failed_fit_falls_back_to_tokens_and_says_so(tmp_path):
    w = workload(tmp_path, cost_model="fit", cost_model_min_r2=1.0, cost_model_repeats=1, batch_size=8)
    w.setup()
    assert w.cost_model.source == "tokens" and "R²" in w.cost_model_error
    w.step()
    metrics = w.extra_metrics()
    assert metrics["cost_model_fitted"] == 0.0 and metrics["cost_model_b_us"] == 1.0


# -- simulator ------------------------------------------------------------------------------------


def test_simulated_even_bubbles_grow_with_ranks_and_balancing_removes_them():
    model = CostModel(a=2e-8, b=1.2e-5, c=4e-5, fixed=3e-3)
    predictions = simulate_scaling(model, lognormal().sample, [8, 32, 256], per_rank_batch=16,
                                   method="greedy_swap", batches=2)
    even = [p.bubble_even for p in predictions]
    assert even[0] < even[-1]
    assert all(p.bubble_balanced < 0.1 * p.bubble_even for p in predictions)
    assert predictions[-1].bubble_reduction >= 0.903 and predictions[-1].throughput_gain > 0


def test_simulation_agrees_with_a_direct_computation():
    model = CostModel(a=0.0, b=1.0, c=1.0, fixed=2.0)

    def fixed_lengths(n: int, rng: np.random.Generator) -> np.ndarray:
        return np.array([10, 2, 2, 2] * (n // 4))

    (prediction,) = simulate_scaling(model, fixed_lengths, [2], per_rank_batch=4, method="karmarkar_karp", batches=1)
    assert prediction.bubble_even == 0.0  # both ranks get [10, 2, 2, 2]
    (skewed,) = simulate_scaling(model, lambda n, rng: np.array([10] * (n // 2) + [2] * (n // 2)), [2], 4,
                                 "karmarkar_karp", batches=1)
    # even: [10]*4 → 2 + 44 = 46 and [2]*4 → 2 + 12 = 14; bubble = (46 - 14) / (2 · 46)
    assert skewed.bubble_even == pytest.approx(32 / 92)
    # balanced: two 10s and two 2s each → 2 + 22 + 6 = 30 on both
    assert skewed.bubble_balanced == 0.0 and skewed.step_time_balanced_s == 30.0


# -- real runs ------------------------------------------------------------------------------------

QUICK_RUN = [*TINY, "workload=seqrec", "workload.simulate_world_sizes=[8,256]", "workload.simulate_batches=1"]


def test_single_process_cli_run(cobench, tmp_path):
    proc = cobench("run", *QUICK_RUN)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (run,) = mlflow_runs(tmp_path / "results")
    assert run.info.status == "FINISHED"
    assert run.data.tags["workload"] == "seqrec" and run.data.tags["throughput_unit"] == "samples/s"
    metrics = run.data.metrics
    assert {"hr_at_10", "ndcg_at_10", "throughput", "tokens_per_s", "step_time_ms_p50",
            "sim_bubble_reduction_at_256", "compute_time_ms_rank0"} <= set(metrics)
    assert metrics["throughput"] > 0 and 0 <= metrics["hr_at_10"] <= 1
    assert "bubble_fraction" not in metrics  # one rank: nothing to wait for


def test_two_rank_run_refuses_a_batch_that_cannot_fill_every_rank(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", "-m", "suite.cli",
           "run", f"results_dir={tmp_path / 'results'}", *QUICK_RUN, "workload.batch_size=1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=clean_env(), cwd=tmp_path)
    assert proc.returncode != 0  # and no hang: both ranks refuse before any collective
    assert "invalid config 'workload.batch_size': 1 cannot give each of the 2 ranks a history" in proc.stderr


@pytest.mark.parametrize("overlap", [True, False], ids=["TrainPipelineSparseDist", "TrainPipelineBase"])
def test_two_rank_run_with_balancing(tmp_path, calibration_cache, overlap):
    results = tmp_path / "results"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
        "-m", "suite.cli", "run", f"results_dir={results}", f"platform.calibration_cache={calibration_cache}",
        *QUICK_RUN, "workload.balance=true", "workload.compare_even=true", f"workload.overlap={str(overlap).lower()}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=clean_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (run,) = mlflow_runs(results)
    assert run.info.status == "FINISHED" and run.data.tags["world_size"] == "2"
    metrics = run.data.metrics
    bubbles = {"bubble_fraction", "bubble_fraction_even", "sim_bubble_fraction", "sim_bubble_fraction_even",
               "throughput_gain", "compute_time_ms_rank0", "compute_time_ms_rank1"}
    assert bubbles <= set(metrics)
    assert 0 <= metrics["bubble_fraction"] < 1 and 0 <= metrics["bubble_fraction_even"] < 1
    assert metrics["max_rank_tokens"] <= metrics["token_budget_per_rank"]
    assert metrics["hr_at_10"] >= 0 and metrics["throughput"] > 0
    (step_log,) = (results / "runs").glob("*/seqrec_steps_seed*.json")
    assert {"even", "karmarkar_karp"} == {step["split"] for step in json.loads(step_log.read_text())["steps"]}
