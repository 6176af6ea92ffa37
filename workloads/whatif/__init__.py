"""What-if prediction from a trace bundle: no model runs.

:mod:`.graph` (the captured step as an execution graph and its scheduler), :mod:`.costmodel` (the
calibrated cost curves and their microbenchmarks), :mod:`.predict` (layer, batch, sequence and platform
edits → a predicted step), :mod:`.dataparallel` (the data-parallel degree: per-rank batch and cores, the
collectives from the collectives benchmark's busbw table or a stated assumption), :mod:`.changes` (the
changes the CLI takes, parsed and checked) and :mod:`.chakra_export` (the edited graph as a Chakra trace).
"""
