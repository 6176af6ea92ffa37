"""The replay's made-up floats are like the program's own, and stay so across measurements.

Kernels are not blind to values (a CPU's square root of subnormal or negative floats is many times
slower), so the capture profiles what each floating tensor a step reads but does not make held, and
the replay draws its parameters and optimiser state like them; between a judgement's samples (and a
replay run's passes over its steps) it puts that state back, so that replaying the same batches over
and over does not train it somewhere the program never was.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from harness.traces.capture import capture
from harness.traces.capture_values import ValueProfile
from workloads.trace_bundle import EXACT_VALUE_ELEMENTS, VALUES_FILE, ZERO_SLICE_INDICES, TraceError
from workloads.trace_replay.extract import precise_doubles
from workloads.trace_replay.parse import KinetoEvent
from workloads.trace_replay.records import RankRecord, ValueStats
from workloads.trace_replay.replay import Replayer
from workloads.trace_replay.safety import check_spec
from workloads.trace_replay.spec import generate_spec
from workloads.trace_replay.tensors import fill_view


def _program() -> tuple[nn.Module, torch.optim.Optimizer, callable]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8))
    with torch.no_grad():  # scales and signs no default fill would guess: small signed weights, a positive bias
        model[0].weight.normal_(0.0, 0.02)
        model[2].weight.normal_(0.0, 0.5)
        model[4].bias.uniform_(3.0, 4.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)

    def step() -> None:
        x, y = torch.randn(16, 32), torch.randint(0, 8, (16,))
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, opt, step


@pytest.fixture(scope="module")
def captured(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, nn.Module, torch.optim.Optimizer]:
    out = tmp_path_factory.mktemp("values")
    model, opt, step = _program()
    with capture(out, steps=2, warmup=3, baseline_steps=1, model=model, announce=False) as cap:
        while not cap.done:
            with cap.step():
                step()
    return out, model, opt


def _replayer(bundle: Path) -> Replayer:
    replayer = Replayer(RankRecord.from_json(generate_spec(bundle)["ranks"][0]), torch.device("cpu"))
    replayer.materialize()
    return replayer


def _external(replayer: Replayer, target: torch.Tensor) -> torch.Tensor:
    """The replay's synthesised tensor standing for the program's ``target`` (the one of its shape, in
    first-read order of that shape: the weights here have distinct shapes)."""
    found = [replayer.vals[slot] for slot, (info, _, _) in replayer.externals.items()
             if tuple(info.shape) == tuple(target.shape) and info.dtype == target.dtype
             and isinstance(replayer.vals[slot], torch.Tensor)]
    assert found, f"no external of shape {tuple(target.shape)}"
    return found[0]


def test_the_capture_profiles_each_external_float_of_the_step_in_first_read_order(captured):
    bundle, model, opt = captured
    entries = json.loads((bundle / VALUES_FILE).read_text())
    params = list(model.parameters())
    # the parameters, their Adam moments and step counters: read by the step, made before it
    assert len(entries) >= 3 * len(params)
    first = entries[0]
    assert first["shape"] == list(model[0].weight.shape) and first["dtype"] == "float32"
    assert abs(first["std"] - 0.02) < 0.005 and first["min"] <= first["mean"] <= first["max"]
    squares = [e for e in entries if e["shape"] == list(model[2].weight.shape) and e["min"] >= 0.0]
    assert squares, "the second moment (never negative) is profiled as such"


def test_the_replay_draws_the_programs_parameters_and_optimiser_state_like_them(captured):
    bundle, model, opt = captured
    replayer = _replayer(bundle)
    small, wide = _external(replayer, model[0].weight), _external(replayer, model[2].weight)
    assert 0.015 < small.std().item() < 0.025 and small.min().item() < 0 < small.max().item()
    assert 0.4 < wide.std().item() < 0.6
    bias = _external(replayer, model[4].bias)
    assert 3.0 <= bias.min().item() and bias.max().item() <= 4.0  # inside the program's own range
    # every external second moment (the tensors sqrt reads) is drawn inside its range: never negative
    shapes = {tuple(p.shape) for p in model.parameters()}
    moments = [replayer.vals[slot] for slot, (info, _, _) in replayer.externals.items()
               if tuple(info.shape) in shapes and isinstance(replayer.vals[slot], torch.Tensor)]
    assert len(moments) >= 3 * len(shapes) and all(torch.isfinite(m).all() for m in moments)
    replayer.dry_run()
    assert not replayer.errors and replayer.nonfinite_tensors() == 0


def test_restoring_puts_the_carried_state_back_after_replayed_steps(captured):
    bundle, model, _ = captured
    replayer = _replayer(bundle)
    weight = _external(replayer, model[2].weight)
    made = weight.clone()
    replayer.dry_run()
    for _ in range(4):
        replayer.run_step()
    assert not torch.equal(weight, made), "the replayed optimiser moves the weights"
    replayer.restore_values()
    assert torch.equal(weight, made)


def test_python_numbers_the_optimiser_passes_replay_with_the_programs_values(captured):
    """An optimiser passes Python numbers where its ops take tensors (AdamW: ``param.mul_(1 - lr * wd)``,
    ``exp_avg_sq.mul_(beta2)``, ``denom.add_(eps)``), a new one each time; the trace shows 0-dim doubles
    only. Made up, they shrank the replay's weights by about half a step where the program's shrink by
    1e-5, into subnormal floats within some tens of steps. Recorded at each read, with the op that read
    it, each replays as the program's own number."""
    bundle, model, opt = captured
    group = opt.param_groups[0]
    entries = json.loads((bundle / VALUES_FILE).read_text())
    read = [(e["op"], e["min"]) for e in entries if "op" in e]
    for number in (("aten::mul_", 1 - group["lr"] * group["weight_decay"]), ("aten::mul_", group["betas"][1]),
                   ("aten::add_", group["eps"])):
        assert read.count(number) == len(list(model.parameters())), number  # once a parameter
    replayer = _replayer(bundle)
    weight = _external(replayer, model[2].weight)
    made = weight.norm().item()
    replayer.dry_run()
    for _ in range(50):
        replayer.run_step()
    assert not replayer.errors and 0.9 < weight.norm().item() / made < 1.1


