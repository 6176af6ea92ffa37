#!/usr/bin/env python3
"""The accelerator check on a bare machine, offline: one command.

    python3 tools/accelerator_check.py OUT                  # on the accelerator (≤ 10 minutes on one GPU)
    python3 tools/accelerator_check.py OUT --platform cpu   # the dry run, on any machine

Needs only torch (and what a GPU image has: numpy, pyyaml, rich, psutil, jinja2, pandas). What cobench needs
beyond that is installed first, without network, from the wheels ``tools/wheelhouse.sh`` put in ``.whl/``
beside this checkout (into a folder under the system's temporary directory; nothing is installed into the
machine's Python). The steps, the report and the options: ``suite/accelerator_check/``.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / ".whl"
# module → the distribution that provides it (what the check imports beyond a GPU image's packages)
NEEDED = {"hydra": "hydra-core", "omegaconf": "omegaconf", "antlr4": "antlr4-python3-runtime",
          "mlperf_logging": "mlperf-logging", "mlperf_loadgen": "mlcommons-loadgen"}
MARK = "COBENCH_WHEELS_INSTALLED"


def install_wheels() -> None:
    """Install the carried wheels into a private folder and start again with it on the path (once)."""
    missing = [dist for module, dist in NEEDED.items() if importlib.util.find_spec(module) is None]
    if not missing or os.environ.get(MARK):
        return
    wheels = sorted(WHEELS.glob("*.whl"))
    if not wheels:
        sys.exit(f"accelerator check: {', '.join(missing)} missing and no wheels in {WHEELS}: on a machine with "
                 f"PyPI, run tools/wheelhouse.sh and carry .whl/ with the checkout")
    site = Path(tempfile.gettempdir()) / f"cobench-site-py{sys.version_info.major}{sys.version_info.minor}"
    print(f"installing {len(wheels)} wheels from {WHEELS} into {site} (offline) for: {', '.join(missing)}", flush=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, wheels)], check=True)
    path = os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "PYTHONPATH": path, MARK: "1"})


if __name__ == "__main__":
    install_wheels()
    sys.path.insert(0, str(ROOT))
    from suite.accelerator_check.check import main

    sys.exit(main())
