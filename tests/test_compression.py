"""The error-bounded all-to-all codec: every decoded element within its bound, checked exactly.

Bounds are recomputed here from the definition (float64), independently of the codec, and every
comparison is ``error <= bound`` with no tolerance.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_ranks

from workloads.dlrm.error_bounded.codec import ErrorBoundedCodec, bytes_per_block, make_error_bounded_codecs
from workloads.dlrm.error_bounded.config import BoundSchedule, ErrorBoundConfig, column_block_scales
from workloads.dlrm.error_bounded.exact_grid import RAW_BITS

BS = 64


def codec(**kwargs) -> ErrorBoundedCodec:
    kwargs.setdefault("measure_error", True)  # the codec also checks every element on its own, in float64
    return ErrorBoundedCodec(ErrorBoundConfig(**kwargs))


def round_trip(c: ErrorBoundedCodec, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Encode and decode as TorchRec does; the message length must be what calc_quantized_size says."""
    ctx = c.create_context()
    message = c.encode(x, ctx)
    assert message.dtype == torch.uint8
    assert message.numel() == c.calc_quantized_size(x.numel(), ctx)
    decoded = c.decode(message, ctx)
    assert decoded.dtype == torch.float32 and decoded.numel() == x.numel()
    return decoded.view_as(x), ctx.bits


def block_bounds(x: torch.Tensor, mode: str, eb: float, block: int = BS) -> torch.Tensor:
    """The bound in force per block, from the definition (constant schedule, unit table scales)."""
    blocks = x.reshape(-1, block).double()
    if mode == "abs":
        return torch.full((blocks.shape[0],), eb, dtype=torch.float64)
    return eb * (blocks.amax(1) - blocks.amin(1))


def assert_within_bound(x: torch.Tensor, decoded: torch.Tensor, bounds: torch.Tensor, block: int = BS) -> None:
    error = (decoded.double() - x.double()).abs().reshape(-1, block)
    worst = error.amax(1)
    assert bool((worst <= bounds).all()), f"max error/bound {float((worst / bounds).max())}"


CASES = [("rel", "fixed", 1e-2), ("rel", "agreed", 1e-2), ("rel", "fixed", 1e-3), ("rel", "agreed", 1e-3),
         ("abs", "agreed", 1e-2), ("abs", "agreed", 1e-3)]


@pytest.mark.parametrize(("mode", "packing", "eb"), CASES)
def test_random_normal_round_trip_meets_the_bound_and_compresses(mode, packing, eb):
    x = torch.randn(256, 256, generator=torch.Generator().manual_seed(0)) * 0.1
    c = codec(mode=mode, eb=eb, packing=packing)
    decoded, bits = round_trip(c, x)
    assert_within_bound(x, decoded, block_bounds(x, mode, eb))
    assert bits <= 10 and c.stats.compression_ratio > 2.9
    assert c.stats.bound_violations == 0 and 0 < c.stats.max_error_over_bound <= 1


def test_rel_widths_follow_the_bound():
    """Agreed packing hits the ideal log2(1/(2 rel) + 1); fixed pays one guard bit for float32 rounding."""
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(1))
    for rel in (0.1, 1e-2, 1e-3, 1e-4):
        assert round_trip(codec(eb=rel, packing="agreed"), x)[1] == math.ceil(math.log2(1 / (2 * rel) + 1))
        assert round_trip(codec(eb=rel, packing="fixed"), x)[1] == math.ceil(math.log2(1 / rel + 2))


@pytest.mark.parametrize("packing", ["fixed", "agreed"])
def test_constant_blocks_are_exact(packing):
    x = torch.cat([torch.full((BS,), 3.25), torch.zeros(BS), torch.full((BS,), -1e-40)])
    c = codec(eb=1e-3, packing=packing)
    decoded, bits = round_trip(c, x)
    assert torch.equal(decoded, x)
    if packing == "agreed":  # nothing to code: the 8-byte headers are the whole message
        assert bits == 0 and c.stats.bytes_out == 3 * bytes_per_block(0, BS) == 24


def test_huge_range_meets_rel_bound_and_abs_falls_back_to_raw():
    g = torch.Generator().manual_seed(2)
    x = (torch.rand(16 * BS, generator=g) * 2 - 1) * 1e30
    for packing in ("fixed", "agreed"):
        decoded, _ = round_trip(codec(eb=1e-3, packing=packing), x)
        assert_within_bound(x, decoded, block_bounds(x, "rel", 1e-3))
    c = codec(mode="abs", eb=1e-2, packing="agreed")  # 1e-2 absolute at 1e30 is below float32 resolution
    decoded, bits = round_trip(c, x)
    assert bits == RAW_BITS and torch.equal(decoded, x) and c.stats.raw_messages == 1


