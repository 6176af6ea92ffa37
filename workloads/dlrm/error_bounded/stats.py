"""The error-bounded codec's running totals: bytes in and out, the errors against their bounds, the
blocks that took the exact path or travelled raw, and the time spent encoding, exchanging and decoding."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class CompressionStats:
    """Totals since the last reset. Errors are the encoder's own per-block figures, computed with the
    decoder's arithmetic (so they are what the receiver gets); ``measure_error=True`` also decodes
    every message again and checks each element against its float64 bound (``verified_elements``;
    a violation there counts elements, from the encoder's figures blocks). Non-finite blocks are
    excluded and counted instead."""

    encode_calls: int = 0
    decode_calls: int = 0
    bytes_in: int = 0  # float32 bytes given to encode
    bytes_out: int = 0  # bytes encode produced
    decoded_bytes: int = 0  # float32 bytes decode produced
    measured_elements: int = 0
    max_abs_error: float = 0.0
    sum_abs_error: float = 0.0
    max_error_over_bound: float = 0.0  # <= 1 is the guarantee
    bound_violations: int = 0  # messages with a block over its bound (elements, with measure_error); stays 0
    nonfinite_elements: int = 0
    nonfinite_blocks: int = 0
    exact_path_blocks: int = 0  # blocks float32 rounding could not carry: sent on float64 grids
    lattice_blocks: int = 0  # of those, on the float32-lattice grid (rounding-dominated)
    raw_messages: int = 0  # messages sent as raw float32 (bound below what 16 bits guarantee)
    last_bits: int | None = None
    encode_seconds: float = 0.0  # the size exchange of agreed packing excluded
    exchange_seconds: float = 0.0  # agreed packing's all-reduce: it waits for the slowest rank, like a collective
    decode_seconds: float = 0.0
    verified_elements: int = 0  # measure_error: elements checked by decoding the message again
    measure_seconds: float = 0.0  # measure_error: that second decode and its check

    @property
    def compression_ratio(self) -> float:
        return self.bytes_in / self.bytes_out if self.bytes_out else float("nan")

    @property
    def mean_abs_error(self) -> float:
        return self.sum_abs_error / self.measured_elements if self.measured_elements else float("nan")

    @property
    def encode_gbps(self) -> float:
        """float32 input bytes encoded per second, in GB/s."""
        return self.bytes_in / self.encode_seconds / 1e9 if self.encode_seconds else float("nan")

    @property
    def decode_gbps(self) -> float:
        """float32 output bytes decoded per second, in GB/s."""
        return self.decoded_bytes / self.decode_seconds / 1e9 if self.decode_seconds else float("nan")

    def as_dict(self) -> dict[str, float]:
        """Flat numbers for a metrics logger."""
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "last_bits"}
        values["last_bits"] = self.last_bits if self.last_bits is not None else float("nan")
        for name in ("compression_ratio", "mean_abs_error", "encode_gbps", "decode_gbps"):
            values[name] = getattr(self, name)
        return {k: float(v) for k, v in values.items()}
