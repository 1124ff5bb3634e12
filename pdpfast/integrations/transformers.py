"""``DPTrainer``: a Hugging Face ``transformers.Trainer`` that trains with individualized DP-SGD.

    trainer = DPTrainer(model=model, args=TrainingArguments(...), train_dataset=train,
                        budgets=eps_per_record, delta=1e-5, method="hybrid")
    trainer.train()
    trainer.epsilons()                       # (N,) ε spent by each record, ≤ its budget

What changes against the plain Trainer, and why:

* **Batches are Poisson draws.** Each optimizer step draws record i with probability q_i; the
  expected logical batch is ``per_device_train_batch_size × gradient_accumulation_steps``, and a
  draw is cut into physical batches of ``per_device_train_batch_size`` rows (the last padded with
  masked rows). Gradient accumulation therefore means "physical batches of one logical step": the
  Trainer itself runs with one micro-step per update, and ``training_step`` runs every physical
  batch of the draw. A draw is never truncated.
* **Per-sample losses.** The model's own loss is a mean over the batch's tokens, which makes one
  record's loss depend on the others' lengths. ``compute_loss`` forms one loss per record (mean
  over its own tokens) from the logits: classification and regression for labels of shape (B,),
  multi-label classification (or regression, by ``config.problem_type``) for float labels (B, C),
  causal language modelling (shifted) for ``*ForCausalLM``/``*LMHeadModel`` models (peft-wrapped
  too), token classification otherwise. Pass ``per_sample_loss=fn(outputs, labels) -> (B,)`` for
  anything else (``compute_loss_func=`` and ``label_smoothing_factor`` are refused: never applied).
* **What is not applied or not logged.** ``TrainingArguments.max_grad_norm`` (the Trainer's global
  clipping) is replaced by per-sample clipping at ``DPTrainer(max_grad_norm=)`` (another value in the
  TrainingArguments is refused). ``fp16`` (its loss scaler would scale per-sample gradients before
  clipping: use ``bf16``), ``save_only_model`` (a checkpoint without the ledger cannot be resumed),
  ``dataloader_drop_last`` and a ``train_sampling_strategy`` other than "random" (Poisson draws replace
  the sampler) are refused. The pre-noise gradient norm is never logged (it is
  a function of the private data that no noise protects). The logged training loss is, as in
  Opacus' examples, not privatized. ``ignore_data_skip`` is forced on: a resumed run continues the
  Poisson draws from the checkpointed step instead of replaying and discarding them.
* **The ledger.** ``trainer.epsilons()`` (= ``trainer.privacy_engine.epsilons()`` with budgets), ``epsilon``
  and ``epsilon_<group>`` (max ε of the records with that budget, for up to ``MAX_LOGGED_GROUPS`` distinct
  budgets) are logged with the other metrics; checkpoints hold the engine's state (``pdpfast_engine.pt``), so
  ``train(resume_from_checkpoint=...)`` continues the ledger, the draws and the noise exactly (with other
  release settings, such as the learning rate, its own draws and noise: ``DPTrainer.train``).
"""
from __future__ import annotations

import copy
import dataclasses
import inspect
import os
import warnings

import numpy as np
import torch
import transformers
from torch import nn
from torch.utils.data import DataLoader

from .._checks import as_budget_vector, check_choice, check_delta, check_nonnegative, check_positive
from .._io import atomic_write
from ..clipping import check_clipping_options
from ..engine import DPLoss, PrivacyEngine
from ..models import is_causal_lm

ENGINE_FILE = "pdpfast_engine.pt"
# TrainingArguments that change what the steps of a resumed run release: another value draws fresh seeds
_RELEASE_SETTINGS = ("learning_rate", "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps", "warmup_ratio",
                     "weight_decay", "optim", "optim_args", "adam_beta1", "adam_beta2", "adam_epsilon", "bf16")
MAX_LOGGED_GROUPS = 8
METHODS = ("sample", "scale", "hybrid", "dpsgd")
ACCOUNTANTS = ("rdp", "pld")  # the plan's accountants (``pdpfast.calibrate``)


class _Draw:
    """One Poisson draw: iterating it yields its physical batches, each opened in the engine as it
    is taken (so the next batch's bounds never apply to this one's backward)."""

    def __init__(self, batches, loader):
        self._batches, self._loader, self._done = batches, loader, False

    def __iter__(self):
        while not self._done:
            batch = next(self._batches)
            self._done = self._loader.current.is_last
            yield batch

    def __contains__(self, key) -> bool:  # the Trainer looks for "labels" to count tokens: not here
        return False


