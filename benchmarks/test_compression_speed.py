"""Throughput of the error-bounded all-to-all codec: encode and decode of one (4096, 512) float32
message (8 MiB of pooled embeddings), N(0, 0.1) values, on the GPU when there is one.

GB/s counts float32 bytes (the uncompressed side) per second: ``gb_per_s`` from the median round,
``gb_per_s_best`` from the fastest (the steadier figure on a shared machine). Agreed packing
runs without a process group here, so its one-int ``all_reduce`` is not in the figure; the
``measure_error`` rows show what the sender-side decode and error statistics cost on top.
"""

from __future__ import annotations

import pytest
import torch

from workloads.dlrm.compression import ErrorBoundConfig, ErrorBoundedCodec

SHAPE = (4096, 512)
BOUNDS = [("rel", "fixed", 1e-2), ("rel", "fixed", 1e-3), ("rel", "agreed", 1e-2), ("rel", "agreed", 1e-3),
          ("abs", "agreed", 1e-2), ("abs", "agreed", 1e-3)]
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="module")
def embeddings() -> torch.Tensor:
    return (torch.randn(SHAPE, generator=torch.Generator().manual_seed(0)) * 0.1).to(DEVICE)


def _codec(mode: str, packing: str, eb: float, measure_error: bool = False) -> ErrorBoundedCodec:
    return ErrorBoundedCodec(ErrorBoundConfig(mode=mode, eb=eb, packing=packing, measure_error=measure_error))


def _report(benchmark, codec: ErrorBoundedCodec, x: torch.Tensor, bits: int) -> None:
    benchmark.extra_info["gb_per_s"] = 4 * x.numel() / benchmark.stats.stats.median / 1e9
    benchmark.extra_info["gb_per_s_best"] = 4 * x.numel() / benchmark.stats.stats.min / 1e9
    benchmark.extra_info["bits"] = bits
    benchmark.extra_info["compression_ratio"] = codec.stats.compression_ratio
    benchmark.extra_info["device"] = str(DEVICE)


@pytest.mark.parametrize("measure_error", [False, True], ids=["encode", "encode+measure"])
@pytest.mark.parametrize(("mode", "packing", "eb"), BOUNDS, ids=[f"{m}-{p}-{e:g}" for m, p, e in BOUNDS])
def test_encode(benchmark, embeddings, mode, packing, eb, measure_error):
    codec = _codec(mode, packing, eb, measure_error)
    benchmark.group = f"encode {mode} {packing} eb={eb:g}"
    ctx = codec.create_context()
    benchmark.pedantic(codec.encode, args=(embeddings, ctx), rounds=10, warmup_rounds=1)
    _report(benchmark, codec, embeddings, ctx.bits)
    assert codec.stats.bound_violations == 0


@pytest.mark.parametrize(("mode", "packing", "eb"), BOUNDS, ids=[f"{m}-{p}-{e:g}" for m, p, e in BOUNDS])
def test_decode(benchmark, embeddings, mode, packing, eb):
    codec = _codec(mode, packing, eb)
    benchmark.group = f"decode {mode} {packing} eb={eb:g}"
    ctx = codec.create_context()
    message = codec.encode(embeddings, ctx)
    benchmark.pedantic(codec.decode, args=(message, ctx), rounds=10, warmup_rounds=1)
    _report(benchmark, codec, embeddings, ctx.bits)
