"""The shared training loop: how a batch becomes a loss, how a model is made private for a method,
and the ordinary loop that takes a given number of private steps.

Used by every driver — ``pdpfast train`` (:mod:`pdpfast.train`), PDP-SGD (:mod:`pdpfast.pdp_sgd`),
the demos, the audit and the federated clients (:mod:`pdpfast.fl.client`) — so they train alike:

* :class:`Task` — how a batch becomes a loss and how a model is evaluated (classification with
  logits (B, K), or next-token language modelling for GPT-2, padding no target); losses are sums of
  per-record losses (``loss_reduction="sum"``), which keeps empty Poisson draws well defined.
* :func:`private_engine` — ``PrivacyEngine.make_private_with_budgets`` for "sample" / "scale" /
  "hybrid", and for "dpsgd" (every record at the smallest budget: what standard DP-SGD must use).
* :func:`private_steps` — the ordinary training loop, run until the engine has taken a given
  number of optimizer steps (so a resumed run takes exactly the steps that remain).

It sits above the engine and below the drivers: it imports :mod:`pdpfast.data` and :mod:`pdpfast.engine`
(lazily, through ``pdpfast.PrivacyEngine``) and nothing of the drivers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from ._checks import check_choice, check_int, check_positive_integer
from .data import map_style_length

__all__ = ["IGNORE_INDEX", "PrivateRun", "SequenceCrossEntropy", "Task", "evaluate", "model_device", "pin_memory_for",
           "private_engine", "private_steps", "to_device"]


# ---------------------------------------------------------------------------------------------- devices
def model_device(model: nn.Module) -> torch.device:
    """Where the model's parameters live.

    Args:
        model: any module.
    Returns:
        the device of its first parameter (the CPU for a model without parameters).
    """
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def to_device(batch, device: torch.device):
    """Move a batch to a device. Copies from pinned memory are non-blocking: the host goes on to the
    next batch while the copy runs.

    Args:
        batch: a tensor, or lists / tuples / dicts of them (other values are returned as they are).
        device: where to put it.
    Returns:
        the batch, of the same structure, with every tensor on ``device``.
    """
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def pin_memory_for(model: nn.Module) -> bool:
    """Whether loaders feeding ``model`` should pin their batches (page-locked host memory makes
    host-to-GPU copies asynchronous); only worth it, and only possible, for a CUDA model.

    Args:
        model: the model the batches are for.
    Returns:
        True when its parameters are on a CUDA device.
    """
    return model_device(model).type == "cuda"


# ---------------------------------------------------------------------------------------------- tasks
IGNORE_INDEX = -100   # a target that is not one (padding), as in torch's cross_entropy and Hugging Face


class SequenceCrossEntropy(nn.Module):
    """Next-token cross-entropy; a record's loss is the mean over its real targets (those not
    ``IGNORE_INDEX``: :meth:`Task.next_token_targets` marks padding so), 0 for a record with none.

    forward(logits (B, T, V), targets (B, T)) → (B,) with reduction "none", else their sum / mean.
    Each record's loss reads only that record's row, so a summed loss is a sum of per-record losses.
    (A torch loss module with a ``reduction`` attribute, so ghost mode can wrap it.)"""

    def __init__(self, reduction: str = "sum"):
        super().__init__()
        self.reduction = reduction

    def forward(self, logits, targets):
        """Per-record next-token losses.

        Args:
            logits (B, T, V) float; targets (B, T) int64 token ids, ``IGNORE_INDEX`` where there is no target.
        Returns:
            (B,) per-record losses in nats (the mean over the record's real targets; 0, with a zero gradient,
            for a record without one) for reduction "none", else their sum or mean (a scalar).
        """
        per_token = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                                                reduction="none", ignore_index=IGNORE_INDEX).reshape(targets.shape)
        real = (targets != IGNORE_INDEX).sum(1).clamp_min(1)
        per_record = per_token.sum(1) / real
        if self.reduction == "none":
            return per_record
        return per_record.sum() if self.reduction == "sum" else per_record.mean()


@dataclass(frozen=True)
class Task:
    """What a model computes and how it is called.

    Attributes:
        kind: "classification" or "lm".
        family: "plain" (``model(x)``), "bert" (token ids with an attention mask hiding ``pad_id``)
            or "gpt2" (token ids alone: a causal LM, GPT-2 or Llama, padded on the right).
        pad_id: the padding token id of token inputs (an int ≥ 0; pdpfast's data pad with 0 on the
            right): "bert" hides it with the attention mask; "lm" takes no target in a record's trailing
            run of it (a ``pad_id`` inside the sequence stays a target — id 0 is a real token, "!", for
            GPT-2's tokenizer — but one that ends a record cannot be told from its padding, and is none).
    Raises:
        ValueError for another kind or family, or a pad_id that is not an int ≥ 0.
    """

    kind: str = "classification"
    family: str = "plain"
    pad_id: int = 0

    def __post_init__(self):
        check_choice("kind", self.kind, ("classification", "lm"))
        check_choice("family", self.family, ("plain", "bert", "gpt2"))
        check_int("pad_id", self.pad_id, 0)

    @classmethod
    def for_model(cls, name: str) -> Task:
        """The task of a model of :mod:`pdpfast.models` by name.

        Args:
            name: a registered model name.
        Returns:
            a ``Task`` with the model's kind, and the input family "bert" for "bert*" models, "gpt2"
            (token ids, no mask) for the causal LMs "gpt2*" and "llama*", "plain" otherwise.
        Raises:
            ValueError for an unknown name.
        """
        from .models import model_spec

        spec = model_spec(name)
        family = "bert" if name.startswith("bert") else "gpt2" if name.startswith(("gpt2", "llama")) else "plain"
        return cls(spec.task, family)

    def criterion(self) -> nn.Module:
        """The summed loss module.

        Returns:
            ``nn.CrossEntropyLoss(reduction="sum")`` of logits (B, K) against labels (B,), or
            :class:`SequenceCrossEntropy` ("sum") for "lm"; either gives a scalar, the sum of the B
            per-record losses in nats.
        """
        return SequenceCrossEntropy("sum") if self.kind == "lm" else nn.CrossEntropyLoss(reduction="sum")

    def logits(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The model's logits for a batch's inputs.

        Args:
            x (B, ...) the model's input (token ids (B, T) for "bert" / "gpt2").
        Returns:
            the logits, (B, K) for classification or (B, T, V) for "lm" (``.logits`` of a HF output).
        """
        if self.family == "bert":
            out = model(input_ids=x, attention_mask=(x != self.pad_id).long())
        elif self.family == "gpt2":
            out = model(input_ids=x)
        else:
            out = model(x)
        return out.logits if hasattr(out, "logits") else out

    def loss(self, model: nn.Module, batch, criterion):
        """The loss to call backward on for one batch.

        Args:
            batch (x, y, ...) from the loader; criterion: from :meth:`criterion` (or its ghost-mode
                wrapper).
        Returns:
            the scalar sum of the batch's per-record losses (a ``DPLoss`` in ghost mode); for "lm" the
                targets are x shifted by one token (:meth:`next_token_targets`: padding is no target), a
                record's loss the mean over its real targets.
        """
        x, y = batch[0], batch[1]
        logits = self.logits(model, x)
        if self.kind == "lm":
            return criterion(logits[:, :-1], self.next_token_targets(x))
        return criterion(logits, y)

    def next_token_targets(self, x: torch.Tensor) -> torch.Tensor:
        """The next-token targets of a batch of token ids, padding excluded.

        Args:
            x (B, T) int64 token ids, each record padded on the right with ``pad_id``.
        Returns:
            (B, T - 1) int64: ``x[:, 1:]``, with ``IGNORE_INDEX`` where the target lies in the record's
            trailing run of ``pad_id`` (row by row: a record's targets depend on that record only).
        """
        # position t is real iff the record has a token other than pad_id at t or after it
        real = (x != self.pad_id).flip(1).cumsum(1).flip(1) > 0
        return x[:, 1:].masked_fill(~real[:, 1:], IGNORE_INDEX)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, dataset, batch_size: int = 512) -> dict:
        """Evaluate the model on a dataset, in eval mode.

        Args:
            dataset: map-style, yielding (x, y); batch_size: rows per forward.
        Returns:
            {"accuracy" in [0, 1], "loss"} (classification), loss the mean per-record loss in nats; or
                {"loss", "perplexity"} (lm), loss the mean next-token loss in nats over all the real
                (non-padding) targets of the dataset — token-weighted: total loss / number of real targets,
                so a long record counts more than a short one — and perplexity = exp(loss). The model's
                train / eval mode is restored afterwards.
        Raises:
            TypeError for a dataset that is not map-style; ValueError for an empty one (no accuracy to
            report), for "lm" one without a real target (every record at most one token before its
            padding: no perplexity to report), or a batch_size that is not an int ≥ 1.
        """
        if map_style_length(dataset) == 0:
            raise ValueError("dataset is empty: there is nothing to evaluate")
        check_int("batch_size", batch_size, 1)
        was_training = model.training
        model.eval()
        total, correct, loss_sum = 0, 0, 0.0     # total: records, or real next-token targets for "lm"
        criterion = self.criterion()
        device = model_device(model)
        try:
            for x, y in DataLoader(dataset, batch_size=batch_size, pin_memory=device.type == "cuda"):
                x, y = to_device(x, device), to_device(y, device)
                logits = self.logits(model, x)
                if self.kind == "lm":
                    targets = self.next_token_targets(x)
                    loss_sum += float(nn.functional.cross_entropy(
                        logits[:, :-1].reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), reduction="sum",
                        ignore_index=IGNORE_INDEX))
                    total += int((targets != IGNORE_INDEX).sum())
                else:
                    loss_sum += float(criterion(logits, y))
                    correct += int((logits.argmax(-1) == y).sum())
                    total += x.shape[0]
        finally:
            model.train(was_training)
        if total == 0:   # only "lm": records there are
            raise ValueError(f"no record of the dataset has a next-token target: each is at most one token before "
                             f"its padding (pad_id {self.pad_id}), so there is no perplexity to report")
        mean = loss_sum / total
        if self.kind == "lm":
            return {"loss": mean, "perplexity": math.exp(min(mean, 50.0))}
        return {"accuracy": correct / total, "loss": mean}


