"""The optional compiled extension ``pdpfast._C`` (``csrc/``), imported once for every user.

The package works without it: each user asks ``missing(function, source)`` and runs its torch
route, saying why, when the extension or the function is absent.
"""
from __future__ import annotations

import torch  # noqa: F401  (loads libc10 and libtorch, which the extension links against)

try:
    from pdpfast import _C
except (ImportError, OSError) as exc:
    _C = None
    _IMPORT_ERROR: str | None = f"the C++ extension pdpfast._C could not be imported ({exc})"
else:
    _IMPORT_ERROR = None


def missing(function: str, source: str) -> str | None:
    """Why ``pdpfast._C.<function>`` cannot be used, or None when it can.

    Args:
        function: the extension function's name; source: the ``csrc/`` file that defines it.
    Returns:
        None; or the import error; or that the extension was built without ``source``.
    """
    if _IMPORT_ERROR is not None:
        return _IMPORT_ERROR
    if not hasattr(_C, function):
        return (f"pdpfast._C has no {function} (it was built without csrc/{source}; rebuild with "
                "`pip install --no-build-isolation -e .`)")
    return None
