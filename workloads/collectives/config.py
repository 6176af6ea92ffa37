"""``workload=collectives``'s config: the schema of ``conf/workload/collectives.yaml``, one collective and
its size sweep. Light: torch and the collectives' code (:mod:`workloads.collectives.ops`, whose names the
checks take) are imported when a config is checked, not when configs are composed."""

from __future__ import annotations

from dataclasses import dataclass

from workloads.base import invalid_config


@dataclass
class CollectivesConfig:
    """``workload=collectives``: nccl-tests' ``-b/-e/-f`` as ``min_bytes/max_bytes/factor``."""

    name: str = "collectives"
    collective: str = "all_reduce"  # one of ops.COLLECTIVES
    dtype: str = "float32"
    min_bytes: int = 1024  # -b
    max_bytes: int = 16 * 2**20  # -e
    factor: int = 4  # -f: each size is the previous times this
    # back-to-back operations per timed sample, their mean time: nccl-tests' -n, default 20 there too. With one
    # op a sample is mostly the ranks' skew leaving the barrier: on a shared 2-core host gloo's 1 KB all-reduce
    # read 0.7-3.6 ms and a 16 KB one slower than 256 KB; with 20, 0.76-1.25 ms up to 1 MB, then rising
    ops_per_sample: int = 20
    check: bool = True  # verify every step's results (outside the timed window)
    root: int = 0  # broadcast and reduce: the root rank
    moe_row_elems: int = 64  # all_to_all_moe: elements per routed token
    moe_skew: float = 1.2  # all_to_all_moe: Zipf exponent of expert popularity (0: uniform routing)
    skip_steps: int = 0  # first steps left out of the statistics: the harness's warm-up

    def __post_init__(self) -> None:
        from workloads.collectives.ops import COLLECTIVES, DTYPES  # torch: imported when a config is checked

        if self.collective not in COLLECTIVES:
            raise invalid_config("collective", f"got {self.collective!r}, allowed values: {', '.join(COLLECTIVES)}")
        if self.dtype not in DTYPES:
            raise invalid_config("dtype", f"got {self.dtype!r}, allowed values: {', '.join(DTYPES)}")
        if self.min_bytes < 1:
            raise invalid_config("min_bytes", f"got {self.min_bytes}, must be >= 1")
        if self.max_bytes < self.min_bytes:
            raise invalid_config("max_bytes", f"got {self.max_bytes}, must be >= min_bytes ({self.min_bytes})")
        if self.factor < 2:
            raise invalid_config("factor", f"got {self.factor}, must be >= 2 (each size is the previous times it)")
        for key in ("ops_per_sample", "moe_row_elems"):
            if getattr(self, key) < 1:
                raise invalid_config(key, f"got {getattr(self, key)}, must be >= 1")
        if self.moe_skew < 0:
            raise invalid_config("moe_skew", f"got {self.moe_skew}, must be >= 0 (0: uniform routing)")
        if self.skip_steps < 0:
            raise invalid_config("skip_steps", f"got {self.skip_steps}, must be >= 0")


__all__ = ["CollectivesConfig"]
