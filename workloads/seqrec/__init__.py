"""Sequence recommender with FreeScale-style load balancing across ranks (``workload=seqrec``)."""

from workloads.seqrec.balance import CostModel, bubble_fraction, fit_cost_model, partition
from workloads.seqrec.data import LengthDistribution, PlantedPreferences, SeqBatch
from workloads.seqrec.model import PRESETS, SeqRecModel, SeqRecShape
from workloads.seqrec.simulate import ScalePrediction, simulate_scaling
from workloads.seqrec.workload import SeqRecConfig, SeqRecWorkload

__all__ = [
    "PRESETS",
    "CostModel",
    "LengthDistribution",
    "PlantedPreferences",
    "ScalePrediction",
    "SeqBatch",
    "SeqRecConfig",
    "SeqRecModel",
    "SeqRecShape",
    "SeqRecWorkload",
    "bubble_fraction",
    "fit_cost_model",
    "partition",
    "simulate_scaling",
]