def test_subnormals_and_mixed_signs():
    g = torch.Generator().manual_seed(3)
    subnormal = torch.randn(8 * BS, generator=g) * 1e-40
    assert subnormal.abs().max() < torch.finfo(torch.float32).tiny
    mixed = torch.randn(8 * BS, generator=g) * torch.logspace(-20, 20, 8 * BS)
    for x in (subnormal, mixed):
        for mode, packing, eb in (("rel", "fixed", 1e-2), ("rel", "agreed", 1e-3), ("abs", "agreed", 1e-42)):
            decoded, _ = round_trip(codec(mode=mode, eb=eb, packing=packing), x)
            assert_within_bound(x, decoded, block_bounds(x, mode, eb))


def adversarial_blocks(n: int, block: int, seed: int) -> torch.Tensor:
    """Blocks where float32 rounding, not quantisation, decides: a few ulps around powers of two
    (straddling the binade edge), the subnormal range, wild magnitudes, values near FLT_MAX."""
    g = torch.Generator().manual_seed(seed)

    def floats(bits: torch.Tensor) -> torch.Tensor:
        return bits.to(torch.int32).view(torch.float32)

    def signs(*shape: int) -> torch.Tensor:
        return torch.where(torch.rand(*shape, generator=g) < 0.5, -1.0, 1.0)

    power_of_two = (torch.randint(-140, 126, (n, 1), generator=g).clamp(-126, 126) + 127) << 23
    spread = torch.randint(1, 3000, (n, 1), generator=g)
    ulps = (torch.rand(n, block, generator=g) * spread).long() - spread // 2
    magnitudes = torch.exp2((torch.rand(n, 1, generator=g) * 250 - 125
                             + torch.rand(n, block, generator=g) * torch.rand(n, 1, generator=g) * 40).clamp(max=127.9))
    return torch.cat([
        floats(power_of_two + ulps) * signs(n, 1),
        floats(torch.randint(0, 2**24, (n, block), generator=g)) * signs(n, block),
        magnitudes.float() * torch.where(torch.rand(n, block, generator=g) < torch.rand(n, 1, generator=g), -1.0, 1.0),
        floats(torch.randint(0x7F000000, 0x7F7FFFFF, (n, block), generator=g)) * signs(n, block),
    ]).view(-1)


@pytest.mark.parametrize("packing", ["fixed", "agreed"])
def test_adversarial_blocks_never_exceed_the_rel_bound(packing):
    x = adversarial_blocks(500, 16, seed=4)
    assert bool(torch.isfinite(x).all())
    lattice_blocks = 0
    for rel in (0.5, 0.1, 1e-2, 1e-3, 1e-4, 2e-5):
        c = codec(eb=rel, packing=packing, block_size=16)
        decoded, bits = round_trip(c, x)
        assert bits <= 16
        assert_within_bound(x, decoded, block_bounds(x, "rel", rel, 16), 16)
        assert c.stats.bound_violations == 0 and c.stats.max_error_over_bound <= 1
        lattice_blocks += c.stats.lattice_blocks
    assert lattice_blocks > 0  # the float32-lattice fallback was needed, and held


@pytest.mark.parametrize("eb", [1e30, 1.0, 1e-3, 1e-39, 1e-45])
def test_adversarial_blocks_never_exceed_the_abs_bound(eb):
    x = adversarial_blocks(200, 16, seed=5)
    for part in x.view(4, -1):
        decoded, _ = round_trip(codec(mode="abs", eb=eb, packing="agreed", block_size=16), part)
        assert_within_bound(part, decoded, block_bounds(part, "abs", eb, 16), 16)


def test_bound_below_float32_resolution_is_bit_exact():
    x = torch.randn(32, BS, generator=torch.Generator().manual_seed(6))
    for c in (codec(eb=1e-7, packing="fixed"), codec(eb=1e-7, packing="agreed"),
              codec(mode="abs", eb=1e-12, packing="agreed")):
        decoded, bits = round_trip(c, x)
        assert bits == RAW_BITS and torch.equal(decoded, x)
        assert c.stats.compression_ratio == 1.0


