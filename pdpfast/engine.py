"""PrivacyEngine: turn an ordinary training loop into individualized DP-SGD (DESIGN.md §1)."""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import warnings
from contextlib import contextmanager

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from ._checks import (
    as_budget_vector,
    as_per_record,
    check_choice,
    check_delta,
    check_flag,
    check_int,
    check_nonnegative,
    check_positive,
    check_rate,
    is_cpu_rng_state,
    warn_large_delta,
)
from ._io import atomic_write
from ._private import MadePrivate, MadePrivateGhost
from .clipping import DATA_PARALLEL_REFUSAL, ClippingState, Phase, check_clipping_options, refuse_sequence_first
from .data import DPDataLoader, PhysicalBatch, check_whole_dataset_sampler, map_style_length
from .distributed import (
    active_ddp_wrapper,
    data_fingerprint,
    generator_fingerprint,
    inner_module,
    plan_fingerprint,
    process_group_size,
    unwrap,
)
from .models import is_causal_lm
from .nn.convert import convert, unsupported_modules
from .optimizer import SECURE_MODE_REFUSAL, DPOptimizer, noise_seed_from


class PrivacyBudgetExceeded(RuntimeError):
    """Raised by ``optimizer.step()`` when the step would take a record past its budget."""


class DPLoss:
    """The loss of a ghost-mode step: ``backward()`` runs the two passes over per-sample losses.

    Args:
        per_sample: (B,) per-sample losses.
        state: the ``ClippingState`` of the open batch.
        reduction: "mean" or "sum", how ``value`` reduces the per-sample losses.
    """

    def __init__(self, per_sample: torch.Tensor, state: ClippingState, reduction: str):
        self.per_sample = per_sample
        self._state = state
        self.value = (per_sample.mean() if reduction == "mean" else per_sample.sum()).detach()

    def backward(self) -> None:
        """The ghost backward (``ClippingState.ghost_backward``): clipped sums into ``param.grad``.

        Returns:
            None; the clipped sums Σ_i w_i g_i are in ``param.grad`` and the batch's state is ``CLIPPED``.
        Raises:
            RuntimeError when the batch is no longer open (e.g. ``backward()`` called twice).
        """
        self._state.ghost_backward(self.per_sample)

    def item(self) -> float:
        """The reduced loss as a Python float (synchronises with the device).

        Returns:
            the mean or sum of the per-sample losses, a float.
        """
        return self.value.item()

    def detach(self) -> torch.Tensor:
        """The reduced loss without a graph.

        Returns:
            a 0-dim tensor, the per-sample losses' dtype and device.
        """
        return self.value

    def __float__(self) -> float:
        return self.item()

    def __iter__(self):
        # torch.amp.GradScaler.scale(loss) iterates what is not a tensor; say why it cannot scale this one
        raise TypeError("a ghost-mode loss (DPLoss) is not a tensor and cannot be iterated or scaled: if "
                        "torch.amp.GradScaler.scale(loss) called this, loss scaling is not supported (its scale "
                        "multiplies every per-sample gradient before the clipping, and its unscale divides the "
                        "clipped sum before the noise). Train under torch.autocast(device_type, "
                        "dtype=torch.bfloat16), which needs no scaler, and call loss.backward()")

    def __repr__(self) -> str:
        return f"DPLoss({self.value.item():.6g})"


class DPCriterion:
    """Wraps a torch loss module so it returns a ``DPLoss`` built from per-sample losses.

    Calling it runs the loss with reduction "none"; losses of more than one dim (e.g. token-level (B, T))
    are reduced per record (mean or sum, as ``reduction``) to (B,).

    Args:
        criterion: a torch loss module with a ``reduction`` attribute (copied, not changed).
        state: the engine's ``ClippingState``; reduction: "mean" or "sum".
    Raises:
        TypeError if ``criterion`` has no ``reduction`` attribute; a call raises ValueError for (k·B,) losses,
        token losses flattened over the batch, whose records it cannot tell apart.
    """

    def __init__(self, criterion: nn.Module, state: ClippingState, reduction: str):
        if not hasattr(criterion, "reduction"):
            raise TypeError("criterion must be a torch loss module with a `reduction` attribute "
                            f"(e.g. nn.CrossEntropyLoss()), got {type(criterion).__name__}")
        self.criterion = copy.copy(criterion)
        self.criterion.reduction = "none"
        self.state, self.reduction = state, reduction

    def __call__(self, *args, **kwargs) -> DPLoss:
        per_sample = self.criterion(*args, **kwargs)
        B = self.state.batch_size
        if per_sample.dim() == 1 and B and per_sample.shape[0] != B and per_sample.shape[0] % B == 0:
            raise ValueError(
                f"the criterion returned {per_sample.shape[0]} losses for a batch of {B} records: token losses "
                "flattened over the batch (logits.view(-1, V)) cannot be told apart by record here; pass them "
                "unflattened, e.g. criterion(logits.transpose(1, 2), labels) with logits (B, T, V) and labels "
                "(B, T), which gives (B, T) losses, reduced per record")
        if per_sample.dim() > 1:  # e.g. token-level losses (B, T): one loss per record
            per_sample = per_sample.reshape(B, -1)
            per_sample = per_sample.mean(1) if self.reduction == "mean" else per_sample.sum(1)
        return DPLoss(per_sample, self.state, self.reduction)


# Opacus's accountant names → the accountant that computes them here. PRV (Gopi et al. 2021) and
# PLD are both numerically tight accountants of the same mechanism; pdpfast computes PLD.
_ACCOUNTANTS = {"rdp": "rdp", "pld": "pld", "prv": "pld"}
# Opacus's grad_sample_mode → pdpfast's mode: every per-sample method gives the same clipped sum.
_GRAD_SAMPLE_MODES = {"hooks": "bk", "functorch": "bk", "ew": "bk", "ghost": "ghost"}
# Opacus's adaptive clipping (clipping="adaptive") and the arguments that configure it there
_ADAPTIVE_REFUSAL = ("clipping='adaptive' is not offered: adaptive clipping spends privacy on a quantile estimate "
                     "that this engine does not account; use 'flat' or 'per_layer'")
_OPACUS_ADAPTIVE_ARGS = ("target_unclipped_quantile", "clipbound_learning_rate", "max_clipbound", "min_clipbound",
                         "unclipped_num_std")
_USER_BATCH_WARNING = (
    "a private forward on a batch that the Poisson loader did not draw (your own loop, or "
    "poisson_sampling=False): its gradients are clipped exactly, but the privacy accounting assumes "
    "every record is drawn independently with its sample rate at every step (Poisson sampling), which "
    "your batches do not do; the reported ε is then an approximation, as in Opacus")

_TOKEN_MEAN_LOSS = (
    "{model}'s own loss (its labels= argument) is the mean over every labelled token of the batch{counts}: a "
    "record's gradient then depends on how many labelled tokens the other records have, so its clipped "
    "contribution no longer bounds what it changes in the sum the noise covers (exact only when every record "
    "has as many). Average per-record losses over the rows instead, each the mean over the record's own "
    "tokens: `pdpfast.integrations.transformers.default_per_sample_loss(model)(outputs, labels).mean()`, as "
    "DPTrainer and `pdpfast train` do")


_BATCH_LOSS = (
    "{model}'s {key} is a statistic of the whole batch (a mixture-of-experts router's load-balancing loss), and "
    "a backward went through it{through}: each record then changes every other record's gradient through it, "
    "which its clipped contribution does not bound. Leave it out: build the model with "
    "output_router_logits=False (its own loss then has none) and train on per-record losses, e.g. "
    "`pdpfast.integrations.transformers.default_per_sample_loss(model)(outputs, labels).mean()`")


def _batch_losses(output) -> list:
    """The (name, tensor) items of a model output that are losses over the whole batch and need a
    gradient: Hugging Face mixture-of-experts outputs' ``aux_loss`` (``encoder_aux_loss``, ``z_loss``...)."""
    items = output.items() if hasattr(output, "items") else ()
    return [(key, value) for key, value in items if isinstance(key, str) and key.endswith(("aux_loss", "z_loss"))
            and isinstance(value, torch.Tensor) and value.requires_grad]


_COUNTED_ON_HOST = ("cpu",)  # labels on these devices are counted per row at once (no device to stop)


def _token_mean_loss_guard(warned: list):
    """A forward hook for a Hugging Face model. A backward through a loss of the whole batch in its
    output (a mixture-of-experts ``aux_loss``: ``_batch_losses``) is refused, whoever adds it. When a
    forward returns the model's own loss over token labels (logits (B, T, V), labels (B, T)) and a
    backward goes through it: refused if the rows have
    different numbers of labelled tokens (labels on the CPU, counted there), nothing if they have as
    many (the mean of per-record means); labels on a GPU are not counted (that would stop the host every
    batch): a warning says once that the loss is exact only with equal counts. ``warned``: a one-item
    list, the engine's flag."""

    def hook(module, args, kwargs, output):
        for key, batch_loss in _batch_losses(output):
            through = " (the model's own loss adds it)" if getattr(output, "loss", None) is not None else ""
            message = _BATCH_LOSS.format(model=type(module).__name__, key=key, through=through)

            def refuse_batch_loss(grad, message=message):
                raise RuntimeError(message)
            batch_loss.register_hook(refuse_batch_loss)
        loss, logits, labels = getattr(output, "loss", None), getattr(output, "logits", None), kwargs.get("labels")
        if not (isinstance(loss, torch.Tensor) and loss.requires_grad and isinstance(logits, torch.Tensor)
                and logits.dim() >= 3 and isinstance(labels, torch.Tensor) and labels.dim() >= 2
                and not labels.is_floating_point()):
            return
        name = type(module).__name__
        if labels.device.type in _COUNTED_ON_HOST:
            counted = labels[:, 1:] if is_causal_lm(module) else labels
            per_row = (counted != -100).flatten(1).sum(1)
            low, high = (int(per_row.min()), int(per_row.max())) if per_row.numel() else (0, 0)
            if low == high:
                return
            message = _TOKEN_MEAN_LOSS.format(model=name, counts=f" (here {low} to {high} a record)")

            def refuse(grad):
                raise RuntimeError(message)
            loss.register_hook(refuse)
        elif not warned[0]:
            def warn(grad):
                if not warned[0]:
                    warned[0] = True
                    warnings.warn(_TOKEN_MEAN_LOSS.format(model=name, counts=""), UserWarning, stacklevel=2)
            loss.register_hook(warn)

    return hook


