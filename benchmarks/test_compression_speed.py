"""Our error-bounded codec against TorchRec's INT8 and FP16 codecs, side by side in one process.

Every codec goes through the same TorchRec ``QuantizedCommCodec`` interface on the same tensors:
pooled embeddings as the all-to-all carries them, rows of 128 float32 values drawn N(0, 0.1), from
64 KiB to 64 MiB per message, on the GPU when there is one. The figure is encode + decode
throughput in float32 GB/s (the uncompressed side) from the median round; ``vs_int8`` divides it
by TorchRec INT8's on the same size (the goal: >= 0.5). Our codec runs as DLRM runs it: fixed
packing, rel bound 1e-2 (7-bit codes) and 1e-3 (10-bit), sender-side error measurement off (its
cost is the ``measure`` row). At the end of the session the table is printed (size × codec × GB/s
× vs INT8 × compression ratio).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from workloads.dlrm.error_bounded import fast_kernels
from workloads.dlrm.error_bounded.codec import ErrorBoundedCodec
from workloads.dlrm.error_bounded.config import ErrorBoundConfig

SIZES = [64 << 10, 1 << 20, 16 << 20, 64 << 20]
ROW = 128
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
_TABLE: dict[tuple[int, str], tuple[float, float]] = {}  # (bytes, codec) → (GB/s, compression ratio)


def _torchrec(precision: str):
    from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig, get_qcomm_codecs

    return get_qcomm_codecs(QCommsConfig(forward_precision=CommType(precision),
                                         backward_precision=CommType(precision))).forward


CODECS: dict[str, Callable[[], object]] = {
    "torchrec-int8": lambda: _torchrec("int8"),
    "torchrec-fp16": lambda: _torchrec("fp16"),
    "eb-rel-1e-2": lambda: ErrorBoundedCodec(ErrorBoundConfig(eb=1e-2, measure_error=False)),
    "eb-rel-1e-3": lambda: ErrorBoundedCodec(ErrorBoundConfig(eb=1e-3, measure_error=False)),
    "eb-rel-1e-2+measure": lambda: ErrorBoundedCodec(ErrorBoundConfig(eb=1e-2, measure_error=True)),
    # agreed packing (one process: no exchange) and the table-wise bounds measured on every message
    "eb-abs-1e-3-agreed": lambda: ErrorBoundedCodec(ErrorBoundConfig(mode="abs", eb=1e-3, packing="agreed")),
    "eb-abs-1e-3-range": lambda: ErrorBoundedCodec(ErrorBoundConfig(mode="abs", eb=1e-3, packing="agreed",
                                                                    table_bounds="range")),
}


@pytest.fixture(scope="module", params=SIZES, ids=[f"{s >> 10}KiB" for s in SIZES])
def embeddings(request) -> torch.Tensor:
    rows = request.param // 4 // ROW
    return (torch.randn(rows, ROW, generator=torch.Generator().manual_seed(0)) * 0.1).to(DEVICE)


def _round_trip(codec, x: torch.Tensor) -> torch.Tensor:
    ctx = codec.create_context()
    message = codec.encode(x, ctx)
    codec.decode(message, ctx)
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    return message


@pytest.mark.parametrize("name", list(CODECS))
def test_encode_decode(benchmark, embeddings, name):
    codec = CODECS[name]()
    nbytes = 4 * embeddings.numel()
    benchmark.group = f"encode+decode {nbytes >> 10} KiB"
    rounds = 30 if nbytes <= (1 << 20) else 10
    message = benchmark.pedantic(_round_trip, args=(codec, embeddings), rounds=rounds, warmup_rounds=2)
    gbps = nbytes / benchmark.stats.stats.median / 1e9
    ratio = nbytes / (message.numel() * message.element_size())  # FP16's message is float16, not bytes
    benchmark.extra_info.update(gb_per_s=gbps, compression_ratio=ratio, device=str(DEVICE),
                                kernel=fast_kernels.kernel_name(DEVICE))
    _TABLE[(nbytes, name)] = (gbps, ratio)
    if name.startswith("eb"):
        assert codec.stats.bound_violations == 0


def codec_table() -> list[str]:
    """The side-by-side table of this run's figures (printed by ``conftest.py`` at the end)."""
    if not _TABLE:
        return []
    lines = [f"codec throughput, encode + decode, {DEVICE} ({fast_kernels.kernel_name(DEVICE)} kernels), "
             f"{torch.get_num_threads()} threads",
             f"{'message':>10}  {'codec':<21} {'GB/s':>6}  {'vs int8':>7}  {'ratio':>5}"]
    for size in SIZES:
        base = _TABLE.get((size, "torchrec-int8"), (float("nan"), 0))[0]
        for name in CODECS:
            if (size, name) in _TABLE:
                gbps, ratio = _TABLE[(size, name)]
                lines.append(f"{size >> 10:>6} KiB  {name:<21} {gbps:6.2f}  {gbps / base:7.2f}  {ratio:5.2f}")
    return lines
