"""What a run leaves behind: the MLflow run (:mod:`.tracking`, :mod:`.credentials`), the MLPerf log
(:mod:`.mlperf_log`) and the platform's fingerprint (:mod:`.fingerprint`).

May import the modules at ``harness``'s top level and ``workloads``; no other harness sub-package.
"""