class _DrawLoader:
    """The Trainer's train data loader: one item per optimizer step (a ``_Draw``)."""

    def __init__(self, loader):
        self.loader = loader
        self.batch_size = loader.physical_batch_size

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        batches = iter(self.loader)
        for _ in range(len(self.loader)):
            draw = _Draw(batches, self.loader)
            yield draw
            if not draw._done:
                raise RuntimeError("a Poisson draw was skipped without training on it; its privacy cost would "
                                   "be charged for nothing")


def _per_record(values, n: int, name: str) -> np.ndarray:
    arr = as_budget_vector(name, values)  # numbers only (not "2.0" nor True), each finite and > 0
    if arr.ndim != 1 or arr.shape[0] != n:
        raise ValueError(f"{name} must have one value per training record ({n}), got shape {arr.shape}")
    return arr


def _budgets(spec, dataset) -> np.ndarray:
    if isinstance(spec, str):
        names = getattr(dataset, "column_names", None)
        if names is None:
            raise ValueError(f"budgets={spec!r} names a column of a datasets.Dataset, but train_dataset is a "
                             f"{type(dataset).__name__}, which has no columns: pass the budgets as an array "
                             "of one ε per record instead (or build it with datasets.Dataset.from_list)")
        if spec not in names:
            raise ValueError(f"budgets={spec!r} names a column, but train_dataset has no such column"
                             + (f" (columns: {names})" if names else ""))
        return _per_record(dataset[spec], len(dataset), "budgets")
    return _per_record(spec, len(dataset), "budgets")


def _check_train_data(dataset, budgets, expected_batch: int) -> np.ndarray | None:
    """Check the training data against the DP settings that depend on it.

    Args:
        dataset: the train dataset (map-style: ``len`` and indexing, as Poisson sampling draws by index).
        budgets: the ``budgets`` argument (an array of one ε per record, a column name, or None).
        expected_batch: per_device_train_batch_size × gradient_accumulation_steps.
    Returns:
        (N,) float64 budgets, or None without ``budgets``.
    Raises:
        ValueError for no or an empty dataset, budgets not one finite ε > 0 per record (or a column name
        that is not one of the dataset's), or an expected batch larger than the dataset; TypeError for a
        dataset without a length, or budgets that are not numbers.
    """
    if dataset is None:
        raise ValueError("DPTrainer needs train_dataset=: the budgets and the sampling rate are per training record")
    try:
        n = len(dataset)
    except TypeError:
        raise TypeError(f"train_dataset must have a length (a map-style dataset; Poisson sampling draws records by "
                        f"index), got {type(dataset).__name__}") from None
    if n == 0:
        raise ValueError("train_dataset is empty")
    vector = None if budgets is None else _budgets(budgets, dataset)
    if expected_batch > n:
        raise ValueError(f"the expected batch (per_device_train_batch_size × gradient_accumulation_steps = "
                         f"{expected_batch}) is larger than train_dataset ({n} records)")
    return vector


def _check_plan_length(training_args) -> None:
    """Check that the TrainingArguments give a privacy plan a whole number of steps.

    Args:
        training_args: the ``TrainingArguments``.
    Returns:
        None.
    Raises:
        ValueError unless ``max_steps`` > 0 or ``num_train_epochs`` is a positive whole number.
    """
    if training_args.max_steps > 0:
        return
    epochs = training_args.num_train_epochs
    if epochs != int(epochs) or epochs <= 0:
        raise ValueError(f"num_train_epochs must be a positive whole number for a privacy plan, got {epochs}; "
                         "or set max_steps")