def test_a_part_of_a_step_keeps_the_default_fill(captured):
    bundle, _, _ = captured
    from workloads.trace_replay.spec import GenerateOptions

    spec = generate_spec(bundle, GenerateOptions(op="aten::addmm"))
    assert spec["full_step"] is False and spec["ranks"][0]["external_values"] == []


@pytest.mark.parametrize(("change", "problem"), [
    (lambda e: e.update(mean=float("nan")), "mean"),
    (lambda e: e.update(std=-1.0), "std"),
    (lambda e: e.update(dtype="int64"), "not a floating dtype"),
    (lambda e: e.update(mean=e["max"] + 1.0), "outside"),
    (lambda e: e.update(shape="x"), "shape"),
    (lambda e: e.update(zeros=1.5), "zeros"),
    (lambda e: e.update(zeros=0.1, zero_rows=0.2), "exceeds"),
    (lambda e: e.update(shape=[4, 3], zeros=0.5, zero_slices={"2": [0]}), "not a dimension"),
    (lambda e: e.update(shape=[4, 3], zeros=0.5, zero_slices={"1": [3]}), "outside"),
    (lambda e: e.update(shape=[4, 3], zeros=0.5, zero_slices={"0": [1, 1]}), "repeat"),
    (lambda e: e.update(shape=[4, 3], zeros=0.1, zero_slice_shares={"0": 0.5}), "outside"),
    (lambda e: e.update(shape=[999, 2], zeros=0.5, zero_slices={"0": list(range(ZERO_SLICE_INDICES + 1))}),
     "at most"),
    (lambda e: e.update(zeros=0.1, nonzero={"mean": 2.0, "std": 0.1, "min": 0.0, "max": 1.0}), "nonzero"),
    (lambda e: e.update(data="not base64!"), "not base64"),
    (lambda e: e.update(op="aten::mul_"), "a reader recorded for a tensor of shape"),
    (lambda e: e.update(shape=[], op=7), "op.*expected a string"),
    (lambda e: e.update(reader=["aten::mul_"]), "reader.*expected a string"),
    (lambda e: e.update(dtype=["float32"]), "is not a floating dtype"),
    (lambda e: e.update(shape=[3, 3], matrix="orthogonal"), "is not one of"),
    (lambda e: e.update(shape=[4, 3], matrix="symmetric"), "not square"),
    (lambda e: e.update(shape=[3], data=base64.b64encode(bytes(8)).decode()), "8 bytes where 3 float32"),
    (lambda e: e.update(shape=[EXACT_VALUE_ELEMENTS + 1], data=base64.b64encode(bytes(4 * EXACT_VALUE_ELEMENTS + 4))
                        .decode()), "recorded whole"),
])
def test_a_corrupt_value_profile_is_refused_naming_the_entry(captured, change, problem, tmp_path: Path):
    bundle, _, _ = captured
    spec = generate_spec(bundle)
    change(spec["ranks"][0]["external_values"][1])
    with pytest.raises(TraceError, match=rf"external_values\[1\].*{problem}|{problem}.*external_values\[1\]"):
        check_spec(spec, tmp_path / "spec.json")


