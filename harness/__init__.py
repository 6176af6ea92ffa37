"""Generic machinery that runs, times, records and judges benchmarks; it knows no model.

Sub-packages by concern, each importing only the ones listed before it and the modules here:
:mod:`.recording` (MLflow, MLPerf logs, fingerprints), :mod:`.running` (a benchmark's run: the runner,
the repetition loop, timing, metrics, the summary), :mod:`.distribution` (runs as cluster jobs, the torchft
failure scenario), :mod:`.traces` (capture and the side-by-side fidelity judgement), :mod:`.whatif`
(prediction from a trace). The modules at this level are what every concern shares: the typed config
(:mod:`.config`) and a benchmark's identity (:mod:`.identity`), the platform (:mod:`.platform`,
:mod:`.cost`), the process group (:mod:`.distributed`), atomic writes (:mod:`.files`), and :mod:`.cli` (the
``run`` command, exit codes and error handling).
The harness may import ``workloads`` (the protocol and the registry), never ``suite``.
"""
