"""Collective communication benchmarks, nccl-tests style (``workload=collectives``)."""

from workloads.base import declare, lazy_attributes

declare("collectives", "workloads.collectives.workload",
        "One collective (all_reduce, all_gather, reduce_scatter, all_to_all, broadcast, ...) over a size sweep",
        config="workloads.collectives.config:CollectivesConfig")

EXPORTS = {
    "workloads.collectives.config": ["CollectivesConfig"],
    "workloads.collectives.ops": ["COLLECTIVES", "bus_factor", "make_buffers", "moe_routing", "sweep_sizes"],
    "workloads.collectives.table": ["COLUMNS", "SweepRow", "read_sweep_table", "write_sweep_table"],
    "workloads.collectives.workload": ["CollectivesWorkload"],
}
__getattr__ = lazy_attributes(__name__, EXPORTS)
__all__ = sorted(name for names in EXPORTS.values() for name in names)
