"""Config composition and validation: bad input fails before anything runs, naming the key."""

from __future__ import annotations

import pytest
import torch

from harness.config import compose_config, to_run_config
from harness.identity import config_hash
from suite.runner import plan_suite
from workloads import discover
from workloads.base import RunContext


def test_default_config_composes_to_llama_tiny():
    cfg = to_run_config(compose_config([]))
    assert cfg.workload.name == "llama"
    assert cfg.workload.preset == "tiny"
    assert cfg.results_dir == "results"
    assert cfg.tracking.enabled and cfg.tracking.uri is None


def test_overrides_reach_the_workload():
    cfg = to_run_config(compose_config(["workload.batch_size=4", "runner.steps=7", "seed=3"]))
    assert (cfg.workload.batch_size, cfg.runner.steps, cfg.seed) == (4, 7, 3)


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("workload.bogus=1", "bogus"),
        ("runner.stepz=3", "stepz"),
        ("workload.batch_size=many", "batch_size"),
        ("runner.steps=1.5", "steps"),
    ],
)
def test_unknown_keys_and_wrong_types_fail_at_composition(override, fragment):
    with pytest.raises(ValueError) as err:
        compose_config([override])
    assert f"invalid config '{override.split('.')[0]}.{fragment}'" in str(err.value)


def test_unknown_key_lists_the_keys_allowed_there():
    with pytest.raises(ValueError, match="Keys allowed here: .*batch_size.*seq_len"):
        compose_config(["workload.batch_sise=4"])


def test_unknown_workload_names_the_available_ones():
    with pytest.raises(ValueError) as err:
        compose_config(["workload=nope"])
    assert "workload/nope" in str(err.value) and "llama" in str(err.value)
    assert "schema" not in str(err.value)  # only real choices are offered


@pytest.mark.parametrize(
    "override, key, allowed",
    [
        ("runner.steps=0", "runner.steps", ">= 1"),
        ("runner.repetitions=0", "runner.repetitions", ">= 1"),
        ("workload.n_kv_heads=3", "n_kv_heads", "allowed n_kv_heads: [1, 2, 4]"),
        ("workload.dtype=fp64", "workload.dtype", "float32, bfloat16"),
        ("workload.preset=llama9", "workload.preset", "tiny"),
        ("workload.lr=-1", "workload.lr", "positive"),
        ("platform.device=tpu", "platform.device", "cpu"),
        ("mllog.division=secret", "mllog.division", "open, closed"),
    ],
)
def test_bad_values_name_the_key_and_what_is_allowed(override, key, allowed):
    cfg = compose_config([override])
    with pytest.raises(ValueError) as err:
        to_run_config(cfg)
    message = str(err.value)
    assert key in message
    if allowed:
        assert allowed in message


def test_batch_must_divide_by_world_size():
    cfg = to_run_config(compose_config(["workload.batch_size=6"]))
    ctx = RunContext(device=torch.device("cpu"), seed=0, rank=0, world_size=4)
    with pytest.raises(ValueError, match="batch_size.*world size 4"):
        discover()["llama"].factory(cfg.workload, ctx)


def test_config_hash_tracks_what_is_measured_not_where_results_go():
    base = to_run_config(compose_config([]))
    moved = to_run_config(compose_config(["results_dir=/elsewhere", "tracking=off", "platform=cpu",
                                          "runner.progress=false", "platform.calibration_cache=/tmp/c.json"]))
    bigger = to_run_config(compose_config(["workload.batch_size=16"]))
    assert config_hash(base) == config_hash(moved)
    assert config_hash(base) != config_hash(bigger)


def test_suite_plan_validates_every_benchmark_up_front():
    base, plans = plan_suite("smoke", ["runner.steps=2"])
    assert base.suite is not None and base.suite.name == "smoke"
    assert [plan.name for plan in plans] == [b.name for b in base.suite.benchmarks]
    assert all(plan.cfg.runner.steps == 2 for plan in plans)  # user overrides win over the suite's
    with pytest.raises(ValueError, match="runner.steps"):
        plan_suite("smoke", ["runner.steps=0"])


def test_a_suite_skips_what_this_platform_cannot_run_and_refuses_a_bad_configuration():
    """Planning builds every workload against this launch: a codec that needs more than one rank is
    planned SKIPPED with the reason; a wrong setting stops the whole suite before anything runs."""
    _, plans = plan_suite("dlrm_codecs", ["runner.steps=2"])
    skipped = {plan.name: plan.skip for plan in plans}
    assert skipped["none"] is None
    assert "needs >1 rank" in skipped["int8"] and "cannot run here: 'workload.comm_codec'" in skipped["int8"]
    with pytest.raises(ValueError, match="suite 'dlrm_codecs', benchmark .*codec_options are for codecs registered"):
        plan_suite("dlrm_codecs", ["+workload.codec_options.bogus=1"])