def test_floats_made_from_a_python_list_are_defined_in_the_replay(tmp_path: Path):
    """``torch.tensor(list)`` is an ``aten::empty`` the program then fills by a copy no trace shows (an
    image normalisation's mean and std, as torchvision's detection models make each step). The replay
    fills it: a quotient by it stays finite step after step, and so does everything trained from it."""
    torch.manual_seed(0)
    model = nn.Conv2d(3, 4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)

    def step() -> None:
        image = torch.rand(2, 3, 16, 16)
        mean = torch.tensor([0.485, 0.456, 0.406])
        std = torch.tensor([0.229, 0.224, 0.225])
        model((image - mean[:, None, None]) / std[:, None, None]).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    with capture(tmp_path, steps=2, warmup=1, baseline_steps=1, announce=False) as cap:
        while not cap.done:
            with cap.step():
                step()
    replayer = Replayer(RankRecord.from_json(generate_spec(tmp_path)["ranks"][0]), torch.device("cpu"), seed=3)
    replayer.materialize()
    filled = {slot for op in replayer.ops for slot, rng in op.fills if rng is None}
    assert len(filled) >= 4  # the mean and the std, in each of the two steps
    divisors = []

    def before(index: int) -> None:
        if replayer.ops[index].name == "aten::div":
            divisors.extend(replayer.vals[use.slot] for use in replayer.plan.inputs[index][1:])

    assert replayer.dry_run(before).errors == {}
    assert len(divisors) == 2 and all(torch.isfinite(d).all() and (d > 0).all() for d in divisors)
    for _ in range(4 * len(replayer.sequence)):
        replayer.run_step()
    assert replayer.nonfinite_tensors() == 0


def test_a_replay_run_puts_the_carried_state_back_after_each_pass_over_the_captured_steps(captured, tmp_path):
    """A replay run by the harness's loop calls ``between_steps`` after each step, outside its timing: once
    every captured step has run, the carried state is back as it was made, so a long run does not drift
    where the program never was; within a pass, each step goes on from where the one before left it."""
    import shutil

    from workloads.base import RunContext
    from workloads.trace_replay.workload import GeneratedWorkload

    bundle, model, _ = captured
    bundle = Path(shutil.copytree(bundle, tmp_path / "bundle"))  # the workload writes its spec beside it
    (tmp_path / "run").mkdir()
    ctx = RunContext(device=torch.device("cpu"), seed=0, work_dir=tmp_path / "run", device_name="cpu", rank=0,
                     world_size=1, process_group=None)
    workload = GeneratedWorkload.from_bundle(bundle, ctx, probe=False, host_gaps=False, op_timing=False)
    workload.setup()
    weight = _external(workload.replayer, model[2].weight)
    made = weight.clone()
    steps = len(workload.replayer.sequence)
    assert steps >= 2
    for _ in range(2):
        for i in range(steps):
            workload.step()
            workload.between_steps()
            assert torch.equal(weight, made) == (i == steps - 1), i


