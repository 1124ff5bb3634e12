"""The public settings of an rPDP-FL run and the seeded draws every party can recompute.

Server and clients must agree on these numbers (they are part of the privacy analysis), so they
live in one frozen dataclass that both sides build from the same arguments. The two random draws
of the protocol that are not the engine's own — which clients a round samples, and the seed of a
client's local DP-SGD in a round — are pure functions of (seed, round, client), so an in-process
simulation and a Flower deployment make exactly the same draws.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from .._checks import check_choice, check_in_range, check_int

THREATS = ("clients", "server")
CONVERSIONS = ("standard", "improved")

# Salts keep the client-sampling stream and the local-training stream independent.
_CLIENT_SAMPLING_SALT = 0x5EED_C11E
_LOCAL_TRAINING_SALT = 0x10CA_1DB5


@dataclass(frozen=True)
class FLConfig:
    """Settings of one rPDP-FL run (DESIGN.md §3.3), shared by the server and every client.

    Attributes:
        rounds: T, communication rounds (int ≥ 1).
        local_steps: τ, DP-SGD steps a sampled client runs per round (int ≥ 1).
        client_rate: λ ∈ (0, 1], the probability that the server samples a client in a round
            (independently per client and round).
        noise_multiplier: σ > 0 of local DP-SGD (noise std σ·C).
        max_grad_norm: C > 0, the clip bound of every record.
        delta: δ ∈ (0, 1) of every record's (ε, δ) guarantee.
        lr: local SGD learning rate (> 0).
        method: "rpdp", "minimum", "dropout" or "nonprivate" (see ``pdpfast.fl.methods``).
        threat: the threat model the sampling rates are calibrated for ("clients": others see global
            models, ρ = T·ρ^{τ,λ}; "server": the server sees updates, ρ = λ·T·ρ^τ); both are
            accounted and reported either way.
        conversion: RDP → (ε, δ): "standard" (the paper's) or "improved" (Balle et al. 2020).
        mode, clipping: passed to the engine (``pdpfast.clipping.MODES`` / ``CLIPPINGS``).
        seed: of the model initialization, the client sampling and every local training (int ≥ 0).
    Raises:
        ValueError (from the checks in ``__post_init__``) for a setting out of range or not one of
        the choices.
    """

    rounds: int = 40
    local_steps: int = 10
    client_rate: float = 0.5
    noise_multiplier: float = 4.0
    max_grad_norm: float = 1.0
    delta: float = 1e-4
    lr: float = 0.05
    method: str = "rpdp"
    threat: str = "clients"
    conversion: str = "standard"
    mode: str = "bk"
    clipping: str = "flat"
    seed: int = 0

    def __post_init__(self):
        from ..clipping import check_clipping_options  # the engine's own check (imports torch: lazily)
        from .methods import METHODS

        # numbers are kept as Python ints and floats: a numpy scalar would not survive to_dict's JSON
        # or config_to_argv's text
        for name, value in (("rounds", check_int("rounds", self.rounds, 1)),
                            ("local_steps", check_int("local_steps", self.local_steps, 1)),
                            ("client_rate", check_in_range("client_rate", self.client_rate, low=0.0, high=1.0)),
                            ("noise_multiplier", check_in_range("noise_multiplier", self.noise_multiplier, low=0.0)),
                            ("max_grad_norm", check_in_range("max_grad_norm", self.max_grad_norm, low=0.0)),
                            ("delta", check_in_range("delta", self.delta, low=0.0, high=1.0, high_open=True)),
                            ("lr", check_in_range("lr", self.lr, low=0.0)),
                            ("seed", check_int("seed", self.seed, 0))):
            object.__setattr__(self, name, value)
        check_choice("method", self.method, tuple(METHODS))
        check_choice("threat", self.threat, THREATS)
        check_choice("conversion", self.conversion, CONVERSIONS)
        check_clipping_options(self.mode, self.clipping)

    @property
    def private(self) -> bool:
        """Whether ``method`` trains with clipping, noise and a ledger (False for "nonprivate")."""
        from .methods import METHODS

        return METHODS[self.method].private

    def to_dict(self) -> dict:
        """The settings as a plain dict.

        Returns:
            {field name: value} for every field, in declaration order (JSON-ready).
        """
        return asdict(self)

    def accounting_kwargs(self) -> dict:
        """The keyword arguments of ``pdpfast.accounting.rpdp`` for this run.

        Returns:
            a dict: noise_multiplier, delta, local_steps, rounds, client_rate, conversion.
        """
        return dict(noise_multiplier=self.noise_multiplier, delta=self.delta, local_steps=self.local_steps,
                    rounds=self.rounds, client_rate=self.client_rate, conversion=self.conversion)


def sampled_clients(seed: int, server_round: int, num_clients: int, client_rate: float) -> np.ndarray:
    """(M,) bool: which clients round ``server_round`` (1-based) samples.

    Client-level Poisson sampling: every client independently with probability λ = client_rate
    (never a fixed fraction), so a round may sample no client at all. A pure function of
    (seed, round): the simulation and the Flower strategy draw the same clients.

    Args:
        seed: the run's seed.
        server_round: t, 1-based.
        num_clients: M.
        client_rate: λ in (0, 1].
    Returns:
        (M,) bool, True for the sampled clients.
    Raises:
        ValueError (TypeError for a non-number) for a seed < 0, a round < 1, no clients or λ outside (0, 1].
    """
    check_int("seed", seed, 0)
    check_int("server_round", server_round, 1)
    check_int("num_clients", num_clients, 1)
    client_rate = check_in_range("client_rate", client_rate, low=0.0, high=1.0)
    rng = np.random.default_rng([_CLIENT_SAMPLING_SALT, int(seed), int(server_round)])
    return rng.random(int(num_clients)) < client_rate


def local_seed(seed: int, server_round: int, client_id: int) -> int:
    """The seed of one client's local DP-SGD in one round (its record draws and noise).

    Args:
        seed: the run's seed.
        server_round: t, 1-based.
        client_id: 0..M−1.
    Returns:
        a seed ≥ 0, a pure function of the three.
    Raises:
        ValueError (TypeError for a non-int) for a seed or client_id < 0, or a round < 1.
    """
    check_int("seed", seed, 0)
    check_int("server_round", server_round, 1)
    check_int("client_id", client_id, 0)
    state = np.random.SeedSequence([_LOCAL_TRAINING_SALT, int(seed), int(server_round), int(client_id)])
    return int(state.generate_state(1, np.uint64)[0] >> np.uint64(2))
