"""What-if's engine: a captured step's time predicted under changes, and what that needs measured on this host.

:mod:`.run` (a bundle and its changes → a prediction: the curves, the data-parallel degree, the measured costs,
the edited graph as a Chakra trace; a platform's curves measured), :mod:`.costs` (TorchRec's sharded stage and
DDP's gradient synchronisation at W ranks: a timing file, the bundle's what-if cache, or pooled ``torchrun``
launches of the probes), :mod:`.stage_probe` and :mod:`.sync_probe` (those two timings, each run under
``torchrun`` by its own entry point), :mod:`.validate` (a prediction's error against real runs). The models
they drive — the graph, the cost curves, the edits — are :mod:`workloads.whatif`. This package may import
``workloads``, never ``suite``.
"""