@pytest.mark.parametrize("packing", ["fixed", "agreed"])
def test_nan_and_inf_blocks_decode_as_nan_and_are_counted(packing):
    x = torch.randn(4 * BS, generator=torch.Generator().manual_seed(7))
    x[BS + 3], x[BS + 9] = math.nan, math.inf
    c = codec(eb=1e-2, packing=packing)
    decoded, _ = round_trip(c, x)
    assert bool(decoded[BS:2 * BS].isnan().all())  # the whole affected block: never silently finite
    intact = torch.cat([x[:BS], x[2 * BS:]])
    assert_within_bound(intact, torch.cat([decoded[:BS], decoded[2 * BS:]]), block_bounds(intact, "rel", 1e-2))
    assert c.nonfinite_count == 2 and c.stats.nonfinite_elements == 2 and c.stats.nonfinite_blocks == 1
    assert c.stats.bound_violations == 0
    c.reset_stats()
    assert c.stats.nonfinite_elements == 0 and c.nonfinite_count == 2  # the lifetime counter stays


def test_raw_messages_carry_nan_and_inf_exactly():
    x = torch.randn(2 * BS, generator=torch.Generator().manual_seed(8))
    x[5], x[70] = math.nan, -math.inf
    c = codec(eb=1e-7, packing="fixed")
    decoded, _ = round_trip(c, x)
    assert torch.equal(decoded.isnan(), x.isnan()) and decoded[70] == -math.inf and c.nonfinite_count == 2


@pytest.mark.parametrize(("block", "rows", "packing", "eb"),
                         [(64, 1, "fixed", 1e-2), (64, 37, "agreed", 1e-3), (5, 11, "fixed", 0.3),
                          (13, 4, "agreed", 1e-4), (128, 3, "fixed", 2e-5), (8, 9, "agreed", 0.5)])
def test_calc_quantized_size_matches_encode(block, rows, packing, eb):
    x = torch.randn(rows, 2 * block, generator=torch.Generator().manual_seed(9))
    c = codec(eb=eb, packing=packing, block_size=block)
    ctx = c.create_context()
    message = c.encode(x, ctx)
    assert message.numel() == c.calc_quantized_size(x.numel(), ctx) == 2 * rows * bytes_per_block(ctx.bits, block)
    # TorchRec sizes each destination's chunk separately; the chunks must add up
    assert sum(c.calc_quantized_size(block * k, ctx) for k in (rows, rows)) == message.numel()


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"eb": 0.0}, "eb must be"), ({"eb": -1.0}, "eb must be"), ({"eb": math.nan}, "eb must be"),
    ({"eb": math.inf}, "eb must be"), ({"eb": 0.7}, "meaningless"), ({"mode": "l2"}, "unknown mode"),
    ({"packing": "zip"}, "unknown packing"), ({"block_size": 0}, "block_size"),
    ({"packing": "agreed", "bits": 8}, "set by the exchange"), ({"packing": "fixed", "bits": 17}, "bits must be"),
    ({"table_scales": (1.0, 0.0)}, "table_scales"), ({"table_bounds": "size"}, "unknown table_bounds"),
    ({"table_bounds": "range"}, "needs mode='abs' and packing='agreed'"),
    ({"table_bounds": "range", "mode": "abs", "packing": "agreed", "table_scales": (1.0,)}, "do not also set"),
])
def test_invalid_config_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        codec(**kwargs)


def test_invalid_factory_options_are_refused():
    with pytest.raises(ValueError, match="unknown compression options"):
        make_error_bounded_codecs({"ebb": 1e-2}, None)
    with pytest.raises(ValueError, match="unknown schedule"):
        make_error_bounded_codecs({"schedule": "cosine"}, None)
    with pytest.raises(ValueError, match="eb must be"):
        make_error_bounded_codecs({"backward_eb": 0}, None)


def test_fixed_width_refuses_what_it_cannot_guarantee():
    with pytest.raises(ValueError, match="needs 7"):
        codec(eb=1e-2, packing="fixed", bits=6)  # 6 bits suffice only without float32 rounding
    with pytest.raises(ValueError, match="value_range"):
        codec(mode="abs", eb=1e-2, packing="fixed")
    c = codec(mode="abs", eb=1e-2, packing="fixed", value_range=(-1.0, 1.0))
    x = torch.rand(4 * BS, generator=torch.Generator().manual_seed(10)) * 2 - 1
    decoded, bits = round_trip(c, x)
    assert bits == 7 and c.stats.bound_violations == 0
    assert_within_bound(x, decoded, block_bounds(x, "abs", 1e-2))
    with pytest.raises(ValueError, match="outside the declared value_range"):
        c.encode(x * 2, c.create_context())


