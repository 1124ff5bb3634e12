"""The public settings of an rPDP-FL run, the server's secret draw and a client's secret one.

Server and clients must agree on these numbers (they are part of the privacy analysis), so they
live in one frozen dataclass that both sides build from the same arguments; the server sends them
with every fit (``settings_differences`` names what a client's own differ in). Two random draws
of the protocol are not the engine's own:

* which clients a round samples: a function of a **secret** sampling seed that only the server
  knows, and the round. The "clients" ε amplifies by client sampling, which holds only against
  parties who cannot tell which rounds a client took part in; were the sampling a function of the
  public seed, every client could compute every other's rounds. The server draws it from
  ``os.urandom`` unless one is given (experiments: then a simulation and a Flower server given the
  same one sample the same clients);
* the seed of a client's local DP-SGD in a round (its record draws and its noise): a function of
  a **secret** noise seed that only the client knows, the round and the client id. Whoever knows
  the noise seed can recompute that noise and subtract it from the client's update, so it is
  never part of ``FLConfig`` nor sent by the server: a client draws it from ``os.urandom`` unless
  one is given, which only experiments should do (it makes runs reproducible bit for bit).
"""
from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields

import numpy as np

from .._checks import check_choice, check_in_range, check_int

THREATS = ("clients", "server")
CONVERSIONS = ("standard", "improved")
# the FLConfig fields only the private methods read (the nonprivate baseline trains without clipping,
# noise or a ledger)
PRIVATE_FIELDS = ("noise_multiplier", "max_grad_norm", "delta", "threat", "conversion", "mode", "clipping")

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
        threat: the threat model whose ε the sampling rates are calibrated for and every client's
            ledger enforces: "clients" (other clients and third parties see the global models,
            ρ = T·ρ^{τ,λ}, charged every round) or "server" (an honest-but-curious server sees the
            updates of the clients it samples: ρ^τ per round the client takes part in, calibrated
            for λ·T·ρ^τ, its expectation; this guarantee covers the others too, who see less). The
            other model's ε is accounted and reported for comparison, not enforced.
        conversion: RDP → (ε, δ): "standard" (the paper's) or "improved" (Balle et al. 2020).
        mode, clipping: passed to the engine (``pdpfast.clipping.MODES`` / ``CLIPPINGS``).
        seed: public (the server needs it): of the model initialization, the split and the budget
            draws of the built-in data sets (int ≥ 0). It seeds neither the client sampling (the
            server's secret sampling seed, ``draw_sampling_seed``) nor the local training (each
            client's secret noise seed, ``draw_noise_seed``).
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


def sampled_clients(sampling_seed: int, server_round: int, num_clients: int, client_rate: float) -> np.ndarray:
    """(M,) bool: which clients round ``server_round`` (1-based) samples.

    Client-level Poisson sampling: every client independently with probability λ = client_rate
    (never a fixed fraction), so a round may sample no client at all. A pure function of
    (sampling seed, round): the simulation and the Flower strategy given the same seed draw the
    same clients.

    Args:
        sampling_seed: the server's secret sampling seed (``draw_sampling_seed``), never the run's
            public seed: the "clients" bound amplifies by client sampling, which holds only against
            parties who do not know which rounds a client took part in.
        server_round: t, 1-based.
        num_clients: M.
        client_rate: λ in (0, 1].
    Returns:
        (M,) bool, True for the sampled clients.
    Raises:
        ValueError (TypeError for a non-number) for a seed < 0, a round < 1, no clients or λ outside (0, 1].
    """
    check_int("sampling_seed", sampling_seed, 0)
    check_int("server_round", server_round, 1)
    check_int("num_clients", num_clients, 1)
    client_rate = check_in_range("client_rate", client_rate, low=0.0, high=1.0)
    rng = np.random.default_rng([_CLIENT_SAMPLING_SALT, int(sampling_seed), int(server_round)])
    return rng.random(int(num_clients)) < client_rate


def settings_differences(config: FLConfig, settings: Mapping) -> list[str]:
    """The public settings in which another party's differ from ``config`` (what a client checks the
    server's fit config against, and the server a client's properties).

    Args:
        config: this party's settings.
        settings: the other party's, {field name: value} (e.g. ``FLConfig.to_dict()`` sent over Flower);
            other keys are ignored.
    Returns:
        one "name: value (theirs) vs value (ours)" per field that differs or is missing ("missing" as
        their value), in declaration order; [] when they agree.
    """
    out = []
    for f in fields(FLConfig):
        ours = getattr(config, f.name)
        if f.name not in settings:
            out.append(f"{f.name}: missing vs {ours!r}")
        elif settings[f.name] != ours:
            out.append(f"{f.name}: {settings[f.name]!r} vs {ours!r}")
    return out


def draw_noise_seed(noise_seed: int | None = None) -> int:
    """A client's noise seed: the one given, checked, or a fresh secret one.

    Args:
        noise_seed: None (a fresh secret from ``os.urandom``) or an int in [0, 2**63 − 1] (only for
            experiments: whoever knows it can recompute the client's noise and record draws).
    Returns:
        the noise seed, an int ≥ 0.
    Raises:
        ValueError for a value that is not None nor an int in [0, 2**63 − 1].
    """
    return _secret_seed("noise_seed", noise_seed)


def draw_sampling_seed(sampling_seed: int | None = None) -> int:
    """The server's client-sampling seed: the one given, checked, or a fresh secret one.

    Args:
        sampling_seed: None (a fresh secret from ``os.urandom``) or an int in [0, 2**63 − 1] (only for
            experiments: whoever knows it knows which rounds every client took part in, and the
            "clients" ε, which counts on that being secret, does not hold against them).
    Returns:
        the sampling seed, an int ≥ 0.
    Raises:
        ValueError for a value that is not None nor an int in [0, 2**63 − 1].
    """
    return _secret_seed("sampling_seed", sampling_seed)


def _secret_seed(name: str, value: int | None) -> int:
    if value is None:
        return secrets.randbits(63)   # secrets reads os.urandom
    return check_int(name, value, 0)


def local_seed(noise_seed: int, server_round: int, client_id: int) -> int:
    """The seed of one client's local DP-SGD in one round (its record draws and noise).

    Args:
        noise_seed: the client's secret noise seed (``draw_noise_seed``), never the run's public seed:
            anyone who can compute this seed can remove the client's noise from its update.
        server_round: t, 1-based.
        client_id: 0..M−1.
    Returns:
        a seed ≥ 0, a pure function of the three.
    Raises:
        ValueError (TypeError for a non-int) for a noise_seed or client_id < 0, or a round < 1.
    """
    check_int("noise_seed", noise_seed, 0)
    check_int("server_round", server_round, 1)
    check_int("client_id", client_id, 0)
    state = np.random.SeedSequence([_LOCAL_TRAINING_SALT, int(noise_seed), int(server_round), int(client_id)])
    return int(state.generate_state(1, np.uint64)[0] >> np.uint64(2))
