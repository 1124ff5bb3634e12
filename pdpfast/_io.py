"""Crash-safe file writes, for everything that records spent privacy budget."""
from __future__ import annotations

import os
import tempfile
from typing import BinaryIO, Callable


def atomic_write(path, write: Callable[[BinaryIO], None]) -> None:
    """Write ``path`` through ``write(file)`` so a crash leaves the old file or the new one, never a
    half-written one: temp file in the same directory, fsync, os.replace, fsync the directory."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    try:
        dir_fd = os.open(directory, os.O_RDONLY)
    except OSError:  # platforms without directory file descriptors
        return
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