def test_length_must_be_whole_blocks_and_float32():
    c = codec()
    with pytest.raises(ValueError, match="multiple of block_size"):
        c.encode(torch.randn(BS + 1), c.create_context())
    with pytest.raises(ValueError, match="multiple of block_size"):
        c.calc_quantized_size(100, c.create_context())
    with pytest.raises(ValueError, match="must divide every rank"):
        c.padded_size(torch.randn(4, 96), [96, 64], 0, c.create_context())
    with pytest.raises(ValueError, match="float32"):
        c.encode(torch.randn(BS, dtype=torch.float64), c.create_context())
    agreed = codec(packing="agreed")
    with pytest.raises(ValueError, match="create_context"):
        agreed.encode(torch.randn(BS))


def test_linear_decay_tightens_the_bound_and_the_errors():
    x = torch.randn(64, BS, generator=torch.Generator().manual_seed(11))
    schedule = BoundSchedule(kind="linear_decay", decay_steps=100, min_factor=0.1)
    c = codec(mode="abs", eb=1e-2, packing="agreed", schedule=schedule)
    first, first_bits = round_trip(c, x)
    c.set_iteration(100)
    assert c.bound_in_force() == pytest.approx(1e-3)
    later, later_bits = round_trip(c, x)
    assert_within_bound(x, later, block_bounds(x, "abs", c.bound_in_force()))
    assert later_bits > first_bits and (later - x).abs().max() < (first - x).abs().max()
    c.set_iteration(50)
    assert c.bound_in_force() == pytest.approx(1e-2 * 0.55)


def test_feedback_schedule_tightens_when_the_loss_stalls():
    c = codec(eb=1e-2, schedule=BoundSchedule(kind="feedback", patience=3, tighten=0.5, min_factor=0.25))
    for step, loss in enumerate([1.0, 0.9, 0.8]):
        c.set_iteration(step, loss)
    assert c.bound_in_force() == 1e-2  # improving: unchanged
    for step in range(3, 6):
        c.set_iteration(step, 0.8)
    assert c.bound_in_force() == 5e-3
    for step in range(6, 20):
        c.set_iteration(step, 0.8)
    assert c.bound_in_force() == 2.5e-3  # floored at min_factor
    x = torch.randn(16, BS, generator=torch.Generator().manual_seed(12))
    assert_within_bound(x, round_trip(c, x)[0], block_bounds(x, "rel", 2.5e-3))


def test_table_scales_give_each_table_its_own_bound():
    scales = column_block_scales([2 * BS, BS], {1: 0.1}, BS)
    assert scales == [1.0, 1.0, 0.1]
    c = codec(mode="abs", eb=1e-2, packing="agreed", table_scales=scales)
    assert [c.bound_in_force(i) for i in range(3)] == [1e-2, 1e-2, pytest.approx(1e-3)]
    x = torch.randn(32, 3 * BS, generator=torch.Generator().manual_seed(13))
    decoded, _ = round_trip(c, x)
    error = (decoded - x).abs().double()
    # one width per message: the tight table sets it, and the loose ones get the spare precision
    assert error[:, :2 * BS].max() <= 1e-2 and error[:, 2 * BS:].max() <= 1e-2 * 0.1
    assert c.stats.last_bits == round_trip(codec(mode="abs", eb=1e-3, packing="agreed"), x)[1]
    with pytest.raises(ValueError, match="do not match rows"):
        c.encode(torch.randn(4, 2 * BS), c.create_context())
    fixed = codec(eb=1e-2, table_scales=[1.0, 0.5])
    with pytest.raises(ValueError, match="cannot change mid-run"):
        fixed.set_table_scales([1.0, 0.01])