def _task_or_default(task) -> Task:
    if task is None:
        return Task()
    if not isinstance(task, Task):
        raise TypeError(f"task must be a pdpfast.loop.Task (e.g. Task('lm', 'gpt2')) or None, got "
                        f"{type(task).__name__} {task!r}")
    return task


def evaluate(model, dataset, task: Task | None = None) -> dict:
    """Evaluate ``model`` on ``dataset`` (see :meth:`Task.evaluate`).

    Args:
        model: the model; dataset: map-style, yielding (x, y); task: a ``Task``, default classification.
    Returns:
        {"accuracy", "loss"} (classification), loss in nats per record, or {"loss", "perplexity"} (lm), loss
        in nats per real (non-padding) next-token target.
    Raises:
        TypeError for a task that is not a ``Task``; otherwise as :meth:`Task.evaluate`.
    """
    return _task_or_default(task).evaluate(model, dataset)


# ---------------------------------------------------------------------------------------------- engine
class PrivateRun(NamedTuple):
    """What :func:`private_engine` returns; unpacks as (engine, model, optimizer, loader, criterion)."""

    engine: Any            # the PrivacyEngine, holding the plan and the per-record ledger
    model: nn.Module
    optimizer: Any         # the DPOptimizer
    loader: Any            # the Poisson DPDataLoader
    criterion: Any         # the loss module to call on (logits, targets)


