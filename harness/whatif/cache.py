"""Where what-if keeps what it measured for a bundle: beside it, never inside it (the user's input).

This machine's cost-model curves, a sharded stage timed at W ranks, DDP's gradient sync: each costs
seconds to minutes, so it is kept for the next prediction on the same bundle, in the user's cache
folder (``$COBENCH_CACHE_DIR``, else ``$XDG_CACHE_HOME/cobench``, else ``~/.cache/cobench``) under
``whatif/<bundle name>-<key>/``; the key is made of the bundle's resolved path and its execution
trace's size and modification time, so a bundle captured again into the same folder starts afresh.
Delete the folder to measure again. A kept record, or a timing file made on the target, is read back with
:func:`read_json_file`.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from workloads.trace_bundle import ET_FILE, rank_dirs


def cache_root() -> Path:
    """The user's cobench cache folder."""
    explicit = os.environ.get("COBENCH_CACHE_DIR")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cobench"


def cache_dir(bundle: str | Path) -> Path:
    """The folder what-if keeps ``bundle``'s measured costs in (made here if it is not there yet)."""
    bundle = Path(bundle).resolve()
    trace = rank_dirs(bundle)[0] / ET_FILE
    stat = trace.stat()
    key = hashlib.sha256(f"{bundle}\n{stat.st_size}\n{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    folder = cache_root() / "whatif" / f"{bundle.name}-{key}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def read_json_file(path: Path) -> dict:
    """A JSON object from ``path``, or a ValueError naming the file."""
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not readable as JSON ({err})") from err
    if not isinstance(record, dict):
        raise ValueError(f"{path}: not a JSON object")
    return record