def test_range_bounds_ask_every_table_for_the_same_relative_precision_in_fewer_bits():
    """Tables whose pooled embeddings spread 160x apart: a uniform absolute bound tight enough for the
    narrowest table spends its width on the widest; bounds from each table's measured range need
    fewer bits for the same precision relative to each table's range (the table-wise level)."""
    stds = torch.tensor([0.05, 0.2, 1.0, 3.0, 0.5, 8.0])
    x = torch.randn(512, 6, BS, generator=torch.Generator().manual_seed(5)) * stds[None, :, None]
    x = x.reshape(512, 6 * BS)
    lo, hi = torch.aminmax(x.reshape(512, 6, BS), dim=2)
    ranges = (hi - lo).amax(dim=0).double()

    def relative_errors(c: ErrorBoundedCodec) -> tuple[torch.Tensor, int]:
        ctx = c.create_context()
        c.padded_size(x, [6 * BS], 0, ctx)
        message = c.encode(x, ctx)
        decoded = c.decode(message, ctx).view_as(x)
        assert c.stats.bound_violations == 0
        worst = (decoded - x).abs().reshape(512, 6, BS).amax(dim=(0, 2))
        return worst / ranges, ctx.bits

    table_wise = codec(mode="abs", eb=1e-2, packing="agreed", table_bounds="range", table_bounds_refresh=50)
    relative, table_wise_bits = relative_errors(table_wise)
    # each table's bound is eb times its range over the typical one: wide tables loosen, narrow tighten
    measured = torch.tensor([table_wise.bound_in_force(i) for i in range(6)], dtype=torch.float64)
    assert torch.allclose(measured, 1e-2 * ranges / ranges.log().mean().exp())
    stats = table_wise.stats_dict()
    assert stats["table_scale_max"] / stats["table_scale_min"] == pytest.approx(float(ranges.max() / ranges.min()))
    # a uniform bound giving the narrowest table the precision the table-wise bounds give it
    uniform = codec(mode="abs", eb=float(relative[0] * ranges[0]), packing="agreed")
    uniform_relative, uniform_bits = relative_errors(uniform)
    assert float(uniform_relative[0]) <= float(relative[0]) * 1.01
    assert table_wise_bits <= uniform_bits - 4, (table_wise_bits, uniform_bits)
    # measured again only every table_bounds_refresh iterations
    version = table_wise._scales_version
    table_wise.set_iteration(10)
    relative_errors(table_wise)
    assert table_wise._scales_version == version
    table_wise.set_iteration(50)
    relative_errors(table_wise)
    assert table_wise._scales_version == version + 1


def test_stats_report_ratio_error_and_throughput():
    x = torch.randn(128, BS, generator=torch.Generator().manual_seed(14)) * 0.1
    c = codec(eb=1e-2, packing="agreed", measure_error=False)
    round_trip(c, x)
    s = c.stats
    assert s.compression_ratio == pytest.approx(4 * BS / bytes_per_block(6, BS))
    assert s.bytes_in == 4 * x.numel() and s.measured_elements == x.numel()
    assert 0 < s.mean_abs_error < s.max_abs_error and s.encode_gbps > 0 and s.decode_gbps > 0
    assert set(s.as_dict()) >= {"compression_ratio", "max_error_over_bound", "bound_violations", "encode_gbps"}
    assert s.verified_elements == 0 and s.measure_seconds == 0  # the encoder's own figures, no second pass
    audited = codec(eb=1e-2, packing="agreed", measure_error=True)
    round_trip(audited, x)
    assert audited.stats.verified_elements == x.numel() and audited.stats.bound_violations == 0
    assert audited.stats.max_error_over_bound == pytest.approx(s.max_error_over_bound, rel=1e-3)


