"""pdpfast: individualized differential privacy for PyTorch training.

Every training record carries its own privacy budget; pdpfast turns budgets into per-record
sampling rates and clip bounds, clips per-sample gradients exactly without materializing them, and
keeps a per-record ledger so no record ever exceeds its budget.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

# Public names resolved on first use, so ``import pdpfast`` stays light and submodules can import
# each other without cycles.
_LAZY = {
    "PrivacyEngine": "pdpfast.engine",
    "PrivacyBudgetExceeded": "pdpfast.engine",
    "DPDataLoader": "pdpfast.data",
    "DPOptimizer": "pdpfast.optimizer",
    "calibrate": "pdpfast.accounting",
    "PrivacyPlan": "pdpfast.accounting",
}
_SUBMODULES = {"accounting", "data", "distributed", "engine", "fl", "functional", "nn", "ops", "optimizer", "sampling",
               "validators"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"pdpfast.{name}")
    raise AttributeError(f"module 'pdpfast' has no attribute {name!r}")


__all__ = sorted([*_LAZY, *_SUBMODULES, "__version__"])
