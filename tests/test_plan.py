"""The layout planner: its counts against the presets, its memory against what a step really holds, and
``cobench plan`` as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import clean_env

from harness.config import compose_config, to_run_config
from harness.running.memory_probe import measure_step_memory
from suite.cli import main
from workloads.llama.args import PRESETS, count_total_params
from workloads.llama.footprint import MetaModel, footprint, layer_saved_bytes
from workloads.llama.layout import Layout
from workloads.llama.model import build_model

TINY_RUN = ["platform=cpu", "workload=llama", "workload.train_batches=2", "workload.eval_batches=1"]


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_the_meta_model_has_the_analytic_parameter_count(preset):
    assert MetaModel.build(PRESETS[preset]).total_params() == count_total_params(PRESETS[preset])


@pytest.mark.parametrize(("preset", "published_billions"), [("llama3_8b", 8.03), ("llama3_70b", 70.6),
                                                            ("llama3_405b", 405.9)])
def test_parameter_counts_match_the_published_sizes(preset, published_billions):
    """The sizes Hugging Face's model pages give the checkpoints (8.03 B, 70.6 B), and 405.9 B for the 405B,
    whose shape is the published config.json's (hidden 16384, intermediate 53248, 126 layers, 8 KV heads)."""
    total = MetaModel.build(PRESETS[preset]).total_params()
    assert round(total / 1e9, 2 if total < 1e10 else 1) == published_billions


@pytest.mark.parametrize("autocast", [False, True])
def test_a_blocks_saved_activations_are_what_autograd_saves(autocast):
    """The per-layer formula, byte for byte against the tensors autograd keeps for one block's backward (the
    block input included; under bf16 autocast within 1 %: RoPE's tables cast per call are left out)."""
    args = PRESETS["tiny"]
    model = build_model(args, "cpu", seed=0)
    block, x = model.layers[0], torch.randn(8, 64, args.dim, requires_grad=True)
    owned = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in owned:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x, model.rope_cos[:64], model.rope_sin[:64])
    matrices = sum(p.numel() for p in block.parameters() if p.dim() > 1)
    predicted = layer_saved_bytes(args, 0, 8 * 64, 2 if autocast else 4, weight_elements=matrices)
    assert predicted == pytest.approx(sum(saved.values()), rel=0.01 if autocast else 1e-9)


def _measured_vs_predicted(measured_bytes: int, layout: Layout, batch_size: int = 8, seq_len: int = 64,
                           preset: str = "tiny") -> float:
    predicted = footprint(MetaModel.build(PRESETS[preset]), layout, batch_size, seq_len, 4, device_kind="cpu").peak
    return predicted / measured_bytes - 1


def test_the_planned_memory_of_one_rank_is_the_measured_peak(tmp_path):
    """The planner's peak for tiny on one CPU rank within 10 % of the tensor bytes a training step holds at
    its peak (MemTracker, harness/running/memory_probe.py)."""
    cfg = to_run_config(compose_config(["tracking=off", *TINY_RUN]))
    (measured,) = measure_step_memory(cfg, tmp_path)
    assert abs(_measured_vs_predicted(measured.peak_bytes, Layout())) < 0.10, measured


TWO_RANK_LAYOUTS = {  # overrides → the layout they make
    "dp_shard 2": (["workload.parallelism=fsdp2"], Layout(dp_shard=2)),
    "tp 2": (["workload.parallel.tp=2"], Layout(dp_shard=1, tp=2)),
    "pp 2 1f1b": (["workload.parallel.pp=2"], Layout(dp_shard=1, pp=2, pp_microbatches=4)),
    # a mixture of experts on the mesh: its experts split over ep, outside FSDP2
    "tiny_moe dp_replicate 2 × ep 2": (["workload.preset=tiny_moe", "workload.parallel.dp_replicate=2",
                                        "workload.parallel.ep=2"], Layout(dp_replicate=2, dp_shard=1, ep=2)),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(TWO_RANK_LAYOUTS))
