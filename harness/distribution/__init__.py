"""Runs beyond one process group: benchmarks as jobs on a scheduler through Hydra's launchers
(:mod:`.scheduler`) and the torchft failure scenario (:mod:`.ft`). Process-group set-up itself, which every
run shares, is :mod:`harness.distributed`.

May import :mod:`harness.running`, :mod:`harness.recording`, the modules at ``harness``'s top level and
``workloads``.
"""