class _Hooks:
    """What ``make_private(wrap_model=False)`` returns in Opacus: the model stays the user's; ``cleanup()``
    returns its layers to plain torch behaviour."""

    def __init__(self, engine: PrivacyEngine):
        self._engine = engine

    def cleanup(self) -> None:
        self._engine.detach()


def _first_batch_dim(args, kwargs) -> int | None:
    """Size of dim 0 of the first tensor in a forward's arguments (searched through lists and dicts)."""
    stack = [*args, *kwargs.values()]
    while stack:
        item = stack.pop(0)
        if isinstance(item, torch.Tensor):
            return int(item.shape[0]) if item.dim() else None
        if isinstance(item, dict):
            stack = [*item.values(), *stack]
        elif isinstance(item, (list, tuple)):
            stack = [*item, *stack]
    return None


def _read_checkpoint(path) -> dict:
    """``save_checkpoint``'s file as a dict with "model", "engine" and "extra", or ValueError naming it."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    except FileNotFoundError:
        raise
    except Exception as exc:      # a truncated or foreign file: pickle's or zipfile's words, not the file's
        raise ValueError(f"checkpoint {str(path)!r} cannot be read (truncated, or not a file save_checkpoint "
                         f"wrote): {type(exc).__name__}: {exc}") from None
    if not isinstance(checkpoint, dict):
        raise ValueError(f"checkpoint {str(path)!r} is not a file save_checkpoint wrote (it holds a "
                         f"{type(checkpoint).__name__}, not a dict)")
    missing = [key for key in ("model", "engine", "extra") if key not in checkpoint]
    wrong = [key for key in ("model", "engine", "extra") if key in checkpoint and not isinstance(checkpoint[key], dict)]
    if missing or wrong:
        what = (f"it lacks {', '.join(missing)}" if missing else "") + ("; " if missing and wrong else "") + (
            f"{', '.join(wrong)} not a dict" if wrong else "")
        raise ValueError(f"checkpoint {str(path)!r} is not a file save_checkpoint wrote ({what})")
    rng = checkpoint.get("rng")       # (absent from checkpoints of before it was kept)
    if rng is not None and not (isinstance(rng, dict) and is_cpu_rng_state(rng.get("cpu"))):
        now = torch.get_rng_state()
        raise ValueError(f"checkpoint {str(path)!r}: its random states (rng) are damaged (expected a dict whose "
                         f"'cpu' is a {now.dtype} tensor of shape {tuple(now.shape)})")
    return checkpoint


def _rng_states() -> dict:
    """torch's random states: the CPU's, and each CUDA device's where CUDA is initialized."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return {"cpu": torch.get_rng_state(), "cuda": cuda}


def _set_rng_states(states: dict) -> None:
    """Restore ``_rng_states()`` (checked by ``_read_checkpoint``); a CUDA state is restored where as
    many devices are present."""
    torch.set_rng_state(states["cpu"])
    cuda = states.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


# make_private_with_budgets's arguments that the uniform entry points do not take
_WITH_BUDGETS_ONLY = ("adaptive_clipping", "noise_schedule")


def _refuse_unknown_arguments(function: str, unknown: dict) -> None:
    """Opacus's adaptive-clipping arguments refused as clipping="adaptive" is; any other unknown name
    as Python refuses it."""
    if not unknown:
        return
    adaptive = [name for name in _OPACUS_ADAPTIVE_ARGS if name in unknown]
    if adaptive:
        raise ValueError(f"{_ADAPTIVE_REFUSAL}, without Opacus's adaptive-clipping arguments ({', '.join(adaptive)})")
    names = ", ".join(repr(name) for name in unknown)
    elsewhere = [name for name in _WITH_BUDGETS_ONLY if name in unknown]
    hint = (f" ({', '.join(elsewhere)}: an argument of make_private_with_budgets, whose plan pays for it)"
            if elsewhere else "")
    raise TypeError(f"{function}() got unexpected keyword argument(s) {names}{hint}")


def _refuse_ddp_wrapped_after(model: nn.Module):
    """A forward pre-hook for a model made private unwrapped while a process group of several ranks is
    initialized: raises when the forward runs inside a DistributedDataParallel wrapper made afterwards."""
    def hook(module, args) -> None:
        wrapper = active_ddp_wrapper()
        if wrapper is not None and getattr(wrapper, "module", None) is model:
            raise RuntimeError(
                "the model was wrapped in DistributedDataParallel after make_private: the engine made it private "
                "as a single-process model, so each rank draws its own batches and adds its own noise, and DDP "
                "never sees the clipped gradients. Wrap the model in DistributedDataParallel first and pass the "
                "wrapper to make_private")
    return hook