def _two_rank_worker(rank: int, store: str, results) -> None:
    import torch.distributed as dist
    from torchrec.distributed.dist_data import PooledEmbeddingsAllToAll

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        group = dist.group.WORLD
        options = {"mode": "abs", "eb": 1e-3, "packing": "agreed", "block_size": 8, "backward_eb": 1e-2}
        dims = [16, 8]  # this rank's embedding dim sum, per rank
        g = torch.Generator().manual_seed(rank)
        # rank 0's values are small (few bits for 1e-3), rank 1's large (many bits)
        local = torch.randn(4, dims[rank], generator=g) * (0.01 if rank == 0 else 10.0)
        upstream = torch.randn(2, sum(dims), generator=torch.Generator().manual_seed(99))

        def exchange(codecs):
            embeddings = local.clone().requires_grad_()
            out = PooledEmbeddingsAllToAll(group, dims, codecs=codecs)(embeddings).wait()
            (out * upstream).sum().backward()  # gradient of the output = upstream, whatever out is
            return out.detach(), embeddings.grad

        codecs = make_error_bounded_codecs(options, group)
        local_bits = codecs.forward.required_bits(local)
        out, grad = exchange(codecs)
        ref_out, ref_grad = exchange(None)
        bounds = 1e-2 * (ref_grad.view(-1, 8).amax(1) - ref_grad.view(-1, 8).amin(1)).double()
        results.put({
            "rank": rank, "local_bits": local_bits, "agreed_bits": codecs.forward.stats.last_bits,
            "forward_error": float((out - ref_out).abs().max()),
            "grad_ok": bool(((grad - ref_grad).abs().view(-1, 8).amax(1).double() <= bounds).all()),
            "violations": codecs.forward.stats.bound_violations + codecs.backward.stats.bound_violations,
            "backward_calls": codecs.backward.stats.encode_calls,
        })
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_agree_on_the_widest_width_through_torchrec(tmp_path):
    got, exitcodes = run_ranks(_two_rank_worker, str(tmp_path / "store"))
    assert exitcodes == [0, 0]
    assert got[0]["local_bits"] < got[1]["local_bits"]  # the ranks' data need different widths
    assert got[0]["agreed_bits"] == got[1]["agreed_bits"] == got[1]["local_bits"]
    for r in got:
        assert r["forward_error"] <= 1e-3 and r["grad_ok"] and r["violations"] == 0 and r["backward_calls"] == 1


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_cpu_kernels_and_tensor_program_send_the_same_bytes():
    """The C++ kernels (CPU) and the tensor program (every other device) are one format: same
    message bytes, same verdict per block, same decoded floats, on ordinary and adversarial data."""
    from workloads.dlrm.error_bounded import fast_kernels

    kernels = fast_kernels.cpu_kernels()
    assert kernels is not None, "the C++ kernels did not build here (see the warning above)"
    g = torch.Generator().manual_seed(11)
    ordinary = torch.randn(300, 40, generator=g) * 0.1
    for x in (ordinary, adversarial_blocks(100, 40, seed=12).view(-1, 40)):
        x = x.clone()
        x[7, 3] = math.nan
        x[8, 0] = math.inf
        for bits in (0, 1, 3, 7, 8, 9, 13, 16):
            factor = fast_kernels.float32_below(torch.full((x.shape[0],), 1.0 / (2**bits + 1), dtype=torch.float64))
            for rel in (True, False):
                cpp = kernels.encode(x, factor, rel, bits)
                tensor = fast_kernels._encode_tensor(x, factor, rel, bits)
                assert torch.equal(cpp[0], tensor[0]) and torch.equal(cpp[1], tensor[1]), (bits, rel)
                assert torch.equal(cpp[2][:, :2], tensor[2][:, :2]), (bits, rel)  # largest error, ÷ bound
                assert torch.allclose(cpp[2][:, 2], tensor[2][:, 2], rtol=1e-5, atol=0), (bits, rel)  # sums
                assert torch.allclose(cpp[3], tensor[3], rtol=1e-5, atol=0), (bits, rel)
                assert int((cpp[1] == fast_kernels.STATUS_NONFINITE).sum()) == 2
                ours = kernels.decode(cpp[0], bits, 40)
                theirs = fast_kernels._decode_tensor(cpp[0], bits, 40)
                assert torch.equal(ours.isnan(), theirs.isnan())
                assert torch.equal(ours.nan_to_num(), theirs.nan_to_num())