def _check_training_arguments(training_args, max_grad_norm: float) -> None:
    """Refuse the TrainingArguments that DP training would otherwise silently ignore or break.

    Args:
        training_args: the ``TrainingArguments``.
        max_grad_norm: DPTrainer's per-sample clip norm C.
    Returns:
        None.
    Raises:
        ValueError naming the argument for: ``max_grad_norm`` other than its default 1.0, 0 (off) or C;
        ``label_smoothing_factor`` > 0; ``fp16``; ``save_only_model``; ``dataloader_drop_last``; a
        ``train_sampling_strategy`` other than "random"; ``dataloader_persistent_workers`` without workers.
    """
    clip = training_args.max_grad_norm
    if clip not in (None, 0, 1.0, max_grad_norm):
        raise ValueError(f"TrainingArguments.max_grad_norm={clip} is the Trainer's global clipping, which DP-SGD "
                         f"replaces by per-sample clipping at DPTrainer(max_grad_norm=...) (now {max_grad_norm}): "
                         f"pass DPTrainer(max_grad_norm={clip}) and leave TrainingArguments.max_grad_norm at its "
                         "default")
    if training_args.label_smoothing_factor:
        raise ValueError(f"TrainingArguments.label_smoothing_factor={training_args.label_smoothing_factor} is not "
                         "applied by DPTrainer, which forms one loss per record itself: leave it 0 and pass "
                         "DPTrainer(per_sample_loss=fn(outputs, labels) -> (B,) losses) with the smoothing you want")
    if training_args.fp16:
        raise ValueError("TrainingArguments.fp16=True is not supported: its loss scaler would scale the per-sample "
                         "gradients before they are clipped (and on CUDA its step fails); use bf16=True instead")
    if training_args.save_only_model:
        raise ValueError(f"TrainingArguments.save_only_model=True writes checkpoints without the optimizer and "
                         f"{ENGINE_FILE} (the privacy ledger, the draws and the noise seed), so no run could resume "
                         "from them; leave it False (trainer.save_model() saves the model alone)")
    if training_args.dataloader_drop_last:
        raise ValueError("TrainingArguments.dataloader_drop_last=True cannot apply: a Poisson draw is never dropped "
                         "or truncated (its privacy cost is charged whatever its size); leave it False")
    if training_args.train_sampling_strategy != "random":
        raise ValueError(f"TrainingArguments.train_sampling_strategy={training_args.train_sampling_strategy!r} cannot "
                         "apply: each step draws every record independently (Poisson sampling), which is what the "
                         "privacy ledger accounts for; leave it 'random'")
    if training_args.dataloader_persistent_workers and training_args.dataloader_num_workers == 0:
        raise ValueError("TrainingArguments.dataloader_persistent_workers=True needs dataloader_num_workers > 0")


def default_per_sample_loss(model: nn.Module):
    """The per-record loss ``DPTrainer`` uses unless given ``per_sample_loss`` (see the module docstring).

    Args:
        model: a Hugging Face model; a ``*ForCausalLM`` / ``*LMHeadModel`` class name (its own, or that of
            the model a peft wrapper holds) selects shifted (next-token) labels; ``model.config.problem_type``
            is read at each call (the model sets it in a forward with labels).
    Returns:
        ``loss(outputs, labels)`` → (B,) fp32 per-record losses (cross-entropies in nats), whose mean is the
        model's own loss when every record has as many labelled tokens.
        ``outputs``: the model's output (its ``logits``) or the logits themselves. Labels (B,) with
        logits (B, 1) (num_labels 1, whatever the labels' dtype, as the model's own rule) or problem_type
        "regression" give the squared error, otherwise class ids give the cross-entropy of logits (B, C).
        Float labels (B, C) with logits (B, C): the mean over the C labels of the binary cross-entropy
        with logits (multi-label classification, as the model's ``BCEWithLogitsLoss``), or of the
        squared error with problem_type "regression". Labels (B, T) int
        token ids (-100 ignored) with logits (B, T, V) give each record's mean cross-entropy over its own
        tokens (0 for a record with none).
    """
    causal = is_causal_lm(model)

    def loss(outputs, labels):
        logits = outputs.logits if hasattr(outputs, "logits") else outputs
        problem = getattr(getattr(model, "config", None), "problem_type", None)
        regression = problem == "regression"
        if labels.dim() == 1:
            # the model's own rule: one logit (num_labels = 1) is regression unless problem_type says otherwise
            if regression or (problem is None and logits.shape[-1] == 1):
                return (logits.squeeze(-1).float() - labels.float()).pow(2)
            return nn.functional.cross_entropy(logits.float(), labels, reduction="none")
        if labels.is_floating_point() and logits.dim() == 2:  # (B, C) targets: multi-label or regression
            if logits.shape != labels.shape:
                raise ValueError(f"float labels of shape {tuple(labels.shape)} need logits of the same shape, got "
                                 f"{tuple(logits.shape)}; pass DPTrainer(per_sample_loss=fn(outputs, labels) -> (B,))")
            if regression:
                return (logits.float() - labels.float()).pow(2).mean(1)
            return nn.functional.binary_cross_entropy_with_logits(logits.float(), labels.float(),
                                                                  reduction="none").mean(1)
        if causal:  # token t predicts token t + 1
            logits, labels = logits[:, :-1], labels[:, 1:]
        tokens = nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none",
                                             ignore_index=-100).view(labels.shape)
        counts = (labels != -100).sum(1).clamp_min(1)
        return tokens.sum(1) / counts

    return loss


