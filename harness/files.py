"""Writing a run folder's files so that a reader never sees half of one.

A run folder is read while it is written (``cobench upload``, a suite collecting its jobs, a user's
``cat``) and its writer may be killed at any moment (SIGKILL from a scheduler, the machine going
down). Each file is written whole to a hidden temporary file beside it, flushed to disk, then renamed
over the old one: ``os.replace`` within one folder is atomic, so the name holds the old content or
the new, never a torn mix.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

TEMP_PREFIX = "."  # a file being written is hidden: whatever lists a run folder's files skips it


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path``'s content with ``text`` in one step (temporary file + ``os.replace``)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f"{TEMP_PREFIX}{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it 0600: give it the mode open() would have
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    """This process's umask, read without changing it (Linux shows it in /proc; elsewhere set it back)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