def private_engine(method: str, model: nn.Module, optimizer, dataset, budgets, *, delta: float, steps: int,
                   sample_rate: float, batch_size: int, task: Task | None = None, max_grad_norm: float = 1.0,
                   clipping: str = "flat", mode: str = "bk", seed: int | None = None,
                   hybrid_weight: float | None = None, accountant: str = "rdp", physical_batch_size: int | None = None):
    """Make ``model`` private for a method: IDP with the records' own budgets ("sample", "scale",
    "hybrid") or "dpsgd" (every record at min ε_i, the uniform plan of DP-SGD).

    The engine's ledger holds the budgets the plan was made for; for "dpsgd" that is min ε_i for
    everyone, so ``engine.epsilons()`` is what DP-SGD spends of each record's own budget.

    Args:
        method: "sample" | "scale" | "hybrid" | "dpsgd" (PDP-SGD: :mod:`pdpfast.pdp_sgd`).
        model, optimizer: the model (converted in place) and a torch optimizer over its parameters.
        dataset: map-style, N records yielding (x, y). budgets: (N,) ε_i > 0.
        delta: δ in (0, 1). steps: optimizer steps T of the plan. sample_rate: mean Poisson rate q in
            (0, 1]. batch_size: of the loader the engine replaces (sets nothing else).
        task: a ``Task``, how a batch becomes a loss (default classification). max_grad_norm: reference clip
            bound C > 0. clipping, mode, hybrid_weight, accountant, physical_batch_size: as in
            ``PrivacyEngine.make_private_with_budgets``. seed: of the draws and the noise (None: a secret
            one from ``os.urandom``; a given one lets anyone who knows it recompute them).
    Returns:
        :class:`PrivateRun` (engine, model, optimizer, loader, criterion): criterion is the task's
        summed loss, wrapped for its two backward passes in ghost mode.
    """
    if method not in ("sample", "scale", "hybrid", "dpsgd"):
        raise ValueError(f"method must be one of sample, scale, hybrid, dpsgd (pdp: pdpfast.pdp_sgd), got {method!r}")
    task = _task_or_default(task)
    import pdpfast

    budgets = np.asarray(budgets, dtype=np.float64)
    plan_budgets = np.full_like(budgets, budgets.min()) if method == "dpsgd" else budgets
    criterion = task.criterion()
    engine = pdpfast.PrivacyEngine(seed=seed)
    made = engine.make_private_with_budgets(
        module=model, optimizer=optimizer,
        data_loader=DataLoader(dataset, batch_size=batch_size, pin_memory=pin_memory_for(model)),
        budgets=plan_budgets, delta=delta, steps=steps, method="sample" if method == "dpsgd" else method,
        sample_rate=sample_rate, max_grad_norm=max_grad_norm, hybrid_weight=hybrid_weight, accountant=accountant,
        clipping=clipping, mode=mode, loss_reduction="sum", physical_batch_size=physical_batch_size,
        criterion=criterion if mode == "ghost" else None)
    # ghost mode wraps the loss (its two backward passes); otherwise the task's own loss is used as it is
    return PrivateRun(engine, made.module, made.optimizer, made.data_loader,
                      made.criterion if mode == "ghost" else criterion)