def test_the_planned_memory_of_two_ranks_is_the_measured_peak(tmp_path, layout):
    """2 gloo ranks: the fullest rank's measured peak within 10 % of the plan's (the tensor- and pipeline-parallel
    layouts where the workload builds them on a device mesh)."""
    overrides, planned = TWO_RANK_LAYOUTS[layout]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           "-m", "harness.running.memory_probe", *TINY_RUN, *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=clean_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [r["world_size"] for r in ranks] == [2, 2]
    preset = next((o.split("=")[1] for o in overrides if o.startswith("workload.preset=")), "tiny")
    assert abs(_measured_vs_predicted(max(r["peak_bytes"] for r in ranks), planned, preset=preset)) < 0.10, ranks


def test_plan_llama3_8b_on_eight_80gb_devices(capsys):
    code = main(["plan", "workload=llama", "workload.preset=llama3_8b", "workload.seq_len=8192",
                 "platform.devices=8", "platform.device_memory_gb=80"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "8.03 B parameters" in out and "fits in 72.0 GB, leaving 10%" in out
    fitting = out.split("fitting layouts")[1].split("closest layouts")[0]
    assert "dp_shard 8 " in fitting  # plain FSDP over the 8 devices fits with activation checkpointing
    assert "step time: not predicted" in out


def _plan_json(capsys, *overrides: str) -> tuple[int, dict]:
    code = main(["plan", "--json", "workload=llama", *overrides])
    return code, json.loads(capsys.readouterr().out)


def test_plan_llama3_405b_on_512_80gb_devices(capsys):
    """At Llama 3's 8k sequences and 512 × 8k tokens a step: plain FSDP (one sequence per device) fits not even
    with activation checkpointing; tp 8 within a node and FSDP over 64, with 8 accumulated microbatches, does."""
    machine = ["workload.preset=llama3_405b", "workload.seq_len=8192", "workload.batch_size=512",
               "platform.devices=512", "platform.device_memory_gb=80"]
    code, plan = _plan_json(capsys, *machine)
    fsdp = {c["describe"]: c for c in plan["candidates"]}["dp_shard 512"]
    assert code == 1 and not fsdp["fits"] and not fsdp["fits_with_activation_checkpointing"]
    code, plan = _plan_json(capsys, *machine, "workload.grad_accum_steps=8")
    fitting = {c["describe"] for c in plan["candidates"] if c["fits_with_activation_checkpointing"]}
    assert code == 0 and "dp_shard 64 × tp 8" in fitting

def test_plan_llama3_405b_the_way_it_was_trained(capsys):
    """Llama 3 405B's own tp 8 × pp 16: its 126 layers on 16 stages are uneven (the first and last hold 7, the others
    8); with 128 microbatches of one sequence, 1F1B keeps at most 16 in flight and it fits with checkpointing."""
    code, plan = _plan_json(capsys, "workload.preset=llama3_405b", "workload.seq_len=8192", "workload.batch_size=512",
                            "workload.parallel.pp_microbatches=128", "platform.devices=512",
                            "platform.device_memory_gb=80")
    candidates = {c["describe"]: c for c in plan["candidates"]}
    trained = candidates["pp 16 × dp_shard 4 × tp 8"]
    assert code == 0 and trained["fits_with_activation_checkpointing"] and not trained["fits"]
    assert trained["bubble"] == pytest.approx(15 / 143)  # (pp - 1) / (microbatches + pp - 1)


@pytest.mark.parametrize(("overrides", "message"), [
    (["platform.devices=0"], "platform.devices': got 0, must be >= 1"),
    (["platform.devices=2", "platform.device_memory_gb=-1"], "platform.device_memory_gb': got -1.0"),
    (["workload=dlrm", "platform.devices=2"], "workload dlrm has no layout planner"),
    (["platform.devices=3"], "batch_size': 8 sequences cannot be split over 3 data-parallel ranks"),
])
def test_bad_input_exits_2_naming_the_numbers(capsys, overrides, message):
    assert main(["plan", "workload=llama", *overrides]) == 2
    assert message in capsys.readouterr().err


def test_no_fitting_layout_exits_1_with_the_closest(capsys):
    code = main(["plan", "workload=llama", "platform.devices=2", "platform.device_memory_gb=0.001"])
    captured = capsys.readouterr()
    assert code == 1
    assert "closest layouts that do not fit" in captured.out and "> 0.0 GB usable" in captured.out
    assert "no layout of 2 devices fits" in captured.err
