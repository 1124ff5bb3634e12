"""Federated front end: rPDP-FL, record-level personalized DP in cross-silo federated learning
(Liu, Lou, Xiong, Liu, Meng, CCS 2024; DESIGN.md §3.3).

* ``simulate(...)``: the whole protocol in one process (``pdpfast.fl.simulation``);
* ``pdpfast.fl.flower``: the same clients and server logic on Flower (``flwr``), in process or
  as separate server / client processes;
* ``python -m pdpfast.fl simulate|flower|server|client|launch ...``: the command line.

Names are resolved on first use, so the command line starts without importing torch.
"""
from __future__ import annotations

import importlib

_LAZY = {
    "distributions": "budgets", "sample_budgets": "budgets",
    "LocalUpdate": "client", "Silo": "client", "get_weights": "client", "set_weights": "client",
    "FLConfig": "config", "draw_noise_seed": "config", "draw_sampling_seed": "config", "local_seed": "config",
    "sampled_clients": "config",
    "FederatedData": "datasets", "load_federated": "datasets", "model_factory": "datasets", "partition": "datasets",
    "FederatedLedger": "ledger", "round_rdp": "ledger",
    "METHODS": "methods", "target_budgets": "methods",
    "FederatedResult": "simulation", "aggregate": "simulation", "build_silo": "simulation",
    "resolve_budgets": "simulation", "run_federated": "simulation", "simulate": "simulation",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"pdpfast.fl.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'pdpfast.fl' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_LAZY])


__all__ = sorted(_LAZY)
