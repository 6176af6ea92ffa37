"""What-if prediction: a captured step's time predicted under changes, from its trace bundle alone.

The models: :mod:`.graph` (the captured step as an execution graph and its scheduler), :mod:`.costmodel`
(the calibrated cost curves and their microbenchmarks), :mod:`.predict` (layer, batch, sequence and platform
edits → a predicted step), :mod:`.jagged` (batch edits of jagged, per-sample-length steps),
:mod:`.dataparallel` (the data-parallel degree: per-rank batch and cores, the collectives from the
collectives benchmark's busbw table or a stated assumption), :mod:`.changes` (the command line's changes,
parsed and checked), :mod:`.chakra_export` (the edited graph as a Chakra trace) and :mod:`.cache` (measured
costs kept beside, never inside, the user's bundle).

The engine: :mod:`.run` (a bundle and its changes → a prediction; a platform's curves measured),
:mod:`.costs` (TorchRec's sharded stage and DDP's gradient synchronisation at W ranks: a timing file, the
cache, or pooled ``torchrun`` launches of the probes), :mod:`.stage_probe` and :mod:`.sync_probe` (those two
timings, each run under ``torchrun`` by its own entry point), :mod:`.validate` (a prediction's error against
real runs).

May import :mod:`harness.traces` (the side-by-side timing validation uses), :mod:`harness.running`,
:mod:`harness.recording`, the modules at ``harness``'s top level and ``workloads`` (the trace parsing, the
registry, the collectives table).
"""
