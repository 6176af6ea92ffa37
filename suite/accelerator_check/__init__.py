"""The accelerator check: what cobench does on this machine's device, step by step, each step PASS, FAIL
or SKIPPED with its reason and figures (:mod:`suite.accelerator_check.check` runs it and is its command;
``tools/accelerator_check.py`` runs it on a bare machine)."""