def _capture_one_step(out: Path, step: callable, model: nn.Module) -> None:
    """One traced step after three of warm-up, its value profile in ``out``."""
    with capture(out, steps=1, warmup=3, baseline_steps=1, model=model, announce=False) as cap:
        while not cap.done:
            with cap.step():
                step()


def test_untouched_embedding_rows_stay_whole_zero_rows_of_the_optimiser_state_in_the_replay(tmp_path: Path):
    """Adagrad's state is zero on the rows no batch has touched: whole rows, not zeros strewn among values (a
    CPU's square root runs ~3x slower on strewn zeros). The replay makes the same rows zero, and the other
    elements like the program's non-zero ones."""
    torch.manual_seed(0)
    table, head = nn.EmbeddingBag(500, 16, mode="sum"), nn.Linear(16, 1)
    opt = torch.optim.Adagrad([*table.parameters(), *head.parameters()], lr=0.01, foreach=False)

    def step() -> None:
        ids = torch.randint(0, 300, (64, 4))  # rows 300..499 are never looked up
        head(table(ids)).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    _capture_one_step(tmp_path, step, table)
    state = opt.state[table.weight]["sum"]
    program_rows = (state == 0).all(dim=1).nonzero().flatten().tolist()
    assert len(program_rows) >= 200  # the 200 untouched rows, and any of the 300 no batch drew yet
    (entry,) = [e for e in json.loads((tmp_path / VALUES_FILE).read_text())
                if e["shape"] == [500, 16] and e.get("zeros")]
    assert entry["zero_slices"] == {"0": program_rows} and entry["nonzero"]["min"] > 0
    replayer = _replayer(tmp_path)
    made = [replayer.vals[slot] for slot, (info, _, _) in replayer.externals.items()
            if tuple(info.shape) == (500, 16) and isinstance(replayer.vals[slot], torch.Tensor)
            and bool((replayer.vals[slot] == 0).any())]
    assert len(made) == 1, "the weight has no zeros; the state has its zero rows"
    rows = (made[0] == 0).all(dim=1)
    assert rows.nonzero().flatten().tolist() == program_rows
    strewn = made[0][~rows]
    assert int((strewn == 0).sum()) == 0 and float(strewn.min()) >= entry["nonzero"]["min"]


def test_an_optimisers_zeros_lie_in_the_replay_where_they_lay_in_the_program(tmp_path: Path):
    """A 3 × 3 convolution of stride 2 over a 2 × 2 input meets only padding with its kernel's first row and
    first column (as ResNet-18's last ones do on a 32 × 32 image): their gradients, and Adam's second
    moments, are zero on those whole slices. Strewn at random among the values, as many zeros made a CPU's
    square root of the moments run twice as long as the program's; the replay makes the same slices zero."""
    torch.manual_seed(0)
    conv, head = nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.Linear(32, 1)
    opt = torch.optim.Adam([*conv.parameters(), *head.parameters()], lr=1e-3, foreach=False)

    def step() -> None:
        head(conv(torch.randn(8, 16, 2, 2)).flatten(1)).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    _capture_one_step(tmp_path, step, conv)
    program = opt.state[conv.weight]["exp_avg_sq"] == 0
    assert program[:, :, 0, :].all() and program[:, :, :, 0].all() and not program[:, :, 1:, 1:].any()
    entries = [e for e in json.loads((tmp_path / VALUES_FILE).read_text()) if e["shape"] == [32, 16, 3, 3]]
    assert [e.get("zero_slices") for e in entries if e.get("zeros")] == [{"2": [0], "3": [0]}] * 2  # both moments
    replayer = _replayer(tmp_path)
    made = [replayer.vals[slot] for slot, (info, _, _) in replayer.externals.items()
            if tuple(info.shape) == (32, 16, 3, 3) and isinstance(replayer.vals[slot], torch.Tensor)
            and bool((replayer.vals[slot] == 0).any())]
    assert len(made) == 2 and all(torch.equal(m == 0, program) for m in made)


