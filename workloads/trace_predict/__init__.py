"""What-if prediction beyond the captured graph's own edits (issue 19, second part).

The graph, its layer/batch/sequence/platform edits and the scheduler live in :mod:`workloads.whatif`;
this package adds what a data-parallel re-configuration needs (:mod:`.dataparallel`: per-rank batch,
cores per rank, the gradient all-reduce from the collectives benchmark's busbw table or a stated
assumption) and the export of an edited graph as a Chakra execution trace (:mod:`.chakra_export`).
Nothing here runs a model.
"""