def private_steps(engine, model: nn.Module, optimizer, loader, task: Task, criterion, *, until: int,
                  on_step=None, cuda_graph: bool = False, autocast: torch.dtype | None = None) -> None:
    """Train until ``engine.steps == until``: the user's ordinary loop over the Poisson loader
    (forward, backward, ``optimizer.step()``, ``zero_grad()``), for as many passes as it takes.
    Batches are moved to the model's device (non-blocking from pinned memory). An empty draw runs no
    forward (some models, a Hugging Face BERT's attention, cannot take zero rows): its step, noise only,
    is the same bit for bit.

    Args:
        engine: the ``PrivacyEngine`` (its ``steps`` count the optimizer steps taken).
        model, optimizer, loader: what ``make_private`` returned. task: turns a batch into a loss;
            criterion: the loss module it calls (a ``DPCriterion`` in ghost mode).
        until: the engine step to stop at (a resumed run takes only the steps that remain).
        on_step: ``on_step(step, loss)`` after every optimizer step: step = engine.steps, loss = the
            criterion's value on the draw's last physical batch divided by its rows (the mean
            per-record loss for a summed loss; 0 for an empty draw). Returning True stops early.
        cuda_graph: run each physical batch through ``engine.make_step`` (the step captured in CUDA
            graphs and replayed; needs a physical batch size and a CUDA model) instead of the
            ordinary loop. The same steps, the same noise.
        autocast: None, or the dtype the forward (and so the backward) runs in under
            ``torch.autocast`` (``torch.bfloat16``); the weights, norms and clip weights stay fp32.
    Returns:
        None; the model and the engine's ledger have advanced.
    Raises:
        TypeError for a task without a ``loss`` method, an ``on_step`` that is not callable or an autocast
        that is not a dtype; ValueError for an ``until`` that is not a positive integer or is past the
        engine's plan, an autocast dtype other than bfloat16 / float16, or a loader that yields no batch
        (it would loop for ever). When the engine refuses a step (``PrivacyBudgetExceeded``), the draw is
        discarded (``zero_grad``) before the error propagates, so the next draw does not meet an open batch.
        FloatingPointError for a record whose gradient is not finite (on a GPU read at a later step, or
        at the end: ``ClippingState.check_finite``).
    """
    from .engine import PrivacyBudgetExceeded  # loaded already: the engine made the loader

    if not callable(getattr(task, "loss", None)):
        raise TypeError(f"task must be a pdpfast.loop.Task (or have its loss(model, batch, criterion)), got "
                        f"{type(task).__name__} {task!r}")
    until = check_positive_integer("until", until)
    plan = getattr(engine, "plan", None)
    if plan is not None and until > plan.steps:
        raise ValueError(f"until ({until}) is past the plan's {plan.steps} steps: a step beyond them would spend "
                         "more than the records' budgets")
    if on_step is not None and not callable(on_step):
        raise TypeError(f"on_step must be callable (step, loss) or None, got {type(on_step).__name__}")
    if autocast is not None:
        if not isinstance(autocast, torch.dtype):
            raise TypeError(f"autocast must be None or a torch dtype (torch.bfloat16), got {type(autocast).__name__} "
                            f"{autocast!r}")
        if autocast not in (torch.bfloat16, torch.float16):
            raise ValueError(f"autocast must be torch.bfloat16 or torch.float16 (what torch.autocast runs in), got "
                             f"{autocast}")
    model.train()
    device = model_device(model)

    def loss_of(batch):
        if autocast is None:
            return task.loss(model, batch, criterion)
        with torch.autocast(device.type, dtype=autocast):
            return task.loss(model, batch, criterion)

    step = engine.make_step(lambda *batch: loss_of(batch), cuda_graph=True) if cuda_graph else None
    while engine.steps < until:
        yielded = False
        for batch in loader:
            yielded, before, rows = True, engine.steps, int(batch[0].shape[0])
            try:
                if step is not None:  # copies the batch into the graph's inputs itself
                    loss = step(*batch)
                else:
                    # an empty draw: nothing to clip, the step adds noise only. No forward either: a Hugging
                    # Face attention cannot reshape zero rows
                    loss = None
                    if rows:
                        if device.type != "cpu":
                            batch = to_device(batch, device)
                        loss = loss_of(batch)
                        loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
            except PrivacyBudgetExceeded:
                optimizer.zero_grad()  # the refused draw's clipped sums go, and its batch closes
                raise
            if engine.steps != before:
                mean = 0.0 if loss is None else float(loss.detach()) / max(rows, 1)
                stop = on_step(engine.steps, mean) if on_step is not None else False
                if stop or engine.steps >= until:
                    state = getattr(engine, "state", None)
                    if state is not None:
                        state.check_finite(wait=True)  # a GPU's last norms, read before the run ends
                    return
        if not yielded:
            raise ValueError(f"loader yielded no batch at step {engine.steps} of {until}: pass the Poisson loader "
                             "make_private returned")
