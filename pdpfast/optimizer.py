"""DPOptimizer: noise and normalization of the clipped sum, then the wrapped optimizer's step."""
from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable

import torch
from torch.optim import Optimizer

from ._checks import check_choice, check_int, check_nonnegative, check_positive
from .clipping import attach_changes, unguarded
from .ops.noise import add_noise_

# ids of the wrapped optimizers a DPOptimizer is stepping now: their own step is refused otherwise
_STEPPING: set[int] = set()


GRAD_SCALER_REFUSAL = (
    "optimizer.step() was called by a torch.amp.GradScaler (scaler.step(optimizer)). Its loss scale S multiplies "
    "every per-sample gradient before pdpfast clips it, and its unscale divides the clipped sum by S before the "
    "noise: a record then contributes up to c_i / S, 1/65536 of its bound at the default S and more than the "
    "noise is calibrated for once S < 1. Loss scaling is not supported: train "
    "under torch.autocast(device_type, dtype=torch.bfloat16), which needs no scaler (pdpfast's norms and clip "
    "weights accumulate in fp32), and drop the GradScaler (or construct it with enabled=False)")

SECURE_MODE_REFUSAL = ("secure_mode=True is not supported: pdpfast draws Poisson masks and noise from seeded "
                       "counter-based generators, not from a cryptographically secure one")


def noise_seed_from(generator: torch.Generator) -> int:
    """The noise seed a ``torch.Generator`` given for the noise stands for: one draw from it (so the
    same generator state gives the same noise), as ``make_private(noise_generator=)`` and
    ``DPOptimizer(generator=)`` read it.

    Args:
        generator: a torch.Generator (it advances by one draw).
    Returns:
        an int in [0, 2**62).
    Raises:
        TypeError when ``generator`` is not a torch.Generator.
    """
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    return int(torch.randint(0, 2 ** 62, (1,), generator=generator))


def _refuse_direct_step(optimizer, args, kwargs) -> None:
    if id(optimizer) not in _STEPPING:
        raise RuntimeError(
            f"{type(optimizer).__name__}.step() was called on the optimizer given to make_private: it would apply "
            "the clipped sum with no noise and charge no privacy. Step the optimizer make_private returned (keep "
            "that one in trainers and LR schedulers), or detach the engine (engine.detach()) to train without DP")


