"""``python -m suite.accelerator_check``: the accelerator check's command (and each child step's)."""

import sys

from suite.accelerator_check.check import main

sys.exit(main())
