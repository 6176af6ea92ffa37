"""NumPy arrays read in place: an ``.npy`` file or a member of an uncompressed ``.npz``, row ranges ``pread``
straight into the caller's buffers through one descriptor per file (``pread`` has no file position, so threads
share it). A file shorter than its header says, now or mid-run, is a :class:`DataError` naming it (an ``mmap``
would die of SIGBUS instead).
"""

from __future__ import annotations

import os
import struct
import threading
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from workloads.data_source import DataError

_HEADER_READERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}


@dataclass(frozen=True)
class StoredArray:
    """A C-order 2-D array stored at ``offset`` of ``path`` (an ``.npy`` file or a member of an ``.npz``)."""

    path: Path
    name: str  # how errors call it: the file, or file:member
    offset: int
    dtype: np.dtype
    rows: int
    width: int

    def read_into(self, start: int, stop: int, out: np.ndarray) -> None:
        """Rows ``[start, stop)`` into ``out`` (contiguous, as many elements; another dtype is converted), read
        straight from the file; a :class:`DataError` if the file is shorter now than when it was checked."""
        if out.dtype != self.dtype:
            out.reshape(-1)[:] = self.read(start, stop).reshape(-1)
            return
        row_bytes = self.width * self.dtype.itemsize
        want = (stop - start) * row_bytes
        got = os.preadv(_descriptor(self.path), [out.reshape(-1).view(np.uint8)], self.offset + start * row_bytes)
        if got != want:
            raise DataError(f"{self.name}: rows {start}…{stop} could not be read (the file ends early: it was "
                            f"truncated or replaced while training); copy it again or re-run "
                            f"`cobench data prepare criteo`")

    def read(self, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` as a new ``[n, width]`` array."""
        out = np.empty((stop - start, self.width), dtype=self.dtype)
        self.read_into(start, stop, out)
        return out


_DESCRIPTORS: dict[Path, int] = {}  # one read-only descriptor per file, shared by threads (pread has no position)
_DESCRIPTORS_LOCK = threading.Lock()


def _descriptor(path: Path) -> int:
    with _DESCRIPTORS_LOCK:
        if path not in _DESCRIPTORS:
            _DESCRIPTORS[path] = os.open(path, os.O_RDONLY)
        return _DESCRIPTORS[path]


def close_files() -> None:
    """Close the descriptors reading opened (the next read opens its file again)."""
    with _DESCRIPTORS_LOCK:
        for descriptor in _DESCRIPTORS.values():
            os.close(descriptor)
        _DESCRIPTORS.clear()


def _array_header(handle: BinaryIO, name: str) -> tuple[np.dtype, tuple[int, ...], int]:
    try:
        version = np.lib.format.read_magic(handle)
        if version not in _HEADER_READERS:
            raise ValueError(f"format version {version} (np.save writes 1.0 or 2.0)")
        shape, fortran_order, dtype = _HEADER_READERS[version](handle)
    except ValueError as err:
        raise DataError(f"{name}: not a NumPy array file ({err}); re-run `cobench data prepare criteo`") from err
    if fortran_order or len(shape) not in (1, 2):
        raise DataError(f"{name}: expected a C-order 2-D array, got shape {shape} "
                        f"({'Fortran' if fortran_order else 'C'} order)")
    return np.dtype(dtype), tuple(shape), handle.tell()


def _stored(path: Path, name: str, dtype: np.dtype, shape: tuple[int, ...], offset: int) -> StoredArray:
    rows, width = (shape[0], shape[1]) if len(shape) == 2 else (shape[0], 1)
    array = StoredArray(path, name, offset, dtype, rows, width)
    if offset + rows * width * dtype.itemsize > path.stat().st_size:
        raise DataError(f"{name}: its header says {rows} rows but the file is shorter (truncated); copy it again "
                        f"or re-run `cobench data prepare criteo`")
    return array


def open_npy(path: Path) -> StoredArray:
    with open(path, "rb") as handle:
        dtype, shape, offset = _array_header(handle, path.name)
    return _stored(path, path.name, dtype, shape, offset)


def open_npz(path: Path, members: Sequence[str]) -> list[StoredArray]:
    """The named ``.npy`` members of an uncompressed ``.npz``, read in place (the zip's local headers give
    where each member's bytes start)."""
    try:
        archive = zipfile.ZipFile(path)
    except zipfile.BadZipFile as err:
        raise DataError(f"{path.name}: not a readable .npz ({err}); re-run `cobench data prepare criteo`") from err
    with archive, open(path, "rb") as handle:
        present = {info.filename: info for info in archive.infolist()}
        missing = [m for m in members if f"{m}.npy" not in present]
        if missing:
            raise DataError(f"{path.name}: no array {', '.join(missing)} (expected one array per sparse feature, "
                            f"named 0 … {len(members) - 1}; it has {', '.join(sorted(present)) or 'none'})")
        arrays = []
        for member in members:
            info = present[f"{member}.npy"]
            if info.compress_type != zipfile.ZIP_STORED:
                raise DataError(f"{path.name}: array {member} is compressed (np.savez_compressed); it must be "
                                f"stored (np.savez) to be read in place")
            handle.seek(info.header_offset)
            local = handle.read(30)
            name_len, extra_len = struct.unpack("<HH", local[26:30])
            handle.seek(info.header_offset + 30 + name_len + extra_len)
            name = f"{path.name}:{member}"
            dtype, shape, offset = _array_header(handle, name)
            arrays.append(_stored(path, name, dtype, shape, offset))
    return arrays


def npz_member_count(path: Path) -> int:
    try:
        with zipfile.ZipFile(path) as archive:
            count = sum(1 for info in archive.infolist() if info.filename.removesuffix(".npy").isdigit())
    except zipfile.BadZipFile as err:
        raise DataError(f"{path.name}: not a readable .npz ({err}); re-run `cobench data prepare criteo`") from err
    if not count:
        raise DataError(f"{path.name}: no arrays named 0, 1, … (one per sparse feature); re-run "
                        f"`cobench data prepare criteo --multi-hot`")
    return count