def test_an_unusable_results_dir_is_bad_input_with_no_traceback(tmp_path):
    """A results_dir that is a file, or under one, is refused before anything runs: exit 2, one line naming
    the path and what to do; nothing is created."""
    import subprocess
    import sys

    from conftest import clean_env

    a_file = tmp_path / "results.txt"
    a_file.write_text("not a folder")
    for bad in (a_file, a_file / "sub"):
        with pytest.raises(ValueError, match="results_dir.*pass results_dir=DIR"):
            to_run_config(compose_config([f"results_dir={bad}"]))
    proc = subprocess.run([sys.executable, "-m", "suite.cli", "run", "workload=llama", f"results_dir={a_file}"],
                          capture_output=True, text=True, timeout=120, env=clean_env(), cwd=tmp_path)
    assert proc.returncode == 2 and "is a file, not a folder" in proc.stderr and "Traceback" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.txt"]


def test_a_results_dir_on_a_pseudo_file_system_or_behind_a_dangling_link_is_bad_input(tmp_path):
    """/proc and /sys accept no folders (even from root, whom os.access always answers yes): exit 2 with one line,
    as for every other unusable results_dir."""
    import subprocess
    import sys

    from conftest import clean_env

    dangling = tmp_path / "gone"
    dangling.symlink_to(tmp_path / "unmounted" / "results")
    (tmp_path / "unmounted").write_text("a file where the link's folder should be")
    for bad in ("/proc/cobench/res", "/sys/cobench", dangling):
        with pytest.raises(ValueError, match="results_dir.*pass results_dir=DIR"):
            to_run_config(compose_config([f"results_dir={bad}"]))
    proc = subprocess.run([sys.executable, "-m", "suite.cli", "run", "workload=llama", "results_dir=/proc/cobench/res"],
                          capture_output=True, text=True, timeout=120, env=clean_env(), cwd=tmp_path)
    assert proc.returncode == 2 and "cannot make a folder in /proc" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_run_help_shows_the_choices_and_the_config_not_internal_groups(tmp_path):
    import subprocess
    import sys

    from conftest import clean_env

    proc = subprocess.run([sys.executable, "-m", "suite.cli", "run", "--help", "workload=dlrm"],
                          capture_output=True, text=True, timeout=120, env=clean_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "workload=NAME" in proc.stdout and "comm_codec" in proc.stdout  # the chosen workload's keys
    assert "gates:" not in proc.stdout and "schema/workload" not in proc.stdout
    assert list(tmp_path.iterdir()) == []  # showing help writes nothing


def test_reproduce_overrides_compose_the_same_run_on_the_same_platform():
    """Every setting a run had beyond its workload's defaults comes back, the platform's too (a run at
    platform.num_threads=1 reproduced at the default 2 threads was the failure); where outputs go does not."""
    import yaml
    from omegaconf import OmegaConf

    from harness.identity import config_hash, reproduce_overrides

    cfg = to_run_config(compose_config(["workload=dlrm", "platform.num_threads=1", "runner.steps=7",
                                        "workload.table_rows=[100,200]", "+workload.codec_options.error_bound=0.01",
                                        "workload.comm_codec=eb", "+platform.peak_flops.float32=1e9",
                                        "results_dir=/tmp/elsewhere"]))
    saved = yaml.safe_load(OmegaConf.to_yaml(OmegaConf.structured(cfg)))  # as the run folder's config.yaml
    overrides = reproduce_overrides(saved)
    assert overrides[0] == "workload=dlrm" and "platform.num_threads=1" in overrides
    assert not any(o.startswith(("results_dir", "tracking")) for o in overrides)
    again = to_run_config(compose_config(overrides))
    assert config_hash(again) == config_hash(cfg) and again.platform == cfg.platform


def test_a_workload_whose_libraries_are_missing_leaves_the_others_runnable(tmp_path):
    """A machine without TorchRec (a bare GPU image): llama still composes and runs; asking for seqrec says
    which import failed, with exit 2, before anything ran."""
    import subprocess
    import sys

    block = ("import sys\nfor m in ('torchrec', 'fbgemm_gpu'): sys.modules[m] = None\n"
             "from suite.cli import main\nsys.exit(main(sys.argv[1:]))\n")

    def run(*args):
        return subprocess.run([sys.executable, "-c", block, "run", *args, "tracking=off", f"results_dir={tmp_path}",
                               "runner.progress=false"], capture_output=True, text=True, timeout=300)

    llama = run("workload=llama", "runner.warmup_steps=1", "runner.steps=2", "workload.train_batches=2",
                "workload.eval_batches=1")
    assert llama.returncode == 0, llama.stderr[-2000:]
    seqrec = run("workload=seqrec")
    assert seqrec.returncode == 2
    assert "workload seqrec cannot run on this machine: ModuleNotFoundError" in seqrec.stderr
    assert "Traceback" not in seqrec.stderr
