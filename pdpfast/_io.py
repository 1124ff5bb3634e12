"""Crash-safe file writes, for everything that records spent privacy budget, and the checks of
output paths that commands run before doing any work."""
from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable
from typing import BinaryIO


def atomic_write(path, write: Callable[[BinaryIO], None]) -> None:
    """Write a file atomically: a crash leaves the old file or the new one, never a half-written
    one (temp file in the same directory, fsync, os.replace, fsync the directory).

    Args:
        path: the file; write: ``write(binary file)`` writes the contents.
    Returns:
        None.
    """
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


def check_output_path(path, option: str) -> str:
    """Check an output path before a command does any work, so a bad path fails in a second rather
    than after a whole training run.

    Args:
        path: where the command will write; option: the option that named it (for the message).
    Returns:
        the absolute path. Raises ValueError naming ``option`` if it is a directory or its nearest
        existing parent is not a writable directory (missing parents are created when writing).
    """
    shown = os.fspath(path)
    full = os.path.abspath(shown)
    if os.path.isdir(full):
        raise ValueError(f"{option} {shown!r} is a directory; give a file path")
    parent = os.path.dirname(full)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ValueError(f"{option} {shown!r} cannot be created: {parent!r} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{option} {shown!r} cannot be created: directory {parent!r} is not writable")
    return full


def check_outputs_spare_inputs(outputs: dict, inputs: dict) -> None:
    """Refuse an output that names one of the command's input files (``--out budgets.npy`` used to
    replace the budgets with the plan's JSON, silently).

    Args:
        outputs: option → output path; inputs: option → input path or None (not given).
    Returns:
        None. Raises ValueError naming both options.
    """
    for out_option, out in outputs.items():
        for in_option, src in inputs.items():
            if src is not None and os.path.exists(out) and os.path.exists(src) and os.path.samefile(out, src):
                raise ValueError(f"{out_option} {os.fspath(out)!r} is the {in_option} input file; give the output its "
                                 "own path")


def remove_stale_temporaries(path) -> list[str]:
    """Remove temporary files that an atomic write of ``path`` left behind when its process was
    killed (SIGKILL, power loss) between creating and renaming them. Call it when a command starts
    writing ``path`` again: a live writer of the same path would be a second run on the same
    output, which is refused anyway.

    Args:
        path: the output file.
    Returns:
        the removed paths.
    """
    full = os.path.abspath(os.fspath(path))
    directory, name = os.path.split(full)
    if not os.path.isdir(directory):
        return []
    random = "[a-z0-9_]{8}"         # tempfile's random part
    patterns = [re.compile(re.escape(f".{name}-") + random + re.escape(".tmp") + "$"),      # atomic_write
                re.compile(re.escape(f".{name}.") + random + re.escape(os.path.splitext(name)[1]) + "$")]  # plots
    removed = []
    for entry in os.listdir(directory):
        candidate = os.path.join(directory, entry)
        if any(p.match(entry) for p in patterns) and os.path.isfile(candidate):
            try:
                os.unlink(candidate)
                removed.append(candidate)
            except FileNotFoundError:
                pass
    return removed
