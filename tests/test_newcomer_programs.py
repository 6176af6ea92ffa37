"""Programs written the way newcomers write them (:mod:`newcomer_programs`) capture and replay whole: every op
runs and makes the program's shapes, the carried state stays finite, a replayed step holds what the
program's held at its peak, as the judge reckons it (within 10 % of the program's whole memory), and each
step runs again on its own."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import replayed_op_by_op
from newcomer_programs import PROGRAMS

from harness.traces.allocator_peaks import captured_step_peak_bytes, step_memory_peak_bytes

# in the tests: the four whose replay held other memory than the program (the last: a Categorical's sampled actions,
# broadcast against its logits, refilled as a dense copy), the one whose replay carried infinities (scatter_reduce's
# indices not recorded), a step handed what the step before made (its hidden state), a complex scalar the trace records
# by its type alone, a GRU whose peak was inside it, two backwards handed an index their forward read (one recorded for
# it, one whose slot gets the recorded values), and two cheap patterns besides; the rest under `nox -s corpus` (the
# mark `corpus`)
FAST = {"channels_last_fused_adam", "gaussian_process_cholesky", "sdpa_causal_dropout", "one_hot_width_from_labels",
        "custom_autograd_function", "scatter_reduce_graph_pool", "normal_kl_categorical_actions",
        "truncated_bptt_hidden_state", "complex_polar_view_as_real", "gru_on_a_random_crop",
        "adaptive_log_softmax_clusters", "cluster_bias_index_select"}


@pytest.mark.parametrize("name", [name if name in FAST else pytest.param(name, marks=pytest.mark.corpus)
                                  for name in sorted(PROGRAMS)])
def test_a_newcomers_program_replays_every_op_with_its_memory(name: str, tmp_path: Path):
    torch.manual_seed(0)
    step, model = PROGRAMS[name]()
    replayer, errors = replayed_op_by_op(step, tmp_path, model)
    assert errors == {}, {replayer.ops[i].name: str(why)[:300] for i, why in errors.items()}
    assert replayer.divergent == {}, {replayer.ops[i].name: why for i, why in replayer.divergent.items()}
    for _ in range(2 * len(replayer.sequence)):
        replayer.run_step()
    replayed = step_memory_peak_bytes(replayer.run_step, torch.device("cpu"), 2 * len(replayer.sequence))
    captured = captured_step_peak_bytes(tmp_path, torch.device("cpu"))
    assert replayer.errors == {} and replayer.nonfinite_tensors() == 0
    assert abs(replayed - captured) <= 0.10 * (replayer.static_bytes + captured), (replayed, captured)
    # each step runs again on its own, as the replay's calibrations run it, what an earlier step handed it kept
    for k in range(len(replayer.sequence)):
        for _ in range(2):
            replayer.runner.generated_step(k)[0](replayer.runner.tensors.vals)
