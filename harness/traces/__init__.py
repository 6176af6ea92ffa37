"""Generated trace benchmarks, the harness's side: capture a workload's steps into a trace bundle
(:mod:`.capture`, with the floats it reads profiled by :mod:`.capture_values`) and judge the replay against
the program side by side (:mod:`.judge`; the interleaved timing and its verdict, :mod:`.side_by_side`; a
step's memory peak from the allocator's events, :mod:`.allocator_peaks`). The bundle format, the spec and the
replay itself are the ``generated`` workload, :mod:`workloads.trace_replay`.

May import :mod:`harness.running`, :mod:`harness.recording`, the modules at ``harness``'s top level and
``workloads``.
"""