class DPTrainer(transformers.Trainer):
    """A ``transformers.Trainer`` training with individualized DP-SGD (see the module docstring).

    Give ``budgets`` (individualized DP) or ``noise_multiplier`` (uniform DP), exactly one. Every setting is
    checked here, when the trainer is built (nothing is trained); the run is made private when the train
    data loader is first asked for (``train()``).

    Args:
        *args, **kwargs: the Trainer's (``model``, ``args``, ``train_dataset``, ``data_collator``, ...);
            ``args`` (TrainingArguments) and ``train_dataset`` (with a length) are required: the batch size,
            the steps or epochs and the number of records set the plan.
        budgets: one ε per training record (array of N), or the name of a column of ``train_dataset``
            (a ``datasets.Dataset``) holding them (removed before batching).
        delta: δ in (0, 1).
        method: with budgets only: "sample" | "scale" | "hybrid" (see ``pdpfast.calibrate``) or "dpsgd"
            (standard DP-SGD at the smallest budget); None (default): "sample".
        noise_multiplier: σ ≥ 0 for uniform DP without budgets (then every record has q = expected batch / N;
            σ = 0 trains without noise and reports ε = ∞).
        max_grad_norm: C > 0, the clip norm (default 1.0).
        accountant: with budgets only: "rdp" | "pld", the plan's accountant and ledger; None (default):
            "rdp". Uniform DP is always accounted by RDP.
        mode: "bk" | "ghost".
        clipping: "flat" | "per_layer".
        per_sample_loss: ``fn(outputs, labels)`` → (B,) per-record losses; default
            ``default_per_sample_loss(model)``.
        seed: of the draws and the noise, an int ≥ 0; None (default): a secret one from ``os.urandom``,
            kept in the checkpoints. Not ``args.seed`` (42 by default, and public): whoever knows the
            seed can recompute the draws and the noise, and so remove it.
    Raises:
        ValueError naming the argument for: both or neither of ``budgets`` and ``noise_multiplier``;
        ``method`` or ``accountant`` given with ``noise_multiplier`` (they apply to budgets only); a budget
        that is not finite and > 0, or not one per record of ``train_dataset`` (or a column it lacks); δ
        outside (0, 1); σ < 0 or not finite; C ≤ 0 or not finite; an unknown method, accountant, mode or
        clipping; no ``args`` or no ``train_dataset``, an empty one, or an expected batch
        (per_device_train_batch_size × gradient_accumulation_steps) larger than it; with budgets, epochs
        that are not a whole number (and no ``max_steps``); a seed < 0; ``compute_loss_func`` (use
        ``per_sample_loss``); TrainingArguments DP cannot honour (``max_grad_norm`` other than 1.0, 0 or
        this C, ``label_smoothing_factor``, ``fp16``, ``save_only_model``, ``dataloader_drop_last``,
        ``train_sampling_strategy`` other than "random", ``dataloader_persistent_workers`` without workers).
        TypeError for a value that is not a number where one is expected (``delta="1e-5"``), ``args`` that is
        not a TrainingArguments, a ``train_dataset`` without a length, or a ``per_sample_loss`` that is not
        callable.
    """

    def __init__(self, *args, budgets=None, delta: float = 1e-5, method: str | None = None,
                 noise_multiplier: float | None = None, max_grad_norm: float = 1.0, accountant: str | None = None,
                 mode: str = "bk", clipping: str = "flat", per_sample_loss=None, seed: int | None = None, **kwargs):
        if (budgets is None) == (noise_multiplier is None):
            raise ValueError("give budgets= (individualized DP) or noise_multiplier= (uniform DP), exactly one")
        if budgets is None:
            for name, value in (("method", method), ("accountant", accountant)):
                if value is not None:  # nothing is silently ignored
                    raise ValueError(f"{name}={value!r} applies to individualized DP (budgets=) only; uniform DP "
                                     f"(noise_multiplier=) has no calibrated plan (one σ, one q, an RDP ledger): "
                                     f"leave {name} out")
            noise_multiplier = check_nonnegative("noise_multiplier", noise_multiplier)
        else:
            method = "sample" if method is None else method
            check_choice("method", method, METHODS)
            accountant = "rdp" if accountant is None else accountant
            check_choice("accountant", accountant, ACCOUNTANTS)
        delta = check_delta("delta", delta)
        max_grad_norm = check_positive("max_grad_norm", max_grad_norm)
        check_clipping_options(mode, clipping)
        if per_sample_loss is not None and not callable(per_sample_loss):
            raise TypeError(f"per_sample_loss must be a function (outputs, labels) -> (B,) losses, got "
                            f"{type(per_sample_loss).__name__}")
        bound = inspect.signature(transformers.Trainer.__init__).bind(None, *args, **kwargs)
        training_args = bound.arguments.get("args")
        if training_args is None:
            raise ValueError("DPTrainer needs args= (TrainingArguments): the batch size and the number of steps "
                             "or epochs set the privacy plan")
        if not isinstance(training_args, transformers.TrainingArguments):
            raise TypeError(f"args must be a transformers.TrainingArguments, got {type(training_args).__name__}")
        _check_training_arguments(training_args, max_grad_norm)
        if bound.arguments.get("compute_loss_func") is not None:
            raise ValueError("compute_loss_func= is not used by DPTrainer, which needs one loss per record: pass "
                             "per_sample_loss=fn(outputs, labels) -> (B,) losses instead")
        accumulation_steps = int(training_args.gradient_accumulation_steps)
        if budgets is not None:
            _check_plan_length(training_args)
        dataset = bound.arguments.get("train_dataset")
        budget_vector = _check_train_data(dataset, budgets,
                                          int(training_args.per_device_train_batch_size) * accumulation_steps)
        engine = PrivacyEngine(seed=seed)
        # one Trainer micro-step per update: the draw's physical batches run inside training_step
        bound.arguments["args"] = dataclasses.replace(training_args, gradient_accumulation_steps=1,
                                                      max_grad_norm=0.0, ignore_data_skip=True)
        super().__init__(*bound.args[1:], **bound.kwargs)
        self.accumulation_steps = accumulation_steps
        self.budgets_spec, self.delta, self.method = budgets, delta, method
        self.dp_noise_multiplier, self.dp_max_grad_norm = noise_multiplier, max_grad_norm
        self.dp_accountant = accountant
        self.dp_mode, self.dp_clipping = mode, clipping
        self.per_sample_loss = per_sample_loss or default_per_sample_loss(self.model)
        self.privacy_engine = engine
        self._checked_data = (dataset, budget_vector)  # the train_dataset checked, and its budgets
        self._train_loader = None
        self._groups: list[tuple[str, np.ndarray]] = []
        self.uniform_ledger = None  # uniform DP: the RDP ledger of (q, σ); budgets: the engine's

    def epsilons(self) -> np.ndarray:
        """The ε each training record has spent so far, at ``delta``.

        Returns:
            (N,) float ε per record, in the train dataset's order.
        Raises:
            RuntimeError before training has started (the run is made private by ``train()``).
        """
        if self.uniform_ledger is not None:
            return self.uniform_ledger.epsilons(self.delta)
        if self._train_loader is None:
            raise RuntimeError("epsilons() is known once training has started (train() makes the run private)")
        return self.privacy_engine.epsilons()

    # ------------------------------------------------------------------ making the run private

    def _plan_steps(self, steps_per_epoch: int) -> int:
        if self.args.max_steps > 0:
            return int(self.args.max_steps)
        return int(self.args.num_train_epochs) * steps_per_epoch  # a whole number (_check_plan_length)

    def _make_private(self) -> None:
        dataset = self.train_dataset
        physical = int(self.args.per_device_train_batch_size)
        expected = physical * self.accumulation_steps
        if dataset is not self._checked_data[0]:  # a train_dataset set after construction: checked now
            self._checked_data = (dataset, _check_train_data(dataset, self.budgets_spec, expected))
        budgets = self._checked_data[1]
        n = len(dataset)
        if isinstance(self.budgets_spec, str) and hasattr(dataset, "remove_columns"):
            dataset = dataset.remove_columns(self.budgets_spec)
        sample_rate = expected / n
        collate = self._get_collator_with_removed_columns(self.data_collator, description="training")
        workers = dict(num_workers=self.args.dataloader_num_workers, pin_memory=self.args.dataloader_pin_memory,
                       persistent_workers=self.args.dataloader_persistent_workers,
                       multiprocessing_context=self.args.dataloader_multiprocessing_context)
        if self.args.dataloader_num_workers > 0 and self.args.dataloader_prefetch_factor is not None:
            workers["prefetch_factor"] = self.args.dataloader_prefetch_factor
        base = DataLoader(dataset, batch_size=physical, collate_fn=collate, **workers)
        optimizer = self.create_optimizer()
        steps_per_epoch = self._steps_per_epoch = max(1, round(1.0 / sample_rate))
        common = dict(module=self.model, optimizer=optimizer, data_loader=base, mode=self.dp_mode,
                      clipping=self.dp_clipping, physical_batch_size=physical, loss_reduction="mean")
        if self.dp_mode == "ghost":
            common["criterion"] = nn.CrossEntropyLoss()  # unused: compute_loss builds the per-sample losses
        engine = self.privacy_engine
        if budgets is not None:
            steps = self._plan_steps(steps_per_epoch)
            # "dpsgd": standard DP-SGD, every record held to the strictest budget
            plan_budgets, method = ((np.full(n, budgets.min()), "sample") if self.method == "dpsgd"
                                    else (budgets, self.method))
            out = engine.make_private_with_budgets(
                budgets=plan_budgets, delta=self.delta, steps=steps, method=method, sample_rate=sample_rate,
                max_grad_norm=self.dp_max_grad_norm, accountant=self.dp_accountant, **common)
            self._groups = self._privacy_groups(budgets)
        else:
            from ..accounting.ledger import IndividualAccountant

            out = engine.make_private(noise_multiplier=self.dp_noise_multiplier, max_grad_norm=self.dp_max_grad_norm,
                                      sample_rates=sample_rate, steps_per_epoch=steps_per_epoch, **common)
            self.uniform_ledger = IndividualAccountant(engine.sample_rates, self.dp_noise_multiplier)
            engine.optimizer.post_step_hooks.append(lambda _: self.uniform_ledger.step())
        self.optimizer, self._train_loader = out.optimizer, out.data_loader

    @staticmethod
    def _privacy_groups(budgets: np.ndarray) -> list[tuple[str, np.ndarray]]:
        values = np.unique(budgets)
        if values.size > MAX_LOGGED_GROUPS:
            return []
        return [(f"epsilon_budget_{v:g}", budgets == v) for v in values]

    # ------------------------------------------------------------------ Trainer hooks

    def create_optimizer(self, model=None):
        """The Trainer's optimizer, created once (the engine wraps it, and later calls get the wrapper).

        Args:
            model: passed to ``Trainer.create_optimizer`` when it creates one.
        Returns:
            ``self.optimizer``: the Trainer-built optimizer, or the ``DPOptimizer`` once the run is private.
        """
        if self.optimizer is None:
            super().create_optimizer(model)
        return self.optimizer

    def get_train_dataloader(self):
        """The training loader, one item per optimizer step; makes the run private on the first call.

        Returns:
            a loader of Poisson draws, each an iterable of the draw's physical batches (as the data
            collator makes them, ``per_device_train_batch_size`` rows, the last padded with masked rows).
        Raises:
            what the engine refuses; for a ``train_dataset`` set after construction, what ``__init__``
            refuses of one (none, empty, budgets not one per record, an expected batch larger than it).
        """
        if self._train_loader is None:
            self._make_private()
        return _DrawLoader(self._train_loader)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The physical batch's loss from per-record losses (the model's own loss is not used).

        Args:
            model: the (converted) model.
            inputs: one physical batch, a dict of (B, ...) tensors with "labels".
            return_outputs: also return the model's outputs.
            num_items_in_batch: ignored (each record's loss is a mean over its own tokens).
        Returns:
            the scalar loss Σ_i ℓ_i / B (a ``DPLoss`` in ghost mode), or (loss, outputs).
        Raises:
            ValueError without labels, or when ``per_sample_loss`` does not return shape (B,).
        """
        inputs = dict(inputs)
        labels = inputs.pop("labels", None)
        if labels is None:
            raise ValueError("DPTrainer needs labels in every batch (a 'labels' or 'label' column) to form "
                             "per-record losses")
        outputs = model(**inputs)
        per_sample = self.per_sample_loss(outputs, labels)
        rows = labels.shape[0]
        if per_sample.shape != (rows,):
            raise ValueError(f"per_sample_loss must return one loss per record, shape ({rows},); "
                             f"got {tuple(per_sample.shape)}")
        if self.dp_mode == "ghost":
            loss = DPLoss(per_sample, self.privacy_engine.state, "mean")
        else:
            loss = per_sample.sum() / rows  # loss_reduction="mean": the engine undoes the 1/rows exactly
        return (loss, outputs) if return_outputs else loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        """Forward and backward over every physical batch of one Poisson draw.

        Args:
            model: the model (put in training mode).
            inputs: one Poisson draw from the train loader: an iterable of physical batches.
            num_items_in_batch: ignored.
        Returns:
            the mean of the physical batches' losses, a detached scalar tensor (not privatized).
        """
        model.train()
        total, batches = None, 0
        for batch in inputs:
            batch = self._prepare_inputs(batch)
            with self.compute_loss_context_manager():
                loss = self.compute_loss(model, batch)
            loss.backward()
            value = loss.detach()
            total = value if total is None else total + value
            batches += 1
        return total / batches

    def _get_grad_norm(self, model, grad_norm=None):
        return None  # the norm of the clipped sum before noise is not private: never logged

    def floating_point_ops(self, inputs) -> int:
        """FLOPs are not counted: the inputs are a Poisson draw of physical batches, not one dict of tensors.

        Args:
            inputs: one Poisson draw.
        Returns:
            0.
        """
        return 0

    def log(self, logs: dict, start_time=None) -> None:
        """The Trainer's ``log``, with the privacy spent added to every log that has a training loss.

        Args:
            logs: the metrics to log; when it holds "loss" or is the train summary (with "train_runtime"),
                after training started, its "epoch" is steps / steps per epoch (continued by a resumed run);
                one with "loss" gets "epsilon", the largest ε spent by any record, and for up to
                ``MAX_LOGGED_GROUPS`` distinct budgets "epsilon_budget_<budget>", the largest ε spent by a
                record with that budget.
            start_time: passed to ``Trainer.log``.
        Returns:
            None.
        """
        if self._train_loader is not None and ("loss" in logs or "train_runtime" in logs):
            # the epoch in expected passes over the data: the Trainer counts it from the batches of this
            # call, and a resumed run does not replay the draws before its checkpoint (ignore_data_skip);
            # the summary too, whose last step need not be a logging step
            self.state.epoch = self.state.global_step / self._steps_per_epoch
        if self._train_loader is not None and "loss" in logs:
            eps = self.epsilons()
            logs["epsilon"] = float(eps.max())
            for name, members in self._groups:
                logs[name] = float(eps[members].max())
        super().log(logs, start_time)

    def train(self, resume_from_checkpoint=None, *args, continuation: str | None = None, **kwargs):
        """``Trainer.train``; a resume is checked before the Trainer loads anything of the checkpoint.

        A checkpoint without ``pdpfast_engine.pt``, unreadable, or older than the steps this trainer has
        taken is refused before the model's weights are loaded; one the engine refuses later (another
        plan) leaves the model's weights and the Trainer's state as they were. A resume with another
        learning rate, schedule, weight decay, optimizer or precision than the checkpoint's run draws its
        own records and noise (``PrivacyEngine.reseed``): two continuations of one checkpoint would
        otherwise add the same noise, and their difference would be noise-free. ``continuation`` does the
        same for a change the trainer cannot see (the model's code, the collator, the loss).

        Args:
            resume_from_checkpoint, *args, **kwargs: the Trainer's.
            continuation: with ``resume_from_checkpoint``, a label naming this continuation (e.g.
                "new collator"): its records and noise are drawn from seeds derived from the
                checkpoint's, its step and the label. None (default): only the settings above do.
        Returns:
            what ``Trainer.train`` returns.
        Raises:
            FileNotFoundError / ValueError for a refused checkpoint (see above); ValueError for an empty
            ``continuation`` or one without a checkpoint; TypeError for one that is not a string; what
            ``Trainer.train`` raises.
        """
        checkpoint = resume_from_checkpoint
        if checkpoint is True:
            checkpoint = transformers.trainer_utils.get_last_checkpoint(self.args.output_dir)
        if continuation is not None:
            if not isinstance(continuation, str):
                raise TypeError(f"continuation must be a string naming the continuation, got "
                                f"{type(continuation).__name__}")
            if not continuation:
                raise ValueError("continuation must be a non-empty string naming the continuation")
            if not checkpoint:
                raise ValueError("continuation= names a continuation of a checkpoint: give resume_from_checkpoint")
        self._continuation = continuation
        if not checkpoint:        # (none found: the Trainer says so)
            return super().train(resume_from_checkpoint, *args, **kwargs)
        self._engine_state = (checkpoint, self._read_engine_state(checkpoint))   # (read once: see below)
        # (kept on the CPU: a second copy of a large model's weights on its GPU could run out of memory)
        weights = {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}
        trainer_state = copy.deepcopy(self.state)
        self._refused = False
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        except BaseException:
            if self._refused:      # the Trainer had loaded the checkpoint's weights and state before the refusal
                self.model.load_state_dict(weights)
                self.state = trainer_state
            raise

    def _read_engine_state(self, checkpoint) -> dict:
        """The checkpoint's engine state, refused when missing, unreadable or older than the steps taken."""
        path = os.path.join(checkpoint, ENGINE_FILE)
        if not os.path.exists(path):
            raise FileNotFoundError(f"{checkpoint} holds no {ENGINE_FILE}: it was not written by DPTrainer, so its "
                                    "privacy ledger is unknown and training cannot resume from it")
        try:
            state = torch.load(path, map_location="cpu", weights_only=False)
            taken = int(state["optimizer"]["steps"])
        except Exception as exc:
            raise ValueError(f"{path} cannot be read as DPTrainer's engine state (truncated or damaged): "
                             f"{type(exc).__name__}: {exc}") from None
        if taken < self.privacy_engine.steps:
            raise ValueError(f"{checkpoint} was written after {taken} steps, but this trainer has taken "
                             f"{self.privacy_engine.steps}: resuming from it would roll the privacy ledger back over "
                             "steps already released and draw their noise again. Resume a run from its latest "
                             "checkpoint")
        return state

    def _release_settings(self) -> dict:
        """The TrainingArguments that change what a step releases, as comparable values."""
        return {name: str(getattr(self.args, name, None)) for name in _RELEASE_SETTINGS}

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        state = self.privacy_engine.state_dict()
        if self.uniform_ledger is not None:
            state["uniform_ledger"] = self.uniform_ledger.state_dict()
        state["release_settings"] = self._release_settings()
        atomic_write(os.path.join(output_dir, ENGINE_FILE), lambda f: torch.save(state, f))

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        if checkpoint is None:
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        self._refused = True          # until the checks pass (``train`` then gives back the weights)
        # everything is checked before the Trainer loads the optimizer's state: it holds the step count and the
        # noise seed, and a refused resume must leave them as they were (training on would draw released noise)
        read, state = self.__dict__.pop("_engine_state", (None, None))     # what train() read and checked
        if read != checkpoint:
            state = self._read_engine_state(checkpoint)
        path = os.path.join(checkpoint, ENGINE_FILE)
        checked = self.privacy_engine.check_state(state)
        uniform = None
        if "uniform_ledger" in state:
            from ..accounting.ledger import IndividualAccountant

            uniform = IndividualAccountant.__new__(IndividualAccountant)
            uniform.load_state_dict(state["uniform_ledger"])
            taken = int(state["optimizer"]["steps"])
            if uniform.steps_taken != taken or uniform.num_records != self.uniform_ledger.num_records:
                raise ValueError(f"{path}: its per-record ledger holds {uniform.steps_taken} steps of "
                                 f"{uniform.num_records} records, the optimizer took {taken} steps of "
                                 f"{self.uniform_ledger.num_records}; resume from a checkpoint this run wrote")
            if not (np.array_equal(uniform.sample_rates, self.uniform_ledger.sample_rates)
                    and np.array_equal(uniform.noise_multipliers, self.uniform_ledger.noise_multipliers)):
                raise ValueError(f"{path}: its run had another sample rate or noise_multiplier than this one; its "
                                 "ledger would go on charging those. Resume with the same settings")
        self._refused = False
        super()._load_optimizer_and_scheduler(checkpoint)
        self.privacy_engine._restore(state, *checked)
        if uniform is not None:
            self.uniform_ledger = uniform
        saved, now = state.get("release_settings"), self._release_settings()
        changes = [f"{k} {saved.get(k)} → {now[k]}" for k in now if saved is not None and saved.get(k) != now[k]]
        if getattr(self, "_continuation", None) is not None:
            changes.append(f"continuation {self._continuation!r}")
        if changes:
            changed = ", ".join(changes)
            self.privacy_engine.reseed(changed)
            warnings.warn(f"DPTrainer: resumed from {checkpoint} with {changed}: this continuation draws its own "
                          "records and noise from here, so it shares none with another continuation of the "
                          "checkpoint; each spends the records' budgets", stacklevel=2)
