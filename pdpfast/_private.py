"""What ``PrivacyEngine.make_private`` returns: named parts that still unpack as Opacus's tuples.

Opacus returns ``(module, optimizer, data_loader)``, or ``(module, optimizer, criterion,
data_loader)`` in ghost mode; code written for Opacus unpacks those, so the tuples keep their length
and order. pdpfast's own callers read the parts by name (``made.optimizer``, ``made.criterion``)
instead of counting items. A leaf module: it imports nothing of the package.
"""
from __future__ import annotations

from typing import Any, NamedTuple


class MadePrivate(NamedTuple):
    """``make_private``'s result outside ghost mode; unpacks as (module, optimizer, data_loader).

    module: the converted model (or, with ``wrap_model=False``, an object whose ``cleanup()``
    detaches the engine); optimizer: the ``DPOptimizer``; data_loader: the Poisson loader (or the
    user's loader with ``poisson_sampling=False``). ``criterion`` is None: the loss is the caller's.
    """

    module: Any
    optimizer: Any
    data_loader: Any
    criterion = None     # not a field: outside ghost mode the engine does not wrap the loss


class MadePrivateGhost(NamedTuple):
    """``make_private``'s result in ghost mode; unpacks as (module, optimizer, criterion,
    data_loader). criterion: the ``DPCriterion`` wrapping the caller's loss (its ``backward`` runs
    the two ghost passes)."""

    module: Any
    optimizer: Any
    criterion: Any
    data_loader: Any