def _world_size(module: nn.Module) -> int:
    """Processes sharing each draw: the process group's size for a DDP-wrapped model, else 1."""
    if inner_module(module) is module:
        return 1
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class PrivacyEngine:
    """Makes (model, optimizer, data loader) private with per-record sample rates and clip bounds.

    After ``make_private`` an ordinary loop
    ``loss = criterion(model(x), y); loss.backward(); optimizer.step(); optimizer.zero_grad()``
    performs individualized DP-SGD: weighted Poisson sampling with rates q_i, per-sample clipping
    to c_i, noise N(0, σ²C²) once per step and normalization by the expected batch size Σ_i q_i.

    The arguments and return values of Opacus 1.6's ``PrivacyEngine`` are accepted (``make_private``,
    ``make_private_with_epsilon``, ``get_epsilon``, ``accountant``, ``is_compatible``, ``validate``).

    Args:
        accountant: "rdp" (default), "pld", or "prv" (Opacus's default name; computed here by PLD, also
            numerically tight).
        secure_mode: only False (pdpfast's noise is not drawn from a CSPRNG).
        seed: of the Poisson draws and the noise (default: fresh random seeds).
    Raises:
        ValueError for "gdp" or another unknown accountant, or secure_mode=True.
    """

    def __init__(self, *, accountant: str = "rdp", secure_mode: bool = False, seed: int | None = None):
        from .accounting.history import create_accountant

        if accountant == "gdp":
            raise ValueError("accountant='gdp' (Opacus's Gaussian accountant) is not offered: its CLT "
                             "approximation is not an upper bound on ε. Use 'rdp', 'pld' or 'prv'")
        check_choice("accountant", accountant, tuple(_ACCOUNTANTS))
        if secure_mode:
            raise ValueError(SECURE_MODE_REFUSAL)
        self.seed = None if seed is None else check_int("seed", seed, 0)
        self.distributed = None  # a DistributedContext when the model is DDP-wrapped
        self.accountant = create_accountant(_ACCOUNTANTS[accountant])
        self.plan = None
        self.state: ClippingState | None = None
        self.optimizer: DPOptimizer | None = None
        self.data_loader: DPDataLoader | None = None
        self.uniform = False
        self._warned_user_batch = False
        self._warned_token_loss = [False]
        self._user_batches = 0
        self._implicit_open = False
        self._forward_done = True
        self._hooks: list = []
        self._mechanism_name = _ACCOUNTANTS[accountant]

    # ------------------------------------------------------------------ Opacus's checks

    def is_compatible(self, *, module: nn.Module, optimizer=None, data_loader=None) -> bool:
        """Whether ``module`` can be trained privately (see ``pdpfast.validators.ModuleValidator``).

        Args:
            module: the model; optimizer, data_loader: accepted as in Opacus, unused.
        Returns:
            bool.
        """
        from .validators import ModuleValidator

        return ModuleValidator.is_valid(module)

    def validate(self, *, module: nn.Module, optimizer=None, data_loader=None) -> None:
        """Raise ``UnsupportedModuleError`` listing every module ``make_private`` would refuse.

        Args:
            module: the model; optimizer, data_loader: accepted as in Opacus, unused.
        Returns:
            None.
        """
        from .validators import ModuleValidator

        ModuleValidator.validate(module, strict=True)

    @classmethod
    def get_compatible_module(cls, module: nn.Module) -> nn.Module:
        """A fixed copy of ``module`` (BatchNorm → GroupNorm, ...), validated.

        Args:
            module: the model.
        Returns:
            the fixed copy (an ``nn.Module``).
        """
        from .validators import ModuleValidator

        return ModuleValidator.fix_and_validate(module)

    # ------------------------------------------------------------------ making a run private

    def make_private(self, *, module: nn.Module, optimizer: torch.optim.Optimizer, data_loader: DataLoader,
                     noise_multiplier: float, max_grad_norm: float, criterion: nn.Module | None = None,
                     batch_first: bool = True, loss_reduction: str = "mean", poisson_sampling: bool = True,
                     clipping: str = "flat", noise_generator: torch.Generator | None = None,
                     grad_sample_mode: str = "hooks", wrap_model: bool = True, rand_on_empty: bool = False,
                     sample_rates=None, clip_norms=None, mode: str | None = None, layer_shares=None,
                     automatic_gamma: float | None = None, physical_batch_size: int | None = None,
                     steps_per_epoch: int | None = None, **unknown):
        """Make (module, optimizer, data_loader) private, with Opacus 1.6's arguments and pdpfast's.

        The module is converted in place. With per-record bounds or rates, a batch you build yourself
        must name its records: ``with engine.records(indices): ...`` (see ``records``).

        Args:
            module, optimizer, data_loader: the run to make private.
            noise_multiplier: σ (noise std in units of C).
            max_grad_norm: the reference bound C of the noise N(0, σ²C²) and every record's clip bound
                unless ``clip_norms`` is given.
            criterion: a torch loss module, for ghost mode only, where its ``reduction`` must be
                ``loss_reduction``; in mode "bk" your own loss is used as it is and a criterion given is not
                read (a warning says so; accepted, as Opacus's hooks mode accepts it).
            loss_reduction: "mean" if the loss is the batch mean of per-sample losses (torch's default),
                "sum" if it is their sum. It only says how to read the loss: the noisy clipped sum is divided
                by the expected batch size under either (Opacus divides only under "mean").
            poisson_sampling: True draws each batch by Poisson sampling at rate q = 1/len(data_loader);
                False returns ``data_loader`` unchanged, and each forward of the model on a batch of your own
                opens a private batch (every record must then have the same clip bound and sample rate, so
                per-record ``clip_norms`` are refused; a one-time warning says the accounting assumes Poisson
                sampling).
            clipping: "flat" or "per_layer".
            noise_generator: seeds the noise.
            grad_sample_mode: "hooks", "functorch", "ew" (all exact book-keeping here) or "ghost".
            wrap_model: False returns, instead of the module, an object whose ``cleanup()`` detaches the
                engine, as in Opacus.
            batch_first, rand_on_empty: Opacus's, checked.
            sample_rates: q_i, a float or (N,) in [0, 1] (default 1/len(data_loader), Opacus's).
            clip_norms: c_i, (N,) > 0 (default: max_grad_norm for every record).
            mode: "bk" or "ghost" (instead of grad_sample_mode).
            layer_shares, automatic_gamma: see ``ClippingState``.
            physical_batch_size: split large draws into batches of this many rows (padded, masked).
            steps_per_epoch: draws per pass over the loader.
            **unknown: refused: Opacus's adaptive-clipping arguments (target_unclipped_quantile,
                clipbound_learning_rate, max_clipbound, min_clipbound, unclipped_num_std) with a ValueError, as
                clipping="adaptive"; any other name with a TypeError naming it.
        Returns:
            ``MadePrivate(module, optimizer, data_loader)``, or ``MadePrivateGhost(module, optimizer,
            criterion, data_loader)`` for ``mode="ghost"`` / ``grad_sample_mode="ghost"``: tuples that
            unpack as Opacus's, with the parts also named.
        Raises:
            ValueError under ``torch.distributed`` (a DDP-wrapped model) when the ranks were given
            different seeds, noise generators (``noise_generator`` states), plans or data. A model not
            wrapped in DDP while a process group of several ranks is initialized trains one independent
            run per rank: a warning says so, and a forward through a DDP wrapper made after
            ``make_private`` raises RuntimeError.
        """
        _refuse_unknown_arguments("make_private", unknown)
        mode = self._check_make_private_args(
            module=module, optimizer=optimizer, data_loader=data_loader, noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm, criterion=criterion, batch_first=batch_first, loss_reduction=loss_reduction,
            poisson_sampling=poisson_sampling, clipping=clipping, noise_generator=noise_generator,
            grad_sample_mode=grad_sample_mode, wrap_model=wrap_model, rand_on_empty=rand_on_empty,
            sample_rates=sample_rates, mode=mode, physical_batch_size=physical_batch_size,
            steps_per_epoch=steps_per_epoch, layer_shares=layer_shares, automatic_gamma=automatic_gamma)
        n = len(data_loader.dataset)
        if sample_rates is None:
            sample_rates = 1.0 / len(data_loader)
        sample_rates = as_per_record("sample_rates", sample_rates, n, low=0.0, high=1.0)
        clip_norms = max_grad_norm if clip_norms is None else clip_norms
        clip_norms = as_per_record("clip_norms", clip_norms, n, low=0.0, low_inclusive=False)
        # a uniform run (one q, one c for every record) is plain DP-SGD: any batch of distinct records
        # is clipped right without knowing which records they are, and one history accounts it
        uniform = bool((sample_rates == sample_rates[0]).all() and (clip_norms == clip_norms[0]).all())
        if not poisson_sampling and not uniform:
            raise ValueError("clip_norms must be one bound for every record with poisson_sampling=False: your "
                             "loader's batches do not say which records they hold, so each row is clipped to the "
                             "common bound (per-record bounds need the Poisson loader, poisson_sampling=True)")
        self.sample_rates, self.clip_norms, self.uniform = sample_rates, clip_norms, uniform
        self.noise_multiplier, self.max_grad_norm = float(noise_multiplier), float(max_grad_norm)
        self.mode, self.loss_reduction = mode, loss_reduction
        self.poisson_sampling = bool(poisson_sampling)
        inner, self.distributed = unwrap(module)  # a DDP-wrapped model: see pdpfast.distributed
        seed, shard = self.seed, {}
        alone_in_group = self.distributed is None and process_group_size() > 1
        if alone_in_group:
            warnings.warn(
                f"torch.distributed is initialized with {process_group_size()} ranks, but the model is not wrapped "
                "in DistributedDataParallel: each rank trains it on its own, as an independent single-process run "
                "(nothing is shared out or summed across the ranks; each rank's ε is that of its own run). To train "
                "one model across the ranks, wrap it in DistributedDataParallel before make_private, not after",
                stacklevel=2)
        if self.distributed is not None:
            if not poisson_sampling:
                raise ValueError("poisson_sampling=False is not supported with DistributedDataParallel: the ranks "
                                 "must share one Poisson draw (pdpfast.distributed)")
            seed = self.seed = self.distributed.agree_seed(self.seed)
            self.distributed.check_same("privacy plan (sample rates, clip bounds, noise)", plan_fingerprint(
                self.sample_rates, self.clip_norms, self.noise_multiplier, self.max_grad_norm))
            # one draw over the whole dataset: a rank given its own shard would train other records than drawn
            self.distributed.check_same(
                "dataset", data_fingerprint(data_loader.dataset),
                "compared by its size and a few of its records: the ranks share one Poisson draw over the whole "
                "dataset and each takes its share of it, so give every rank all of the data, not a shard")
            # every rank adds the same noise to the same summed gradients: a generator seeded per rank
            # (seed + rank, or unseeded) would add different noise on each, and the models drift apart
            self.distributed.check_same(
                "noise_generator", generator_fingerprint(noise_generator),
                "compared by its state: every rank adds the same noise to the summed clipped gradients. Seed it "
                "with the same seed on every rank (not seed + rank), or leave it None so that the engine's seed, "
                "agreed between the ranks, seeds the noise")
            shard = dict(rank=self.distributed.rank, world_size=self.distributed.world_size)
        noise_seed = None if seed is None else seed + 1
        if noise_generator is not None:
            noise_seed = noise_seed_from(noise_generator)
        # what ClippingState refuses only once it sees the converted layers (layer_shares that name no
        # clipping group, or do not number one per group) must leave the model as it was: the swap
        # changes classes only, so restoring them undoes it
        classes = [(m, type(m)) for m in inner.modules()]
        state = None
        try:
            convert(inner)
            state = ClippingState(inner, mode=mode, clipping=clipping, layer_shares=layer_shares,
                                  automatic_gamma=automatic_gamma)
            state.attach()
            expected_batch_size = float(self.sample_rates.sum())
            dp_loader = None
            if poisson_sampling:
                dp_loader = DPDataLoader.from_data_loader(
                    data_loader, self.sample_rates, physical_batch_size=physical_batch_size, seed=seed,
                    steps_per_epoch=steps_per_epoch, **shard)
            dp_optimizer = DPOptimizer(optimizer, noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm,
                                       expected_batch_size=expected_batch_size, seed=noise_seed)
        except BaseException:
            if state is not None:
                state.detach()
            for m, cls in classes:
                if type(m) is not cls:
                    m.__class__ = cls
            raise
        self.state, self.data_loader, self.optimizer = state, dp_loader, dp_optimizer
        if dp_loader is not None:
            self.data_loader.on_batch = self._on_batch
        if self.distributed is not None:
            self.optimizer.reduce_grads = self.distributed.all_reduce_sum_
            # a non-finite record in one rank's share refuses the draw on every rank (one flag, all-reduced)
            self.state.nonfinite_anywhere = lambda flag: self.distributed.any_rank(
                flag, f"checking the records of step {self.state.draw} for non-finite gradients")
            # (a GPU's norms: the deferred check's flag, summed on the device and read at the next step)
            self.state.nonfinite_reduce = lambda flag: self.distributed.sum_over_ranks_(
                flag, f"checking the records of step {self.state.draw} for non-finite gradients")
        if alone_in_group:
            self._hooks.append(inner.register_forward_pre_hook(_refuse_ddp_wrapped_after(inner)))
        self._clip_norms_tensor = torch.from_numpy(self.clip_norms)
        self._at_boundary = True
        self.optimizer.at_step_boundary = lambda: self._at_boundary
        self.optimizer.may_zero_grad = self._may_zero_grad
        self.optimizer.pre_step_hooks.append(lambda opt: self.state.check_trainable(opt.trainable_params()))
        self.optimizer.pre_step_hooks.append(lambda _: self.state.check_finite())
        self.state.defer_checks = True  # a GPU's norms reach the host without a stall, read at the step
        self.optimizer.pre_step_hooks.append(lambda _: self.state.check_clipped_sums_unchanged())
        self._unstepped: int | None = None  # the draw the loader gave last, until a step releases it
        self.optimizer.post_step_hooks.append(self._draw_stepped)
        self.optimizer.refused_step_hooks.append(self._step_refused)
        self.optimizer.post_step_hooks.append(lambda _: self.state.end_draw(released=True))
        self.optimizer.post_step_hooks.append(lambda _: self._charge())
        self.optimizer.post_zero_grad_hooks.append(self._after_zero_grad)
        if getattr(module, "config", None) is not None:  # a Hugging Face model: its loss over token labels
            self._hooks.append(module.register_forward_hook(
                _token_mean_loss_guard(self._warned_token_loss), with_kwargs=True))
        if self.uniform and self.plan is None:
            # a budgets run spends each record's budget through its sampling rate: its batches come
            # from the Poisson loader (or name their records)
            self._hooks += [module.register_forward_pre_hook(self._open_user_batch, with_kwargs=True),
                            module.register_forward_hook(self._forward_finished, with_kwargs=True)]
        if not self.uniform:
            self.accountant = None  # per-record ε: get_epsilon() takes the largest (see there)
        loader = self.data_loader if poisson_sampling else data_loader
        returned = module if wrap_model else _Hooks(self)
        if mode == "ghost":
            criterion = DPCriterion(criterion, self.state, loss_reduction)
            return MadePrivateGhost(returned, self.optimizer, criterion, loader)
        return MadePrivate(returned, self.optimizer, loader)

    def _check_make_private_args(self, *, module, optimizer, data_loader, noise_multiplier, max_grad_norm, criterion,
                                 batch_first, loss_reduction, poisson_sampling, clipping, noise_generator,
                                 grad_sample_mode, wrap_model, rand_on_empty, sample_rates, mode,
                                 physical_batch_size, steps_per_epoch, layer_shares, automatic_gamma) -> str:
        """Every argument checked before anything changes; returns the clipping mode ("bk" | "ghost")."""
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(module, nn.DataParallel) and len(module.device_ids) > 1:
            raise ValueError(DATA_PARALLEL_REFUSAL)
        if not isinstance(data_loader, DataLoader):
            raise TypeError(f"data_loader must be a torch DataLoader, got {type(data_loader).__name__}")
        if map_style_length(data_loader.dataset) == 0:
            raise ValueError("data_loader's dataset is empty: there are no records to train on")
        if poisson_sampling is True:    # before len(data_loader), which a custom sampler may not have
            check_whole_dataset_sampler(data_loader, _world_size(module))
        if sample_rates is None and len(data_loader) == 0:
            raise ValueError("data_loader yields no batches (drop_last with batch_size > N?), so the default "
                             "sample rate 1/len(data_loader) is undefined; give sample_rates= or another loader")
        if isinstance(max_grad_norm, (list, tuple)):
            raise TypeError("max_grad_norm must be one number; per-parameter bounds (Opacus's per_layer clipping) "
                            "are given here as clipping='per_layer' with layer_shares= (shares C_k, Σ C_k² = 1)")
        check_nonnegative("noise_multiplier", noise_multiplier)
        check_positive("max_grad_norm", max_grad_norm)
        check_choice("loss_reduction", loss_reduction, ("mean", "sum"))
        check_choice("grad_sample_mode", grad_sample_mode, tuple(_GRAD_SAMPLE_MODES))
        if clipping == "adaptive":
            raise ValueError(_ADAPTIVE_REFUSAL)
        for name, value in (("batch_first", batch_first), ("poisson_sampling", poisson_sampling),
                            ("wrap_model", wrap_model), ("rand_on_empty", rand_on_empty)):
            check_flag(name, value)
        if not batch_first:
            raise ValueError("batch_first=False is not supported: DP layers need batch-first inputs (per-sample = "
                             "per row of dim 0)")
        if rand_on_empty:
            raise ValueError("rand_on_empty=True is not needed: an empty Poisson draw yields a batch with zero "
                             "rows, which the model, the clipping and the noise handle")
        if noise_generator is not None and not isinstance(noise_generator, torch.Generator):
            raise TypeError(f"noise_generator must be a torch.Generator, got {type(noise_generator).__name__}")
        if mode is None:
            mode = _GRAD_SAMPLE_MODES[grad_sample_mode]
        elif grad_sample_mode != "hooks" and _GRAD_SAMPLE_MODES[grad_sample_mode] != mode:
            raise ValueError(f"mode={mode!r} and grad_sample_mode={grad_sample_mode!r} disagree; give one of them")
        check_clipping_options(mode, clipping, layer_shares, automatic_gamma)  # before convert() changes the model
        for name, value in (("physical_batch_size", physical_batch_size), ("steps_per_epoch", steps_per_epoch)):
            if value is not None:
                check_int(name, value, 1)
        if mode == "ghost" and criterion is None:
            raise ValueError("mode='ghost' needs criterion= (a torch loss module): its two backward passes "
                             "need per-sample losses")
        if mode != "ghost" and criterion is not None:
            # not refused: Opacus's hooks mode takes and ignores it too, and code written for it must run
            warnings.warn(f"criterion is used in mode='ghost' only (its two backward passes wrap the loss); in mode "
                          f"{mode!r} your own loss is used as it is and this criterion is not read", stacklevel=3)
        if mode == "ghost":
            if not hasattr(criterion, "reduction"):
                raise TypeError("criterion must be a torch loss module with a `reduction` attribute "
                                f"(e.g. nn.CrossEntropyLoss()), got {type(criterion).__name__}")
            if criterion.reduction != loss_reduction:
                raise ValueError(f"criterion's reduction={criterion.reduction!r} and loss_reduction="
                                 f"{loss_reduction!r} disagree: ghost mode reduces the per-sample losses as "
                                 "loss_reduction says; give a criterion with the same reduction")
        if not poisson_sampling:
            for name, value in (("sample_rates", sample_rates), ("physical_batch_size", physical_batch_size),
                                ("steps_per_epoch", steps_per_epoch)):
                if value is not None:
                    raise ValueError(f"{name} configures the Poisson loader; with poisson_sampling=False batches "
                                     "come from your data_loader and the accounting uses q = 1/len(data_loader)")
        if unsupported_modules(module):
            convert(module)  # raises the message that names every such module, and changes nothing
        refuse_sequence_first(module)  # before convert changes the model (ClippingState checks it too)
        params = {id(p) for p in module.parameters()}
        if any(id(p) not in params for group in optimizer.param_groups for p in group["params"]):
            raise ValueError("optimizer holds parameters that are not the module's: build it from "
                             "module.parameters()")
        if self.state is not None:
            raise RuntimeError("this PrivacyEngine already made a model private; use one engine per model")
        return mode

    def make_private_with_epsilon(self, *, module: nn.Module, optimizer: torch.optim.Optimizer,
                                  data_loader: DataLoader, target_epsilon: float, target_delta: float, epochs: int,
                                  max_grad_norm: float, epsilon_tolerance: float | None = None, **kwargs):
        """``make_private`` with the smallest noise multiplier σ whose ε after ``epochs`` passes
        (epochs · len(data_loader) steps at q = 1/len(data_loader)) is ≤ ``target_epsilon`` at
        ``target_delta``, by this engine's accountant. Returns what ``make_private`` returns.

        σ is the root of ε(σ) = target (found to 1e-9 relative), so ε ≤ target and never above;
        ``epsilon_tolerance`` (Opacus's bisection tolerance) is accepted and not needed. Other
        keyword arguments go to ``make_private`` (``sample_rates``/``clip_norms`` are not
        accepted: use ``make_private_with_budgets`` for per-record budgets).

        Args:
            module, optimizer, data_loader (a torch DataLoader), max_grad_norm: as for ``make_private``.
            target_epsilon: ε, one number; target_delta: δ; epochs: a positive int.
            epsilon_tolerance: accepted, unused.
        Returns:
            what ``make_private`` returns.
        Raises:
            TypeError for an argument it sets itself (noise_multiplier, sample_rates, clip_norms,
            steps_per_epoch), a loader that is not a DataLoader or a non-scalar ε; ValueError for bad epochs.
        """
        from ._checks import check_epsilons
        from .accounting.rdp import get_noise_multiplier

        # before σ is calibrated: Opacus's adaptive-clipping arguments are refused as make_private refuses them
        _refuse_unknown_arguments("make_private_with_epsilon", {k: v for k, v in kwargs.items()
                                                                if k in _OPACUS_ADAPTIVE_ARGS})
        for key in ("noise_multiplier", "sample_rates", "clip_norms", "steps_per_epoch"):
            if key in kwargs:
                raise TypeError(f"make_private_with_epsilon sets {key} itself; do not pass it "
                                "(per-record budgets: make_private_with_budgets)")
        if not isinstance(data_loader, DataLoader):
            raise TypeError(f"data_loader must be a torch DataLoader, got {type(data_loader).__name__}")
        check_int("epochs", epochs, 1)
        if np.ndim(target_epsilon) != 0:
            raise TypeError("target_epsilon must be one number (per-record budgets: make_private_with_budgets)")
        check_epsilons("target_epsilon", target_epsilon)
        if self.accountant is not None and self.accountant.history:
            warnings.warn("make_private_with_epsilon on an engine that has already spent privacy: the noise "
                          "multiplier is chosen from zero spending, so the total ε will exceed target_epsilon",
                          stacklevel=2)
        sample_rate = 1.0 / len(data_loader)
        mechanism = self.accountant.mechanism() if self.accountant is not None else "rdp"
        sigma = get_noise_multiplier(target_epsilon, target_delta, sample_rate, int(epochs) * len(data_loader),
                                     accountant=mechanism)
        return self.make_private(module=module, optimizer=optimizer, data_loader=data_loader,
                                 noise_multiplier=float(sigma), max_grad_norm=max_grad_norm, **kwargs)

    def make_step(self, loss_fn, *, cuda_graph: bool | None = None, warmup: int = 2):
        """One call per physical batch of the loader: forward, backward and clipping, and the noisy
        optimizer step at each draw's last batch, captured in CUDA graphs and replayed
        (``pdpfast.graphs.PrivateStep``)::

            step = engine.make_step(lambda x, y: criterion(model(x), y))
            for x, y in train_loader:        # the loader make_private returned
                loss = step(x, y)            # replaces forward, backward, step() and zero_grad()

        Args:
            loss_fn: ``loss_fn(*batch)`` → the scalar loss of a physical batch, reduced as
                ``loss_reduction`` says (a mean over its rows by default).
            cuda_graph: capture and replay (default: when the model is on a CUDA device). Needs
                ``physical_batch_size`` in ``make_private`` (batches of a fixed size), the Triton
                noise kernel, and an optimizer whose step can be captured (``capturable=True``
                for Adam/AdamW). False runs the same step eagerly.
            warmup: eager steps before the capture (real steps, accounted as any other).

        Returns:
            a ``PrivateStep``; its call returns the batch's loss.
        """
        from .graphs import PrivateStep

        if self.state is None:
            raise RuntimeError("make_step needs make_private (or make_private_with_budgets) first")
        if self.data_loader is None:
            raise ValueError("make_step needs the Poisson data loader (poisson_sampling=True): each batch it yields "
                             "opens the physical batch the step runs")
        device = self.optimizer.trainable_params()[0].device
        if cuda_graph or (cuda_graph is None and device.type == "cuda"):
            if self.data_loader.physical_batch_size is None:
                raise ValueError("cuda_graph=True needs make_private(..., physical_batch_size=K): a captured graph "
                                 "replays fixed shapes, and Poisson batches of a random size would each need a capture "
                                 "of their own. Physical batches of K rows (masked padding) keep one graph")
            if getattr(self, "adaptive", None) is not None:
                raise ValueError("cuda_graph=True is not supported with adaptive clipping or a noise schedule (their "
                                 "bounds and noise move every step); use cuda_graph=False")
        return PrivateStep(self.state, self.optimizer, loss_fn, cuda_graph=cuda_graph, warmup=warmup)

    # ------------------------------------------------------------------ accounting

    def _charge(self) -> None:
        """Account the step just taken: the uniform history, or the per-record ledger of a plan."""
        if self.plan is not None:
            self.accountant.step()
        elif self.uniform and self.accountant is not None:
            z = self.noise_multiplier * self.max_grad_norm / float(self.clip_norms[0])
            self.accountant.step(noise_multiplier=z, sample_rate=float(self.sample_rates[0]))

    def get_epsilon(self, delta: float) -> float:
        """ε spent so far at ``delta`` (a float), as Opacus's ``PrivacyEngine.get_epsilon``.

        A uniform run: the accountant's ε of its history. A run with per-record rates or bounds: the
        largest ε of any record (the guarantee every record has), by the plan's ledger after
        ``make_private_with_budgets``, else by this engine's accountant over the distinct (q_i, z_i).

        Args:
            delta: δ in (0, 1).
        Returns:
            ε, a float (0.0 before any step).
        """
        from ._checks import check_delta
        from .accounting.ledger import IndividualAccountant, PLDIndividualAccountant

        delta = check_delta("delta", delta)
        if self.state is None:
            return self.accountant.get_epsilon(delta) if self.accountant is not None else 0.0
        if self.plan is not None:
            return float(self.accountant.epsilons(delta).max())
        if self.uniform:
            return float(self.accountant.get_epsilon(delta))
        if self.steps == 0:
            return 0.0
        noise = self.noise_multiplier * self.max_grad_norm / self.clip_norms
        # one ledger, stepped on from call to call: its one-step RDP per distinct (q_i, z_i) is the cost
        # (~0.15 ms a pair: seconds for 10^4 distinct rates), not worth paying at every epoch's log line
        kept = self.__dict__.get("_epsilon_ledger")
        if (kept is None or kept[0] != self._mechanism or kept[3].steps_taken > self.steps
                or not (np.array_equal(kept[1], self.sample_rates) and np.array_equal(kept[2], noise))):
            ledger = {"rdp": IndividualAccountant, "pld": PLDIndividualAccountant}[self._mechanism]
            kept = self._epsilon_ledger = (self._mechanism, self.sample_rates.copy(), noise,
                                           ledger(self.sample_rates, noise))
        if self.steps > kept[3].steps_taken:
            kept[3].step(self.steps - kept[3].steps_taken)
        return float(kept[3].epsilons(delta).max())

    # ------------------------------------------------------------------ batches the loader did not draw

    @contextmanager
    def records(self, indices):
        """Name the records of a batch you built yourself: ``with engine.records(idx): loss =
        criterion(model(x), y); loss.backward()``, then ``optimizer.step()``.

        indices: (B,) distinct record indices in [0, N) of the rows of the batch, in row order; row j
        is clipped to c_{indices[j]}. The batch then has the usual lifecycle (one backward; the step
        closes it). Needed when records have different clip bounds or rates; with one bound for all,
        a plain forward opens the batch itself. The accounting still assumes Poisson sampling at
        the records' rates (a one-time warning says so).

        Args:
            indices: (B,) distinct record indices in [0, N) of the rows of the batch, in row order; row j
                is clipped to c_{indices[j]}.
        Returns:
            a context manager.
        Raises:
            RuntimeError before make_private or while the previous batch waits for a step; TypeError for
            indices that are not a 1-D sequence of ints; ValueError for indices out of range or repeated.
        """
        if self.state is None:
            raise RuntimeError("records() needs make_private first")
        idx = torch.as_tensor(indices)
        if idx.dim() != 1 or idx.dtype in (torch.bool,) or idx.is_floating_point() or idx.is_complex():
            raise TypeError(f"indices must be a 1-D sequence of ints, got {tuple(idx.shape)} of {idx.dtype}")
        idx = idx.long().cpu()
        n = self.clip_norms.shape[0]
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n):
            raise ValueError(f"indices must lie in [0, {n}) (records of the dataset), got "
                             f"[{int(idx.min())}, {int(idx.max())}]")
        if torch.unique(idx).numel() != idx.numel():
            raise ValueError("indices name a record twice: a record in two rows of one batch would contribute "
                             "twice its clip bound")
        if self.state.pending:
            raise RuntimeError("the previous batch's clipped gradients wait for optimizer.step() (or zero_grad() "
                               "to discard them); call it before opening the next batch")
        self._warn_user_batch(stacklevel=4)
        self._open(self.batch_clip_norms(idx), implicit=False, records=idx)
        try:
            yield idx
        except BaseException:
            if self.state.phase is Phase.OPEN:  # nothing was released: close the batch
                self.state.end_draw()
            raise

    def _open(self, clip_norms: torch.Tensor, *, implicit: bool, records: torch.Tensor | None = None) -> None:
        if self._unstepped is not None and self.state.phase is Phase.IDLE:  # (IDLE: nothing pending)
            # a hand-built batch's step would free the loader from a discarded draw (one refused for a
            # non-finite record, say) that its noise-only step has not closed
            raise RuntimeError(f"Poisson draw {self._unstepped} was discarded (zero_grad) and is not closed: call "
                               "optimizer.step() (noise only) before another batch, as every draw ends in a step")
        rows = clip_norms.shape[-1]                  # (B,), or (K, B) per layer under adaptive clipping
        self._user_batches += 1
        scale = rows if self.loss_reduction == "mean" and self.mode != "ghost" else 1.0
        # records(): errors name the records by their index in the dataset, as the loader's batches do
        self.state.begin_batch(clip_norms, None, loss_scale=scale, draw=("user", self._user_batches),
                               records=records)
        self._at_boundary = True
        self._implicit_open = implicit

    def _open_user_batch(self, module, args, kwargs) -> None:
        """Forward pre-hook of a uniform run's model: a private forward with no open batch opens one
        of the input's rows, each clipped to the common bound c (Opacus's behaviour)."""
        state = self.state
        if not (module.training and torch.is_grad_enabled()):
            return
        if state.phase is Phase.OPEN and self._implicit_open and self._forward_done:
            raise RuntimeError(
                "a second forward of the model into a batch that its first forward opened: its rows would be "
                "clipped together with the first forward's rows as if they were the same records. Call "
                "backward and optimizer.step() first; to run several forwards over the same records, name "
                "them: `with privacy_engine.records(indices): ...`")
        if state.phase is Phase.OPEN and self._implicit_open:
            # the batch's first forward raised before it finished: nothing was recorded that a
            # backward could release, so the batch starts again
            state.end_draw()
        elif state.phase is not Phase.IDLE:
            return  # a batch of the loader or of records(), or a clipped one (forward refuses that)
        rows = _first_batch_dim(args, kwargs)
        if rows is None:
            raise RuntimeError("a private forward with no tensor argument: the batch size is unknown. Name the "
                               "batch's records with `with privacy_engine.records(indices): ...`")
        self._warn_user_batch(stacklevel=6)  # through torch's Module.__call__ to the user's forward call
        # every record has one bound here (a uniform run), record 0's; through batch_clip_norms, which
        # adaptive clipping replaces to move the bounds between steps
        self._open(self.batch_clip_norms(torch.zeros(rows, dtype=torch.long)), implicit=True)
        self._forward_done = False

    def _forward_finished(self, module, args, kwargs, output) -> None:
        self._forward_done = True

    def _warn_user_batch(self, stacklevel: int) -> None:
        if not self._warned_user_batch:
            self._warned_user_batch = True
            warnings.warn(_USER_BATCH_WARNING, UserWarning, stacklevel=stacklevel)

    @property
    def _mechanism(self) -> str:
        return self.plan.accountant if self.plan is not None else self._mechanism_name

    def _on_batch(self, batch: PhysicalBatch) -> None:
        # a draw opens its batches here; optimizer.step() (or zero_grad() discarding it) closes it
        if self._unstepped is not None and batch.step != self._unstepped and not self.state.pending:
            # (a draw whose clipped sums wait for the step is refused by begin_batch, in its own words)
            raise RuntimeError(
                f"Poisson draw {self._unstepped} was not stepped before draw {batch.step} began: every draw ends in "
                "optimizer.step(), an empty one too (it adds noise only). Skipping a draw (`continue` on an empty "
                "or unwanted batch) makes which steps are released depend on who was drawn, which no accountant "
                "covers; to drop a draw's gradient, call optimizer.zero_grad() and then optimizer.step()")
        rows = batch.indices.numel()
        scale = rows if self.loss_reduction == "mean" and self.mode != "ghost" else 1.0
        self.state.begin_batch(self.batch_clip_norms(batch.indices), batch.mask, loss_scale=scale, draw=batch.step,
                              records=batch.indices)
        self._unstepped = batch.step
        self._at_boundary = batch.is_last
        self._implicit_open = False

    def _draw_stepped(self, _=None) -> None:
        # the draw was released by a step
        self._unstepped = None

    def _step_refused(self, _=None) -> None:
        # a step refused by a decision that reads no record (the ledger, a parameter nothing clips) frees
        # the loader from the draw; one refused for a record whose gradient is not finite (which reads the
        # records) does not: zero_grad() then step() (noise only) closes the draw, so that which steps are
        # released does not depend on whether such a record was drawn
        refused_for_records, self.state.refused_nonfinite = self.state.refused_nonfinite, False
        if not refused_for_records:
            self._unstepped = None

    def batch_clip_norms(self, indices: torch.Tensor) -> torch.Tensor:
        """The clip bounds of a batch's rows, (B,): every batch opens through it (the loader's, one of
        ``records()``, a uniform run's plain forward). An extension point: adaptive clipping replaces it
        on the instance to move the bounds between steps ((K, B) per layer) and to learn the rows' groups.

        Args:
            indices: (B,) int64 record indices of the rows.
        Returns:
            (B,) clip bounds c_i (or (K, B) when replaced for per-layer adaptive clipping).
        """
        return self._clip_norms_tensor[indices]

    def _may_zero_grad(self) -> bool:
        """zero_grad() must not drop the clipped sums of a draw's earlier physical batches: it acts
        when no draw is in progress, or once the draw's last batch has been through backward."""
        return not self.state.pending or (self._at_boundary and self.state.phase is Phase.CLIPPED)

    def _after_zero_grad(self, _) -> None:
        # the draw's gradients were discarded, not released: close it (as well as a batch that a
        # forward opened and no backward used, so the next forward opens a fresh one)
        if self.state.pending or (self._implicit_open and self.state.phase is Phase.OPEN):
            self.state.end_draw()

    def make_private_with_budgets(self, *, module: nn.Module, optimizer: torch.optim.Optimizer,
                                  data_loader: DataLoader, budgets, delta: float, epochs: int | None = None,
                                  steps: int | None = None, method: str = "sample", sample_rate: float | None = None,
                                  max_grad_norm: float = 1.0, hybrid_weight: float | None = None,
                                  accountant: str = "rdp", noise_schedule=None, adaptive_clipping=None, **kwargs):
        """Calibrate per-record (q_i, c_i, σ) from budgets ε_i and make the training private with them.

        budgets: (N,) ε_i > 0, one per record of ``data_loader.dataset``; delta: δ in (0, 1); the
        run is ``epochs`` passes (in expectation) or ``steps`` optimizer steps; sample_rate: mean
        Poisson rate (default 1/len(data_loader), as ``make_private``'s); method: "sample" | "scale" |
        "hybrid" (see ``pdpfast.calibrate``). Other keyword arguments go to ``make_private``.

        The engine keeps a per-record ledger of the plan's own accountant (``accountant``: "rdp" or
        "pld"; ``engine.accountant.name`` says which): ``optimizer.step()`` raises
        PrivacyBudgetExceeded rather than take a step that would take any record past its budget,
        and ``engine.epsilons()`` is every record's ε spent so far, by that accountant.

        noise_schedule: σ_t = σ₀·h(t) (a ``pdpfast.accounting.schedules.NoiseSchedule``, a callable
        h(t) or a spec string such as "exponential:0.01"; RDP only): calibration finds σ₀ and the
        ledger charges every step's σ_t. adaptive_clipping: a ``pdpfast.adaptive.QuantileClipping``:
        the groups' clip bounds follow a quantile of their gradient norms, the noised counts paid
        from the plan's own multipliers. ``engine.adaptive`` then holds the per-step history.

        Args:
            module, optimizer, data_loader: the run to make private.
            budgets: (N,) ε_i > 0, one per record of ``data_loader.dataset``.
            delta: δ in (0, 1).
            epochs, steps: the run's length: passes (in expectation) or optimizer steps.
            method: "sample" | "scale" | "hybrid" (see ``pdpfast.calibrate``).
            hybrid_weight: λ of "hybrid" in [0, 1] (None: 0.5); refused with the other methods.
            sample_rate: mean Poisson rate (default 1/len(data_loader), one over the loader's batches per
                pass, as ``make_private``'s: batch_size / N only when batch_size divides N).
            max_grad_norm: C, the reference clip bound.
            accountant: "rdp" or "pld", the plan's accountant and ledger.
            noise_schedule, adaptive_clipping: see above.
            **kwargs: go to ``make_private``.
        Returns:
            what ``make_private`` returns.
        Raises:
            TypeError for an argument the plan sets (noise_multiplier, sample_rates, clip_norms,
            steps_per_epoch); ValueError for poisson_sampling other than True.
        """
        from .accounting import calibrate, ledger_for_plan

        for key in ("noise_multiplier", "sample_rates", "clip_norms", "steps_per_epoch"):
            if key in kwargs:
                raise TypeError(f"make_private_with_budgets sets {key} from the plan; do not pass it")
        if kwargs.get("poisson_sampling", True) is not True:
            raise ValueError("make_private_with_budgets needs poisson_sampling=True: each record's budget is spent "
                             "through its own sampling rate, which only the Poisson loader applies")
        if not isinstance(data_loader, DataLoader):
            raise TypeError(f"data_loader must be a torch DataLoader, got {type(data_loader).__name__}")
        if self.state is not None:  # before the plan of the run already made private is replaced
            raise RuntimeError("this PrivacyEngine already made a model private; use one engine per model")
        n = map_style_length(data_loader.dataset)
        if n == 0:
            raise ValueError("data_loader's dataset is empty: there are no records to train on")
        warn_large_delta(check_delta("delta", delta), n)
        if sample_rate is None and len(data_loader) == 0:
            raise ValueError("data_loader yields no batches (drop_last with batch_size > N?), so the default "
                             "sample rate 1/len(data_loader) is undefined; give sample_rate=")
        budgets = as_budget_vector("budgets", budgets)
        if budgets.shape[0] != n:
            raise ValueError(f"budgets must have one ε per record of the dataset ({n}), got shape {budgets.shape}")
        delta = check_delta("delta", delta)
        sample_rate = 1.0 / len(data_loader) if sample_rate is None else check_rate("sample_rate", sample_rate)
        steps_per_epoch = max(1, round(1.0 / sample_rate))
        if (epochs is None) == (steps is None):
            raise ValueError("give exactly one of epochs= and steps=")
        if epochs is not None:
            steps = check_int("epochs", epochs, 1) * steps_per_epoch
        if adaptive_clipping is not None:  # refused before the model is made private, not after
            from .adaptive import QuantileClipping

            if not isinstance(adaptive_clipping, QuantileClipping):
                raise TypeError(f"adaptive_clipping must be a QuantileClipping, got {type(adaptive_clipping).__name__}")
            if inner_module(module) is not module:  # DDP-wrapped
                raise ValueError("adaptive_clipping is not supported with DistributedDataParallel (the counts of "
                                 "unclipped records would need an all-reduce)")
        if noise_schedule is None:
            plan = calibrate(budgets, delta=delta, steps=steps, sample_rate=sample_rate, method=method,
                             max_grad_norm=max_grad_norm, hybrid_weight=hybrid_weight, accountant=accountant)
        else:
            from .accounting.schedules import calibrate_scheduled

            if accountant != "rdp":
                raise ValueError(f"noise_schedule needs accountant='rdp' (the ledger composes each step's σ_t in RDP), "
                                 f"got accountant={accountant!r}")
            plan = calibrate_scheduled(budgets, delta=delta, steps=steps, sample_rate=sample_rate,
                                       noise_schedule=noise_schedule, method=method,
                                       max_grad_norm=max_grad_norm, hybrid_weight=hybrid_weight)
        self.plan, self.delta, self.budgets = plan, float(delta), budgets
        try:
            out = self.make_private(module=module, optimizer=optimizer, data_loader=data_loader,
                                    noise_multiplier=plan.noise_multiplier, max_grad_norm=plan.max_grad_norm,
                                    sample_rates=plan.sample_rates, clip_norms=plan.clip_norms,
                                    steps_per_epoch=min(steps_per_epoch, steps), **kwargs)
        except BaseException:
            self.plan = None  # refused: the engine is as it was (make_private changed nothing)
            raise
        # the ledger must use the accountant that certified the plan: an RDP ledger of a PLD plan
        # reports every record at 1.1-1.6x its budget although the PLD guarantee holds
        self.accountant = ledger_for_plan(self.plan, budgets)
        self.optimizer.pre_step_hooks.append(self._refuse_overspending)
        self.adaptive = None
        if noise_schedule is not None or adaptive_clipping is not None:
            from .adaptive import AdaptiveTraining

            self.adaptive = AdaptiveTraining(self, self.plan, clipping=adaptive_clipping,
                                             factors=getattr(self.plan, "noise_factors", None),
                                             seed=None if self.seed is None else (self.seed + 2) % 2 ** 63).attach()
        return out

    def _refuse_overspending(self, optimizer: DPOptimizer) -> None:
        # The plan certifies ε ≤ ε_i for plan.steps steps under its accountant; the ledger (same
        # accountant) additionally refuses any step that would take a record past its budget.
        if optimizer.steps >= self.plan.steps:
            raise PrivacyBudgetExceeded(
                f"the plan allows {self.plan.steps} steps and all have been taken; a further step would spend "
                "more than the records' budgets")
        # the records' ids, not an (N,) mask: with every record clear the check reads no per-record array
        over = self.accountant.exceeding(self.delta, 1)
        if over.size:
            raise PrivacyBudgetExceeded(f"one more step would take {over.size} record(s) past their budget under "
                                        f"the {self.accountant.name.upper()} ledger (first: record {int(over[0])})")

    def epsilons(self) -> np.ndarray:
        """(N,) ε each record has spent so far, at the plan's δ, by the ledger of the plan's accountant
        (``engine.accountant.name``: "rdp" or "pld"), so it is ≤ the budgets the plan was made for.

        Returns:
            (N,) float64 ε_i.
        Raises:
            RuntimeError without a plan of ``make_private_with_budgets``.
        """
        if self.plan is None:
            raise RuntimeError("epsilons() needs the ledger of make_private_with_budgets (get_epsilon(delta) gives "
                               "the ε of any run)")
        return self.accountant.epsilons(self.delta)

    def _inside_draw(self) -> bool:
        """Whether a draw is open: its physical batches or its backward wait for ``optimizer.step()``."""
        return self.state is not None and (self.state.phase is not Phase.IDLE or self.state.pending) or (
            self.data_loader is not None and self.data_loader.current is not None
            and not self.data_loader.current.is_last)

    def state_dict(self) -> dict:
        """Everything needed to resume: optimizer (with its step count and noise seed), the loader's
        next draw, the plan and the ledger. Model weights are saved by ``save_checkpoint``.

        Returns:
            a dict: "optimizer", "settings" (clipping mode and style, adaptive clipping's settings, and
            a digest of the per-record rates, bounds and noise), and where they apply "loader", "plan" /
            "ledger" / "delta", "accountant", "adaptive".
        Raises:
            RuntimeError inside a draw (after a backward, before its ``optimizer.step()``): the loader has
            moved past the draw and the optimizer not, so a run resumed from it would skip the draw and
            pair every later draw with the noise of the step before.
        """
        if self._inside_draw():
            raise RuntimeError("a checkpoint cannot be saved inside a draw (its physical batches or backward wait "
                               "for optimizer.step()): a run resumed from it would skip the draw. Save it after "
                               "optimizer.step() (after optimizer.zero_grad(), which discards the draw, the step "
                               "that closes it with noise only)")
        if self._unstepped is not None:  # discarded (zero_grad), not yet closed by its noise-only step
            raise RuntimeError(f"a checkpoint cannot be saved before Poisson draw {self._unstepped}, discarded by "
                               "optimizer.zero_grad(), is closed by optimizer.step() (noise only): a run resumed from "
                               "it would skip the draw. Call optimizer.step() first")
        state = {"optimizer": self.optimizer.state_dict(), "settings": self._settings()}
        if self.data_loader is not None:
            state["loader"] = {"seed": self.data_loader.seed, "next_step": self.data_loader.next_step}
        if self.plan is not None:
            state.update(plan=self.plan.to_dict(), ledger=self.accountant.state_dict(), delta=self.delta)
        elif self.accountant is not None:
            state["accountant"] = self.accountant.state_dict()
        if getattr(self, "adaptive", None) is not None:
            state["adaptive"] = self.adaptive.state_dict()
        return state

    def _settings(self) -> dict:
        adaptive = getattr(self, "adaptive", None)
        clipping = None if adaptive is None or adaptive.clipping is None else dataclasses.asdict(adaptive.clipping)
        return {"mode": self.mode, "clipping": self.state.clipping, "automatic_gamma": self.state.automatic_gamma,
                "adaptive_clipping": clipping,
                "rates": plan_fingerprint(self.sample_rates, self.clip_norms, self.noise_multiplier,
                                          self.max_grad_norm)}

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict()`` returned; everything privacy-related is checked first
        (``check_state``), so a refused checkpoint leaves the engine as it was. The loader then draws
        next at the checkpoint's next draw, from its seed.

        Args:
            state: a dict from ``state_dict()``.
        Returns:
            None.
        Raises:
            RuntimeError / ValueError as ``check_state``. Under ``torch.distributed`` (a collective: every
            rank must call it), ValueError on every rank when another rank refused its checkpoint, or when
            the ranks' checkpoints differ in steps taken, seeds or the loader's next draw.
        """
        try:
            checked = self.check_state(state)
        except Exception as exc:
            self._tell_ranks_refused(exc)
            raise
        if self.distributed is not None:
            self._agree_on_checkpoint(state)
        self._restore(state, *checked)

    def _tell_ranks_refused(self, exc: BaseException) -> None:
        # under torch.distributed the other ranks wait in _agree_on_checkpoint's gather: answer it, so that
        # they raise too instead of waiting for the process group's timeout
        if self.distributed is not None:
            self.distributed.gather(("refused", f"{type(exc).__name__}: {str(exc)[:300]}"))

    def _agree_on_checkpoint(self, state: dict) -> None:
        """Refuse, on every rank, to resume unless every rank loads a checkpoint of the same point of the
        same run: the ranks share each draw and add the same noise from (seed, step)."""
        loader = state.get("loader") or {}
        point = ("resumes", int(state["optimizer"]["steps"]), int(state["optimizer"]["seed"]),
                 loader.get("seed"), loader.get("next_step"))
        points = self.distributed.gather(point)
        refused = [(rank, p[1]) for rank, p in enumerate(points) if p[0] == "refused"]
        if refused:
            rank, why = refused[0]
            raise ValueError(f"rank {rank} refused its checkpoint ({why}); every rank must load the same checkpoint, "
                             "so this rank does not resume either")
        if any(p != points[0] for p in points):
            shown = "; ".join(f"rank {rank}: {p[1]} steps, noise seed {p[2]}, draw seed {p[3]}, next draw {p[4]}"
                              for rank, p in enumerate(points[:8]))
            raise ValueError(f"the checkpoint differs between ranks ({shown}): the ranks share each Poisson draw and "
                             "add the same noise from (seed, step), so every rank must resume from the same "
                             "checkpoint (the one save_checkpoint wrote once, from rank 0)")

    def _restore(self, state: dict, ledger, history) -> None:
        """Restore a state ``check_state`` accepted (ledger, history: what it returned)."""
        self.optimizer.load_state_dict(state["optimizer"])
        if self.data_loader is not None:
            self.data_loader.seed = int(state["loader"]["seed"])
            self.data_loader.next_step = int(state["loader"]["next_step"])
            self.data_loader.current = None           # no draw of the old stream goes on under the new one
        if ledger is not None:
            self.accountant = ledger
        if history is not None:
            self.accountant = history
        if getattr(self, "adaptive", None) is not None and "adaptive" in state:
            self.adaptive.load_state_dict(state["adaptive"])

    def check_state(self, state: dict) -> tuple:
        """Check a ``state_dict()`` against this engine, changing nothing (``load_state_dict`` and
        DPTrainer check a whole checkpoint before anything of it is restored).

        Args:
            state: a dict from ``state_dict()``.
        Returns:
            (ledger, history): the plan's ledger and a uniform run's accountant history to restore (each
            None where it does not apply).
        Raises:
            RuntimeError inside a draw (a physical batch or backward waits for its step); ValueError
            when the checkpoint's plan, accountant, sampling, per-record rates, bounds or noise, clipping
            mode or style, adaptive clipping or optimizer kind differ from this engine's (each named),
            when it holds fewer steps than this engine has taken (a roll-back), or when this engine has
            taken steps of another run (another seed: its released steps would drop out of the ledger).
        """
        if self._inside_draw():
            raise RuntimeError("a checkpoint cannot be loaded inside a draw (its physical batches or backward wait "
                               "for optimizer.step()): the draw's rows would be joined to another draw's. Load it "
                               "before training, or after optimizer.step()")
        self._check_settings(state.get("settings"))
        ledger = None
        if "ledger" in state:
            if self.plan is None:
                raise RuntimeError("the checkpoint holds a privacy ledger: resume with make_private_with_budgets")
            from .accounting import ledger_for_plan

            scheduled = (state["plan"].get("noise_factors") is not None, getattr(self.plan, "noise_factors", None)
                         is not None)
            if scheduled[0] != scheduled[1]:
                with_ = {True: "with a noise schedule", False: "without a noise schedule"}
                raise ValueError(f"the checkpoint's run was made {with_[scheduled[0]]}, this engine "
                                 f"{with_[scheduled[1]]} (noise_schedule=); resume with the same one")
            saved = type(self.plan).from_dict(state["plan"])
            if saved.accountant != self.plan.accountant:
                raise ValueError(f"the checkpoint's privacy plan was certified with accountant='{saved.accountant}', "
                                 f"this engine's with accountant='{self.plan.accountant}'; resume with the same "
                                 "accountant")
            if not (np.array_equal(self.plan.sample_rates, saved.sample_rates)
                    and np.array_equal(self.plan.clip_norms, saved.clip_norms)
                    and self.plan.noise_multiplier == saved.noise_multiplier and self.plan.steps == saved.steps):
                raise ValueError("the checkpoint's privacy plan differs from this engine's; resume with the same "
                                 "budgets, delta, steps and method")
            ledger = ledger_for_plan(self.plan, self.accountant.budgets)
            if self.plan.accountant == "pld" and "accountant" not in state["ledger"]:
                # written before PLD plans had a PLD ledger: an RDP ledger that the engine only ever
                # stepped over the whole dataset, so its step count is the whole history
                taken = int(state["ledger"]["steps_taken"])
                if taken:
                    ledger.step(taken)
            else:
                ledger.load_state_dict(state["ledger"])
                # the plans match; the ledger must be that plan's: the same records, budgets and rates
                # (one holding other budgets, records or a lower rate would let records overspend)
                if not (ledger.num_records == self.plan.num_records
                        and np.array_equal(ledger.budgets, self.accountant.budgets)
                        and np.array_equal(ledger.sample_rates, self.plan.sample_rates)):
                    raise ValueError("the checkpoint's privacy ledger does not belong to its plan (other records, "
                                     "budgets or sampling rates); resume from a checkpoint this run wrote")
        elif self.plan is not None:
            raise ValueError("the checkpoint holds no privacy ledger but this engine has a plan: resume a "
                             "make_private_with_budgets run from its own checkpoint")
        if ("loader" in state) != (self.data_loader is not None):
            raise ValueError("the checkpoint and this engine disagree on poisson_sampling")
        if getattr(self, "adaptive", None) is not None and "adaptive" in state:
            self.adaptive.check_state(state["adaptive"])
        self._check_optimizer_kind(state["optimizer"])
        history = None
        if self.plan is None and self.accountant is not None:
            if "accountant" not in state:
                raise ValueError("the checkpoint holds no accountant history; it was not written by a uniform "
                                 "make_private run")
            history = type(self.accountant)()
            history.load_state_dict(state["accountant"])
        accounted = ledger if ledger is not None else history
        taken = int(state["optimizer"]["steps"])
        if taken < self.optimizer.steps:
            raise ValueError(f"the checkpoint was written after {taken} steps, but this engine has taken "
                             f"{self.optimizer.steps}: loading it would roll the privacy ledger back over steps "
                             "already released and draw their noise again. Resume a run from its latest checkpoint")
        if accounted is not None and accounted.steps_taken != taken:
            # the noise of step t comes from (seed, t): a count behind the steps taken would draw the
            # same noise again; a count ahead of the accounting would leave steps unaccounted
            raise ValueError(f"the checkpoint's optimizer has taken {taken} steps but its privacy accounting "
                             f"holds {accounted.steps_taken}; resume from a checkpoint this run wrote")
        if "loader" in state and int(state["loader"]["next_step"]) < taken:
            # draw t is Poisson-sampled from (seed, t): a loader behind the steps would draw the same
            # batches again, and a record drawn twice by one draw is not what the accounting assumed
            raise ValueError(f"the checkpoint's loader would draw from step {int(state['loader']['next_step'])} "
                             f"but {taken} steps were taken; resume from a checkpoint this run wrote")
        if self.optimizer.steps and (int(state["optimizer"]["seed"]) != self.optimizer.seed or (
                self.data_loader is not None and int(state["loader"]["seed"]) != self.data_loader.seed)):
            raise ValueError(f"this engine has taken {self.optimizer.steps} steps of its own run, and the checkpoint "
                             "is another run's (other seeds): loading it would drop the released steps from the "
                             "ledger. Load a checkpoint into a fresh engine")
        return ledger, history

    def _check_settings(self, saved) -> None:
        """The clipping and the per-record rates, bounds and noise of the checkpoint's run against this one's
        (a checkpoint written before they were saved has none to check)."""
        if saved is None:
            return
        ours = self._settings()
        if self.plan is None and not self.uniform and saved.get("rates") != ours["rates"]:
            # no ledger to restore: ε is recomputed from this engine's (q_i, c_i, σ) and the steps taken
            raise ValueError("the checkpoint's run had other per-record sample rates, clip bounds or noise than this "
                             "engine's; its steps would be accounted at these. Resume with the same ones")
        names = {"mode": "mode", "clipping": "clipping", "automatic_gamma": "automatic_gamma",
                 "adaptive_clipping": "adaptive_clipping (QuantileClipping settings)"}
        differ = [f"{names[k]} {saved.get(k)!r} (checkpoint) vs {ours[k]!r} (this engine)" for k in names
                  if saved.get(k) != ours[k]]
        if differ:
            raise ValueError(f"the checkpoint was made with other clipping settings: {'; '.join(differ)}; resume "
                             "with the same ones")

    def _check_optimizer_kind(self, saved) -> None:
        groups = saved.get("optimizer", {}).get("param_groups") if isinstance(saved, dict) else None
        ours = self.optimizer.original_optimizer.param_groups
        if not groups or len(groups) != len(ours):
            return   # torch's own load_state_dict names a different number of groups
        theirs, mine = set(groups[0]) - {"params"}, set(ours[0]) - {"params"}
        if theirs != mine:
            kind = type(self.optimizer.original_optimizer).__name__
            raise ValueError(f"the checkpoint's optimizer is another kind than {kind} (its settings "
                             f"{sorted(theirs - mine)} are not this one's, {sorted(mine - theirs)} missing); resume "
                             "with the same optimizer")

    def save_checkpoint(self, path, module: nn.Module, **extra) -> None:
        """Atomically write model weights and the engine's state (incl. the ledger) to ``path``: a
        crash leaves the previous checkpoint or the new one, never a half-written file.

        The file also keeps torch's random states (CPU, and CUDA where initialized), which
        ``load_checkpoint`` restores: a model that draws randomness of its own (dropout) resumes as it
        would have gone on. It holds the noise and draw seeds, which undo the noise: keep it as secret as
        the data, and publish the model's weights alone.

        Args:
            path: the file to write (rank 0 only under data parallelism; every rank waits for it).
            module: the model (a DDP wrapper is unwrapped).
            **extra: other values to store, returned by ``load_checkpoint``.
        Returns:
            None.
        Raises:
            RuntimeError inside a draw (``state_dict``); FloatingPointError when a GPU's norms, read now
            (``ClippingState.check_finite(wait=True)``), show a record that made a stepped draw NaN.
        """
        module = inner_module(module)
        self.state.check_finite(wait=True)  # a GPU's last norms read: no checkpoint of a model a record made NaN
        state = {"model": module.state_dict(), "engine": self.state_dict(), "extra": extra, "rng": _rng_states()}
        if self.distributed is None or self.distributed.rank == 0:  # every rank holds the same state
            atomic_write(path, lambda f: torch.save(state, f))
        if self.distributed is not None:
            self.distributed.barrier()  # no rank reads or replaces it before it is complete

    def load_checkpoint(self, path, module: nn.Module) -> dict:
        """Restore what ``save_checkpoint`` wrote.

        Args:
            path: the checkpoint file; module: the model to load the weights into.
        Returns:
            the dict of its ``extra`` fields; torch's random states are restored where it holds them.
        Raises:
            ValueError for a file that cannot be read (truncated, not a torch file) or is not a
            ``save_checkpoint`` file (its keys are named); as ``load_state_dict``; a refused checkpoint
            leaves the model's weights as they were too. Under ``torch.distributed`` a rank that cannot
            read its checkpoint, or whose weights do not fit the model, makes every rank refuse (every
            rank must call it). The file is unpickled (``weights_only=False``): load only checkpoints you
            wrote.
        """
        module = inner_module(module)
        before = {k: v.detach().clone() for k, v in module.state_dict().items()}
        try:
            checkpoint = _read_checkpoint(path)
            module.load_state_dict(checkpoint["model"])
        except Exception as exc:
            module.load_state_dict(before)
            self._tell_ranks_refused(exc)
            raise
        try:
            self.load_state_dict(checkpoint["engine"])
        except BaseException:
            module.load_state_dict(before)
            raise
        if checkpoint.get("rng") is not None:
            _set_rng_states(checkpoint["rng"])
        return checkpoint["extra"]

    def reseed(self, label: str) -> None:
        """Derive new noise and draw seeds for the steps to come from the current ones and ``label``.

        The noise of step t comes from (seed, t), and a checkpoint keeps the seed: two continuations of
        one checkpoint (say, with two learning rates) would add the same noise to both from their second
        step on, and their difference would be noise-free, a release no ledger counts. Call this after
        ``load_checkpoint`` with a label per continuation (its settings, e.g. "lr=0.01"): each then
        draws its own records and noise, and each spends the records' budgets on its own (two
        continuations published spend them twice). The seeds are derived from the current ones, the
        steps taken and the label: the same checkpoint and label give the same seeds, so a
        continuation rerun with the same settings releases what it released before, and one label
        used at two steps of a run (two checkpoints) gives two.
        ``pdpfast train`` does it when ``--resume`` changes the learning rate, momentum or precision.

        Args:
            label: a non-empty string naming the continuation.
        Returns:
            None; the noise seed, the loader's draw seed and adaptive clipping's count seed change
            (a checkpoint saved afterwards holds the new ones).
        Raises:
            TypeError / ValueError for a label that is not a non-empty string; RuntimeError inside a
            draw (its noise would come from another seed than its clipping's draw).
        """
        if not isinstance(label, str):
            raise TypeError(f"label must be a string naming the continuation, got {type(label).__name__}")
        if not label:
            raise ValueError("label must be a non-empty string naming the continuation")
        if self.optimizer is None:
            raise RuntimeError("reseed() needs a private model: call make_private first")
        if self._inside_draw():
            raise RuntimeError("reseed() inside a draw: call it after load_checkpoint, before the next draw")

        step = self.optimizer.steps

        def derived(seed: int) -> int:   # 63 bits of SHA-256 over (seed, step, label): ints in [0, 2**63)
            digest = hashlib.sha256(f"{int(seed)}\x00{step}\x00{label}".encode()).digest()
            return int.from_bytes(digest[:8], "little") >> 1

        self.optimizer.seed = derived(self.optimizer.seed)
        if self.data_loader is not None:
            self.data_loader.seed = derived(self.data_loader.seed)
        if getattr(self, "adaptive", None) is not None:
            self.adaptive.seed = derived(self.adaptive.seed)

    @property
    def steps(self) -> int:
        """Optimizer steps taken (each one a Poisson draw composed in the accounting)."""
        return 0 if self.optimizer is None else self.optimizer.steps

    @property
    def expected_batch_size(self) -> float:
        """B_exp = Σ_i q_i, records per draw in expectation (float)."""
        return float(np.sum(self.sample_rates))

    def detach(self) -> None:
        """Return the model's DP layers to plain torch behaviour.

        Returns:
            None; the clipping state releases the layers and the engine's hooks are removed.
        """
        if self.state is not None:
            self.state.detach()
        if self.optimizer is not None:
            self.optimizer.detach()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