def test_more_zero_slices_than_are_listed_are_drawn_as_many(tmp_path: Path):
    """A dimension with more wholly zero slices than are recorded by index keeps their share, and the replay
    draws as many whole slices (here rows), not as many zeros strewn."""
    values = torch.rand(300, 4) + 0.5
    values[torch.randperm(300)[:280]] = 0.0
    with ValueProfile() as profile:
        values.sqrt()
    (entry,) = profile.entries
    assert "zero_slices" not in entry and entry["zero_slice_shares"] == {"0": pytest.approx(280 / 300)}
    made = torch.empty(300, 4)
    fill_view(made, None, False, torch.Generator().manual_seed(0), ValueStats.from_json(entry))
    rows = (made == 0).all(dim=1)
    assert int(rows.sum()) == 280 and int((made[~rows] == 0).sum()) == 0


@pytest.mark.parametrize("warmup", [0, 3])
def test_the_values_profiled_are_the_state_the_capture_left_not_the_warm_ups(tmp_path: Path, warmup: int):
    """A program's state moves as it trains (an optimiser's second moments fill in, a running count grows):
    the profile is taken on the capture's last step, so the replay starts from the most trained state the
    capture saw, not from the warm-up's; a capture with no warm-up step has one too."""
    seen = torch.zeros(4)  # read and updated by every step
    head = nn.Linear(4, 1)

    def step() -> None:
        seen.add_(1.0)
        head(seen.unsqueeze(0)).sum().backward()

    with capture(tmp_path, steps=2, warmup=warmup, baseline_steps=2, model=head, announce=False) as cap:
        while not cap.done:
            with cap.step():
                step()
    before_last = cap.total_steps - 1
    assert before_last > warmup + 2 + 2  # the traced steps and the host-time rounds came before it
    (entry,) = [e for e in json.loads((tmp_path / VALUES_FILE).read_text()) if e["shape"] == [4]]
    assert entry["min"] == entry["max"] == before_last  # as the last step read it
    assert torch.equal(_external(_replayer(tmp_path), seen), torch.full((4,), float(before_last)))


def test_a_small_constant_replays_with_the_programs_own_values(tmp_path: Path):
    """Figures cannot say which corner of a box is which: anchor boxes drawn from their mean and spread get
    negative widths, and the logarithm of a width (a detector's regression targets) goes NaN. A small tensor
    the step reads is recorded whole and replays as it was; a large one keeps its figures only."""
    torch.manual_seed(0)
    sizes = torch.tensor([16.0, 32.0, 64.0, 128.0, 256.0])
    half = torch.cat([torch.stack([sizes * r, sizes / r], 1) for r in (0.7, 1.0, 1.4)]) / 2
    anchors = torch.cat([-half, half], dim=1)  # (x1, y1, x2, y2) about the origin: 15 boxes, as torchvision's
    head = nn.Linear(512, 4)

    def step() -> None:
        deltas = head(torch.randn(15, 512)).tanh()
        boxes = anchors + deltas
        widths = torch.stack([boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]], dim=1)
        widths.log().mean().backward()

    with capture(tmp_path, steps=1, warmup=2, baseline_steps=1, model=head, announce=False) as cap:
        while not cap.done:
            with cap.step():
                step()
    entries = json.loads((tmp_path / VALUES_FILE).read_text())
    (recorded,) = [e for e in entries if e["shape"] == [15, 4]]
    assert "data" in recorded and [e for e in entries if e["shape"] == [4, 512] and "data" not in e]
    replayer = _replayer(tmp_path)
    assert torch.equal(_external(replayer, anchors), anchors)
    replayer.dry_run()
    replayer.run_step()
    assert not replayer.errors and replayer.nonfinite_tensors() == 0


