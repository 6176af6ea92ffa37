"""Sequence recommender with FreeScale-style load balancing across ranks (``workload=seqrec``)."""

from workloads.base import declare, lazy_attributes

declare("seqrec", "workloads.seqrec.workload",
        "Sequence recommender on jagged histories with FreeScale-style load balancing",
        config="workloads.seqrec.config:SeqRecConfig")

# the public names, imported on first use: the package itself stays cheap to import
EXPORTS = {
    "workloads.seqrec.balance": ["CostModel", "bubble_fraction", "fit_cost_model", "partition"],
    "workloads.seqrec.batch": ["SeqBatch"],
    "workloads.seqrec.config": ["PRESETS", "SeqRecConfig", "SeqRecShape"],
    "workloads.seqrec.data": ["LengthDistribution", "PlantedPreferences"],
    "workloads.seqrec.model": ["SeqRecModel"],
    "workloads.seqrec.movielens": ["MovieLensSource", "load_ratings"],
    "workloads.seqrec.simulate": ["ScalePrediction", "simulate_scaling"],
    "workloads.seqrec.workload": ["SeqRecWorkload"],
}
__getattr__ = lazy_attributes(__name__, EXPORTS)
__all__ = sorted(name for names in EXPORTS.values() for name in names)
