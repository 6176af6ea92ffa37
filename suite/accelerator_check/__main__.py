"""``python -m suite.accelerator_check``: the accelerator check's command (and each child step's)."""

import os
import sys

from suite.accelerator_check.check import main

code = main()
if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # a step's rank under torchrun: past the interpreter's teardown
    from harness.distributed import exit_rank

    exit_rank(code)
sys.exit(code)