def test_a_backward_op_computes_with_the_output_its_forward_saved_not_a_made_up_one(tmp_path: Path):
    """Autograd hands a backward op the output its forward saved (a softmax, a tanh, a ReLU, a log-softmax) as
    a new tensor over the same storage, which the trace gives an id of its own. Replayed with that id's own
    made-up tensor (positive floats in [0.1, 1)), the log-softmax's backward read no log-probabilities at
    all (GPT-2's gradients came out 10³ times the program's). Each such op must read what its forward made:
    the log-softmax's output is ≤ 0, the softmax's rows sum to 1, the ReLU's has zeros."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)

    def step() -> None:
        x, y = torch.randn(12, 16), torch.randint(0, 8, (12,))
        logits = model(x)
        mixed = torch.softmax(logits @ logits.T, dim=-1) @ logits
        nn.functional.cross_entropy(mixed, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    with capture(tmp_path / "bundle", steps=2, warmup=2, baseline_steps=1, model=model, announce=False) as cap:
        while not cap.done:
            with cap.step():
                step()
    replayer = _replayer(tmp_path / "bundle")
    plan, vals = replayer.plan, replayer.vals
    saved_output_arg = {"aten::_log_softmax_backward_data": 1, "aten::_softmax_backward_data": 1,
                        "aten::tanh_backward": 1, "aten::threshold_backward": 1}
    read: dict[str, list[torch.Tensor]] = {}

    def before(index: int) -> None:
        op = plan.ops[index]
        if op.name in saved_output_arg:
            slot = next(slot for position, _, slot in op.arg_slots if position == saved_output_arg[op.name])
            assert slot not in plan.externals, f"{op.name} reads a made-up tensor for its forward's output"
            read.setdefault(op.name, []).append(vals[slot].clone())

    stats = replayer.dry_run(before)
    assert not stats.errors
    assert set(read) == set(saved_output_arg) and all(len(v) == 2 for v in read.values())  # each step's
    assert all((t <= 0).all() for t in read["aten::_log_softmax_backward_data"])
    assert all(torch.allclose(t.sum(-1), torch.ones(t.shape[0])) for t in read["aten::_softmax_backward_data"])
    assert all((t.abs() < 1).all() for t in read["aten::tanh_backward"])
    assert all((t == 0).any() and (t >= 0).all() for t in read["aten::threshold_backward"])


def test_a_fused_optimisers_small_floats_replay_at_full_precision_and_its_state_stays_finite(tmp_path: Path):
    """The execution trace writes a float argument with six decimals: fused AdamW's eps of 1e-8 read 0.0, and
    its zero moments (rows no batch touched) then divided zero by zero: the replay's state held NaN after one
    pass over its steps (here, and 63 of llama's carried tensors). The spec takes each such float at the
    precision the profiler recorded it."""
    torch.manual_seed(0)
    table, head = nn.Embedding(200, 16), nn.Linear(16, 1)
    lr, eps = 0.00123456789, 1e-8
    opt = torch.optim.AdamW([*table.parameters(), *head.parameters()], lr=lr, eps=eps, fused=True)

    def step() -> None:
        ids = torch.randint(0, 120, (32, 4))  # rows 120..199 are never looked up: their moments stay zero
        head(table(ids)).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    _capture_one_step(tmp_path, step, table)
    (fused,) = [op for op in generate_spec(tmp_path)["ranks"][0]["ops"] if op["name"] == "aten::_fused_adamw_"]
    values = fused["inputs"]["values"]
    assert lr in values and eps in values and 0.0 not in values[:-4]
    replayer = _replayer(tmp_path)
    replayer.dry_run()
    for _ in range(6):
        replayer.run_step()
    assert not replayer.errors and replayer.nonfinite_tensors() == 0


@pytest.mark.parametrize(("recorded", "concrete", "kept"), [
    (0.0, "1e-08", 1e-08),  # rounded to six decimals: taken whole
    (0.002963, "0.0029626993925368633", 0.0029626993925368633),
    (0.5, "0.25", 0.5),  # not that value rounded: the trace's own kept
    (0.0, "nan", 0.0),
    (0.0, "abc", 0.0),
])
def test_a_traced_float_is_taken_from_the_profiler_only_where_the_two_agree(recorded, concrete, kept):
    inputs = {"types": ["Tensor(float)", "Double", "Int"], "values": [[1, 2, 0, 4, 4, "cpu"], recorded, 3]}
    event = KinetoEvent("aten::add_", "cpu_op", 0.0, 1.0, 1, 7, ("", concrete, "3"))
    assert precise_doubles(inputs, event)["values"] == [[1, 2, 0, 4, 4, "cpu"], kept, 3]
    assert precise_doubles(inputs, None) == inputs
    assert precise_doubles(inputs, event._replace(concrete=("", concrete))) == inputs  # not the same inputs


def test_a_profiled_step_that_skipped_a_layer_gives_each_tensor_a_profile_of_its_own_kind(tmp_path: Path):
    """A program that drops layers at random (Wav2Vec2's LayerDrop) may skip one in the step whose values are
    profiled and run it in the traced ones: that step reads fewer tensors, in another order. Matched by shape
    and order alone, the optimiser's second moments took the profiles of signed tensors, and the replay's
    square roots of them went NaN (147 of Wav2Vec2's carried tensors). Each tensor first read by the same op
    as a profiled one takes a profile of that op's tensors: the second moments stay non-negative, the state
    finite."""
    torch.manual_seed(0)
    layers = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64)) for _ in range(3))
    opt = torch.optim.AdamW(layers.parameters(), lr=1e-3, foreach=False)
    skip = {"layer": None}

    def step() -> None:
        x = torch.randn(32, 64)
        for i, layer in enumerate(layers):
            if i != skip["layer"]:
                x = x + torch.tanh(layer(x))
        x.square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    with capture(tmp_path, steps=2, warmup=3, baseline_steps=1, model=layers, announce=False) as cap:
        while not cap.done:
            skip["layer"] = 0 if cap.step_index == cap.total_steps - 1 else None  # the profiled step drops one
            with cap.step():
                step()
    entries = json.loads((tmp_path / VALUES_FILE).read_text())
    squares = [e for e in entries if e.get("reader") == "aten::mul_" and e["shape"]]
    assert squares and all(e["min"] >= 0.0 for e in squares), "the second moments, first read by mul_"
    replayer = _replayer(tmp_path)
    moments = [replayer.vals[slot] for slot, (info, _, _) in replayer.externals.items()
               if info.shape and replayer.plan.ops[_first_reader(replayer, info)].name == "aten::mul_"]
    assert len(moments) == 2 * 3 * 2  # weight and bias of each Linear and LayerNorm of the three layers
    assert all(float(m.min()) >= 0.0 for m in moments)
    replayer.dry_run()
    for _ in range(6):
        replayer.run_step()
    assert not replayer.errors and replayer.nonfinite_tensors() == 0


def _first_reader(replayer: Replayer, info: object) -> int:
    """The op that reads the storage ``info`` lies in first, in the replay's order."""
    plan = replayer.plan
    return next(p for positions in plan.sequence for p in positions
                if any(use.info.storage_id == info.storage_id for use in plan.inputs[p]))