class DPOptimizer(Optimizer):
    """Wraps ``optimizer``; ``step()`` performs ĝ = (Σ_i w_i g_i + N(0, σ²C²I)) / B_exp (DESIGN.md §1.4).

    The clipped sums Σ_i w_i g_i are already in ``param.grad`` (written by the clipping state during
    backward). B_exp = Σ_i q_i is the *expected* batch size, a constant of the plan: the realized
    batch size is private and never used. Noise is drawn from (seed, step), so it is reproducible.
    When a draw was split over several physical batches, ``step()`` does nothing until the last of
    them, so the clipped sums accumulate; ``zero_grad()`` acts only when ``may_zero_grad()`` says
    no draw's earlier batches would be lost (the engine sets both, and the hooks that close a draw).

    param_groups and state are the wrapped optimizer's own (LR schedulers work unchanged). The wrapped
    optimizer's own ``step()`` is refused while this one wraps it (``detach()`` allows it again): called
    directly it would release the clipped sum without noise.

    A ``torch.amp.GradScaler`` is refused at ``scaler.step(optimizer)`` (``GRAD_SCALER_REFUSAL``): the
    optimizer declares ``_step_supports_amp_scaling``, so the scaler hands it the scale (``grad_scale``,
    ``found_inf``) instead of unscaling ``.grad`` and skipping steps on its own.

    Args:
        optimizer: the torch optimizer to wrap.
        noise_multiplier: σ, a finite float ≥ 0 (noise std in units of the clip norm C).
        max_grad_norm: C, the clip norm, a finite float > 0.
        expected_batch_size: B_exp = Σ_i q_i, records per draw, a finite float > 0.
        seed: the noise seed, an int in [0, 2**63) as ``DPDataLoader``'s; None draws one from ``os.urandom``.
        loss_reduction, generator, secure_mode: Opacus's DPOptimizer arguments, where this one can honor
            them. loss_reduction: only "mean", Opacus's default and what ``step()`` does (the noisy sum
            divided by ``expected_batch_size``); Opacus's "sum" does not divide, and is refused rather than
            ignored. generator: seeds the noise, as ``make_private``'s ``noise_generator`` (one draw from it;
            instead of ``seed``). secure_mode: only False, as ``PrivacyEngine``'s.
    Raises:
        TypeError if ``optimizer`` is not a ``torch.optim.Optimizer``, a number is not a number or
            ``generator`` not a torch.Generator; ValueError for an out-of-range number, a seed that is not
            such an int, both ``seed`` and ``generator``, loss_reduction="sum" or another value than "mean",
            or secure_mode=True.
    """

    # a GradScaler then calls step() itself, with grad_scale / found_inf set, rather than unscaling
    # .grad (between the clipping and the noise) and skipping steps on overflow: step() refuses it
    _step_supports_amp_scaling = True

    def __init__(self, optimizer: Optimizer, *, noise_multiplier: float, max_grad_norm: float,
                 expected_batch_size: float, seed: int | None = None, loss_reduction: str = "mean",
                 generator: torch.Generator | None = None, secure_mode: bool = False):
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if loss_reduction == "sum":
            raise ValueError(
                "loss_reduction='sum' is not offered by DPOptimizer: its step always divides the noisy clipped sum "
                "by expected_batch_size (Opacus's 'mean'), and how the loss is read is the clipping state's "
                "(ClippingState.begin_batch(loss_scale=)) or make_private's loss_reduction. For Opacus's 'sum' "
                "step, leave loss_reduction='mean' and multiply the learning rate by expected_batch_size")
        check_choice("loss_reduction", loss_reduction, ("mean",))
        if secure_mode:
            raise ValueError(SECURE_MODE_REFUSAL)
        if generator is not None and seed is not None:
            raise ValueError("give seed or generator, not both: each seeds the noise")
        if generator is not None:
            seed = noise_seed_from(generator)
        self.original_optimizer = optimizer
        self._set_step_noise(noise_multiplier, max_grad_norm)
        self.expected_batch_size = check_positive("expected_batch_size", expected_batch_size)
        self.seed = int.from_bytes(os.urandom(7), "little") if seed is None else check_int("seed", seed, 0)
        self.steps = 0
        self.at_step_boundary: Callable[[], bool] = lambda: True
        self.may_zero_grad: Callable[[], bool] = lambda: True
        self.pre_step_hooks: list[Callable[[DPOptimizer], None]] = []
        self.post_step_hooks: list[Callable[[DPOptimizer], None]] = []
        # run when a pre-step hook refuses the step (the ledger, a parameter nothing clips), then it raises
        self.refused_step_hooks: list[Callable[[DPOptimizer], None]] = []
        self.post_zero_grad_hooks: list[Callable[[DPOptimizer], None]] = []
        self.reduce_grads: Callable[[list, int], None] | None = None
        self._all_clipped: tuple | None = None  # (attach_changes(), ids of the trainable params): all guarded then
        for name in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
                     "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
                     "_optimizer_load_state_dict_post_hooks"):
            setattr(self, name, OrderedDict())
        self._direct_step_guard = optimizer.register_step_pre_hook(_refuse_direct_step)

    def detach(self) -> None:
        """Let the wrapped optimizer step on its own again (after ``PrivacyEngine.detach``).

        Returns:
            None.
        """
        self._direct_step_guard.remove()

    def step_wrapped(self) -> None:
        """The wrapped optimizer's step, on the gradients as they are (noised and normalized by the
        caller): ``step`` and a captured step (``pdpfast.graphs``) call it.

        Returns:
            None.
        """
        key = id(self.original_optimizer)
        _STEPPING.add(key)
        try:
            self.original_optimizer.step()
        finally:
            _STEPPING.discard(key)

    @property
    def param_groups(self):
        """The wrapped optimizer's param_groups."""
        return self.original_optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.original_optimizer.param_groups = value

    @property
    def state(self):
        """The wrapped optimizer's state."""
        return self.original_optimizer.state

    @state.setter
    def state(self, value):
        self.original_optimizer.state = value

    @property
    def defaults(self):
        """The wrapped optimizer's defaults."""
        return self.original_optimizer.defaults

    @defaults.setter
    def defaults(self, value):
        self.original_optimizer.defaults = value

    @property
    def noise_multiplier(self) -> float:
        """σ, the noise std in units of ``max_grad_norm``. Read-only: the engine's accountant charges each
        step at the σ it planned, so a σ set by hand would go unaccounted."""
        return self._noise_multiplier

    @noise_multiplier.setter
    def noise_multiplier(self, value):
        raise AttributeError(
            "optimizer.noise_multiplier cannot be set: the privacy engine charges every step at the noise it "
            "planned, so a new value would go unaccounted (a smaller one spends more ε than reported). For noise "
            "that changes over the steps, pass noise_schedule= to make_private_with_budgets, which accounts it; "
            "Opacus's noise schedulers do not apply here")

    @property
    def max_grad_norm(self) -> float:
        """C, the reference clip norm the noise std is σ·C of. Read-only: the records' clip bounds are the
        engine's (per record), so a C set by hand would change the noise and not the clipping."""
        return self._max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value):
        raise AttributeError(
            "optimizer.max_grad_norm cannot be set: the records' clip bounds are the privacy engine's (fixed by "
            "make_private's max_grad_norm or by the plan), and here it would only scale the noise, unaccounted. "
            "To clip to other bounds, call make_private again with them; for bounds that follow the gradients, "
            "pass adaptive_clipping=QuantileClipping(...) to make_private_with_budgets")

    def _set_step_noise(self, noise_multiplier: float, max_grad_norm: float) -> None:
        # the one way to change σ and C: at construction, and the engine's own hooks (a noise schedule,
        # adaptive clipping), which set the ledger's multipliers to match
        self._noise_multiplier = check_nonnegative("noise_multiplier", noise_multiplier)
        self._max_grad_norm = check_positive("max_grad_norm", max_grad_norm)

    @property
    def noise_std(self) -> float:
        """Standard deviation of the noise added to the clipped sum: σ·C."""
        return self._noise_multiplier * self._max_grad_norm

    def trainable_params(self) -> list[torch.Tensor]:
        """The parameters the optimizer updates that require a gradient.

        Returns:
            a list of parameter tensors, in param_groups order.
        """
        return [p for group in self.param_groups for p in group["params"] if p.requires_grad]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients, unless ``may_zero_grad()`` says a draw's earlier batches would be lost.

        Args:
            set_to_none: passed to the wrapped optimizer's ``zero_grad``.
        Returns:
            None (the post-zero-grad hooks run when it did zero them).
        """
        if self.may_zero_grad():
            self.original_optimizer.zero_grad(set_to_none)
            for hook in self.post_zero_grad_hooks:
                hook(self)

    @torch.no_grad()
    def add_noise_and_normalize(self, device_seed: torch.Tensor | None = None, keep: list | None = None) -> None:
        """ĝ = (Σ_i w_i g_i + N(0, σ²C²)) / B_exp in every ``param.grad``, noise from (seed, steps).

        A parameter no record reached (``grad`` None) gets a zero gradient and is noised all the same;
        under data parallelism ``reduce_grads`` sums over ranks first.

        Args:
            device_seed, keep: see ``pdpfast.ops.noise.add_noise_`` (a captured step reads the step from
                a device-side counter).
        Returns:
            None; every trainable ``param.grad`` is overwritten in place.
        """
        grads = []
        for p in self.trainable_params():
            if p.grad is None:  # no record reached it (e.g. an empty draw): noise all the same
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        if self.reduce_grads is not None:  # data parallel: Σ over ranks first, then the same noise on each
            self.reduce_grads(grads, self.steps)
        add_noise_(grads, self.noise_std, self.seed, self.steps, device_seed=device_seed, keep=keep)
        torch._foreach_div_(grads, self.expected_batch_size)

    def step(self, closure: Callable | None = None):
        """One private step: before_step, noise and normalize, the wrapped step, after_step.

        Does nothing but run the closure while ``at_step_boundary()`` is False (a draw split over several
        physical batches is not yet complete).

        Args:
            closure: optional, re-evaluates the model and returns the loss (run with grad enabled).
        Returns:
            the closure's loss, or None.
        Raises:
            RuntimeError when called by a torch.amp.GradScaler (``GRAD_SCALER_REFUSAL``); what
            ``before_step`` raises.
        """
        if getattr(self, "found_inf", None) is not None or getattr(self, "grad_scale", None) is not None:
            # the scaler deletes them only after a step that returns: a loop that drops it is not refused again
            self.__dict__.pop("found_inf", None)
            self.__dict__.pop("grad_scale", None)
            for hook in self.refused_step_hooks:
                hook(self)
            raise RuntimeError(GRAD_SCALER_REFUSAL)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self.at_step_boundary():
            return loss
        self.before_step()
        self.add_noise_and_normalize()
        self.step_wrapped()
        self.after_step()
        return loss

    def before_step(self) -> None:
        """The host side of a step before its device work: the pre-step hooks (e.g. the ledger
        refusing a step past a budget). ``step`` and a captured step (``pdpfast.graphs``) call it.

        Returns:
            None.
        Raises:
            whatever a pre-step hook raises (e.g. ``PrivacyBudgetExceeded``).
        """
        try:
            for hook in self.pre_step_hooks:
                hook(self)
            self._refuse_unclipped()      # after the engine's own checks, which name the parameter
        except BaseException:
            for hook in self.refused_step_hooks:
                hook(self)
            raise

    def _refuse_unclipped(self) -> None:
        """Refuse a gradient that no attached ``ClippingState`` clipped: this optimizer only noises and
        divides what is in ``param.grad``, so an ordinary gradient there would be released unclipped
        (Opacus's DPOptimizer, used on its own, refuses as it finds no per-sample gradients). A
        parameter without a gradient is noised from zero, which releases nothing. The verdict that every
        trainable parameter is guarded is kept until a state is attached or detached."""
        params = self.trainable_params()
        key = (attach_changes(), tuple(map(id, params)))     # which parameters train may change between steps
        if key == self._all_clipped:
            return
        stray = unguarded(p for p in params if p.grad is not None)
        if stray is not None:
            raise RuntimeError(
                f"DPOptimizer.step(): the gradient of a parameter of shape {tuple(stray.shape)} was not written by a "
                "pdpfast clipping state (none is attached to its model), so it would be released unclipped. Make the "
                "model private with PrivacyEngine.make_private, which clips each record's gradient before this "
                "optimizer adds noise (or attach a pdpfast.clipping.ClippingState to the converted model)")
        if unguarded(params) is None:
            self._all_clipped = key

    def after_step(self) -> None:
        """The host side of a step after its device work: count it, run the post-step hooks (close
        the draw, charge the ledger).

        Returns:
            None; ``steps`` grows by one.
        """
        self.steps += 1
        # torch's LR schedulers learn that a step happened through their wrapper of step(); a
        # captured step (pdpfast.graphs) steps without calling it
        self._opt_called = True
        for hook in self.post_step_hooks:
            hook(self)

    def state_dict(self):
        """The optimizer's state for a checkpoint.

        Returns:
            a dict: "optimizer" (the wrapped optimizer's state_dict), "steps" (int), "seed" (int).
        """
        return {"optimizer": self.original_optimizer.state_dict(), "steps": self.steps, "seed": self.seed}

    def load_state_dict(self, state_dict) -> None:
        """Restore the state ``state_dict()`` returned.

        Args:
            state_dict: a dict with "optimizer", "steps" and "seed".
        Returns:
            None.
        Raises:
            ValueError for steps < 0 (nothing changed).
        """
        steps, seed = int(state_dict["steps"]), int(state_dict["seed"])
        if steps < 0:
            raise ValueError(f"DPOptimizer state: steps must be >= 0, got {steps}")
        self.original_optimizer.load_state_dict(state_dict["optimizer"])
        self.steps, self.seed = steps, seed

    def __repr__(self) -> str:
        return (f"DPOptimizer(noise_multiplier={self.noise_multiplier}, max_grad_norm={self.max_grad_norm}, "
                f"expected_batch_size={self.expected_batch_size:g}, optimizer={self.original_optimizer!r})")
