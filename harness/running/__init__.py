"""Running one benchmark: open its run and workload (:mod:`.runner`), repeat its steps (:mod:`.loop`), time
them with synchronisation (:mod:`.timing`), turn them into metrics (:mod:`.metrics`) and a summary table
(:mod:`.summary`), show progress (:mod:`.progress`), defer Ctrl-C and SIGTERM (:mod:`.interrupts`), and a
step's tensor-memory peak for the layout planner's check (:mod:`.memory_probe`).

May import :mod:`harness.recording`, the modules at ``harness``'s top level and ``workloads``.
"""