def test_compiled_tensor_program_is_one_graph_per_width_for_every_message_size():
    """On an accelerator the tensor program runs under torch.compile. The width is a constant of the compiled
    program, never a traced integer (traced, ``~low`` broke the graph here and ``1 << bits`` failed to compile
    on torch 2.11 + CUDA), and messages of other row counts reuse the program: the same bytes as the eager
    program, one graph for the encoder whatever the rows, no fallback."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from workloads.dlrm.error_bounded import fast_kernels

    torch._dynamo.reset()
    counters.clear()
    g = torch.Generator().manual_seed(31)
    for rows in (96, 40, 7):
        x = torch.randn(rows, 40, generator=g) * 0.1
        factor = torch.full((rows,), 1e-2)
        compiled = fast_kernels._run_compiled(0, (x, factor), True, 9, 40)
        eager = fast_kernels._encode_tensor(x, factor, True, 9)
        assert not fast_kernels._eager_because, fast_kernels._eager_because
        assert torch.equal(compiled[0], eager[0]) and torch.equal(compiled[1], eager[1])
        assert torch.equal(fast_kernels._run_compiled(1, (compiled[0],), True, 9, 40),
                           fast_kernels._decode_tensor(eager[0], 9, 40))
    encoder_breaks = {reason: n for reason, n in counters["graph_break"].items() if "item()" not in reason}
    assert not encoder_breaks, encoder_breaks  # the decoder's one break is its data-dependent exact-path test
    # the encoder and the decoder's part before its break: one graph each for all three sizes (a traced width
    # split the encoder in three; a static row count compiled it again for every size)
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])


def test_cpu_width_kernels_agree_with_the_tensor_code(monkeypatch):
    """Agreed packing sizes a message from the blocks' min and max; on CPU a C++ loop does it. Same
    min/max as torch.aminmax (NaN blocks included) and the same width as the tensor code, on ordinary,
    wide, nearly constant, subnormal and non-finite blocks, rel and abs."""
    from workloads.dlrm.error_bounded import fast_kernels

    assert fast_kernels.cpu_kernels() is not None
    g = torch.Generator().manual_seed(21)
    blocks = torch.cat([torch.randn(64, BS, generator=g) * 0.1, torch.randn(64, BS, generator=g) * 1e4,
                        1.0 + torch.randn(64, BS, generator=g) * 1e-7, torch.randn(64, BS, generator=g) * 1e-40,
                        adversarial_blocks(64, BS, seed=22).view(-1, BS)])
    blocks[3, 5], blocks[4, 0], blocks[5, 9] = math.nan, math.inf, -math.inf
    lo, hi = fast_kernels.block_minmax(blocks)
    want_lo, want_hi = torch.aminmax(blocks, dim=1)
    assert torch.equal(lo, want_lo) or torch.allclose(lo, want_lo, equal_nan=True, rtol=0, atol=0)
    assert torch.allclose(hi, want_hi, equal_nan=True, rtol=0, atol=0)
    for mode, eb in (("rel", 1e-2), ("rel", 1e-4), ("abs", 1e-3), ("abs", 1e-6)):
        c = codec(mode=mode, eb=eb, packing="agreed", measure_error=False)
        factor, _ = c._block_factors(blocks.shape[0], blocks, None)
        cpp = c._local_bits(blocks, factor)
        monkeypatch.setattr(fast_kernels, "cpu_kernels", lambda: None)
        tensor = c._local_bits(blocks, factor)
        monkeypatch.undo()
        assert cpp == tensor, (mode, eb, cpp, tensor)


def test_ordinary_embeddings_take_the_fast_path():
    x = torch.randn(256, 128, generator=torch.Generator().manual_seed(13)) * 0.1
    c = codec(eb=1e-2)
    decoded, _ = round_trip(c, x)
    assert_within_bound(x, decoded, block_bounds(x, "rel", 1e-2))
    assert c.stats.exact_path_blocks == 0 and c.stats.bound_violations == 0
    assert c.stats.compression_ratio > 3.9  # 7-bit codes + 8-byte header per 64 floats: 4.0


def test_a_build_killed_midway_does_not_block_the_next_one(tmp_path):
    """PyTorch marks a build of the C++ kernels in progress with a ``lock`` file that only the building process
    removes: one killed mid-build (Ctrl-C, a timeout, a restart) left every later run waiting on it forever, in
    silence. A later process clears it, says so, and gets its kernels."""
    import shutil
    import subprocess

    from workloads.dlrm.error_bounded import fast_kernels

    assert fast_kernels.cpu_kernels() is not None
    cache = tmp_path / "extensions"
    built = fast_kernels.build_directory()
    folder = cache / built.name
    shutil.copytree(built, folder, ignore=shutil.ignore_patterns("lock"))  # built already: no compile needed
    (folder / "lock").touch()  # what a build killed midway leaves
    program = ("import logging; logging.basicConfig()\n"
               "from workloads.dlrm.error_bounded import fast_kernels\n"
               "kernels = fast_kernels.cpu_kernels()\n"
               "print('built' if kernels is not None else 'none', fast_kernels.build_directory())\n")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(cache)}
    done = subprocess.run([sys.executable, "-c", program], env=env, cwd=Path(__file__).parents[1],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["built", str(folder)]
    assert f"removing {folder / 'lock'}" in done.stderr and "ended before the build did" in done.stderr
    assert not (folder / "lock").exists()
