"""The ``pdpfast train`` job: data + model + method → a private training run with a per-record
ledger, checkpoints and resume (:func:`run`, from a :class:`TrainConfig`), and the per-group report
of ε spent (:func:`group_report`).

The training loop it runs is :mod:`pdpfast.loop`'s (``Task``, ``private_engine``,
``private_steps``), shared with the demos, PDP-SGD and the federated clients; those names are also
importable from here, where they used to live.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import os
import signal
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from . import launch
from ._checks import (
    LargeDeltaWarning,
    check_choice,
    check_delta,
    check_in_range,
    check_int,
    check_nonnegative,
    check_positive,
    check_positive_integer,
    is_cpu_rng_state,
    large_delta_message,
)
from ._io import atomic_write
from ._malloc import retain_unless_configured
from .accounting.calibration.problem import DEFAULT_HYBRID_WEIGHT
from .distributed import DistributedContext, inner_module, leave_process_group
from .launch import launched_rank
from .loop import SequenceCrossEntropy, Task, evaluate, model_device, private_engine, private_steps, to_device

__all__ = ["METHODS", "SequenceCrossEntropy", "Task", "TrainConfig", "TrainingInterrupted", "evaluate", "group_report",
           "format_groups", "model_device", "private_engine", "private_steps", "resolve_device", "run", "to_device",
           "under_spending_groups"]

METHODS = ("sample", "scale", "hybrid", "dpsgd", "pdp")
# --precision: the dtype the forward and backward run in under torch.autocast (None: fp32 throughout)
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}
DEFAULT_HIDDEN = "128"      # --hidden of the mlp
DEFAULT_MOMENTUM = 0.9      # --momentum of SGD


# ---------------------------------------------------------------------------------------------- devices
def resolve_device(name: str | None) -> torch.device:
    """The device ``--device name`` asks for.

    Args:
        name: "cpu", "cuda", "cuda:N", or None (CUDA when present, else the CPU).
    Returns:
        the torch device.
    Raises:
        ValueError naming the option, for a device that is not a cpu / cuda[:N] name or is not here.
    """
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise ValueError(f"--device {name}: not a device; use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch is built without CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise ValueError(f"--device {name}: CUDA is not available ({why}); use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: there are {torch.cuda.device_count()} CUDA device(s), "
                             f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    elif device.type != "cpu":
        raise ValueError(f"--device {name}: pdpfast train runs on cpu or cuda[:N], not {device.type}")
    return device


# ---------------------------------------------------------------------------------------------- reports
def group_report(budgets: np.ndarray, spent: np.ndarray, max_groups: int = 12) -> list[dict]:
    """ε spent per budget group: one group per distinct budget (≤ max_groups of them), else
    budget quantile bins.

    Args:
        budgets: (N,) ε_i > 0. spent: (N,) ε each record has spent (same δ). max_groups: the most
            groups before quantile bins are used.
    Returns:
        one row per group: {"budget": label, "low", "high", "records", "max_spent", "mean_spent",
        "max_ratio"} with max_ratio = max_i spent_i / ε_i (≤ 1 means within budget).
    """
    budgets, spent = np.asarray(budgets, dtype=np.float64), np.asarray(spent, dtype=np.float64)
    values = np.unique(budgets)
    if values.shape[0] <= max_groups:
        bins = [(v, v, budgets == v) for v in values]
    else:
        edges = np.unique(np.quantile(budgets, np.linspace(0, 1, max_groups + 1)))
        which = np.clip(np.searchsorted(edges, budgets, side="right") - 1, 0, len(edges) - 2)
        bins = [(budgets[which == k].min(), budgets[which == k].max(), which == k)
                for k in range(len(edges) - 1) if (which == k).any()]
    rows = []
    for low, high, sel in bins:
        label = f"{low:.4g}" if low == high else f"{low:.4g}–{high:.4g}"
        rows.append({"budget": label, "low": float(low), "high": float(high), "records": int(sel.sum()),
                     "max_spent": float(spent[sel].max()), "mean_spent": float(spent[sel].mean()),
                     "max_ratio": float((spent[sel] / budgets[sel]).max())})
    return rows


def format_groups(rows: list[dict], title: str = "ε spent per budget group") -> str:
    """The rows of :func:`group_report` as a text table.

    Args:
        rows from :func:`group_report`; title: the first line.
    Returns:
        the table as text.
    """
    lines = [title, f"  {'budget ε':>14} {'records':>8} {'max spent':>10} {'mean spent':>11} {'max spent/ε':>12}"]
    for r in rows:
        lines.append(f"  {r['budget']:>14} {r['records']:>8d} {r['max_spent']:>10.4f} {r['mean_spent']:>11.4f} "
                     f"{r['max_ratio']:>12.4f}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- the job
@dataclass
class TrainConfig:
    """Everything ``pdpfast train`` takes (see ``pdpfast train --help``)."""

    data: str | None = None
    labels: str | None = None
    hf_dataset: str | None = None
    hf_split: str | None = None
    hf_config: str | None = None
    label_column: str | None = None
    budget_column: str | None = None
    budgets: str | None = None
    epsilon: float | None = None
    text_column: str | None = None
    tokens: bool = False
    tokenizer: str | None = None
    max_length: int | None = None      # tokens per text (64 when None); read with text only
    image_shape: str | None = None
    image_size: int = 32
    test_fraction: float = 0.2
    model: str = "mlp"
    hidden: str | None = None          # mlp hidden widths ("128" when None); read by the mlp only
    method: str = "sample"
    clipping: str = "flat"
    mode: str = "bk"
    epochs: int = 5
    batch_size: int = 64
    lr: float = 0.1
    momentum: float | None = None      # SGD's momentum (0.9 when None); Adam takes none
    optimizer: str = "sgd"
    max_grad_norm: float = 1.0
    delta: float = 1e-5
    hybrid_weight: float | None = None
    accountant: str = "rdp"
    physical_batch_size: int | None = None
    cuda_graph: bool = False
    precision: str = "fp32"
    rounds: int = 2
    pdp_loss: str = "fixed"
    pdp_charge: str = "all"
    seed: int = 0
    noise_seed: int | None = None
    device: str | None = None
    checkpoint: str | None = None
    checkpoint_every: int = 0
    resume: str | None = None
    overwrite: bool = False
    stop_after_steps: int | None = None
    threads: int | None = None
    quiet: bool = False
    out_json: str | None = None
    save_model: str | None = None      # the model's weights alone (a state_dict): what may be published
    nproc: int = 1
    log: object = field(default=None, repr=False)


class TrainingInterrupted(Exception):
    """Training stopped on SIGINT (Ctrl-C) or SIGTERM after a whole step; the final checkpoint, if
    any, holds every step taken. ``signum``: the signal (exit status 128 + signum by convention)."""

    def __init__(self, signum: int, step: int, total_steps: int, checkpoint: str | None):
        self.signum, self.step, self.total_steps, self.checkpoint = int(signum), step, total_steps, checkpoint
        saved = (f"checkpoint {checkpoint!r} holds every step taken: continue with --resume {checkpoint}"
                 if checkpoint else "nothing saved (no --checkpoint)")
        super().__init__(f"interrupted ({signal.Signals(signum).name}) after step {step} of {total_steps}; {saved}")


class _StopOnSignal:
    """SIGINT and SIGTERM while training ask it to stop after the step in progress, so the final
    checkpoint is consistent: model, optimizer, ledger and the loader's next draw all after the
    same step (a step cut in the middle has advanced the loader but not the ledger). A second
    signal stops at once (KeyboardInterrupt) and saves nothing more: the last checkpoint stays.
    A second one within ``launch.SAME_STOP_S`` of the first is the same request (a scheduler that signals
    every process of a job reaches each rank of ``--nproc`` directly and again through the
    command), and one that comes while a checkpoint is written (``saving``) waits for the write.
    Handlers can only be set from the main thread; elsewhere the signals keep their handlers."""

    def __init__(self):
        self.received: int | None = None
        self._saving = False
        self._interrupt_after_save = False
        self._previous: dict = {}

    def __enter__(self) -> _StopOnSignal:
        launch.forget_stops()
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            self.received = signum
            launch.note_stop()      # (a copy of it after the steps end is this request too: ``cli._CtrlC``)
        elif not launch.same_stop():
            if not self._saving:
                raise KeyboardInterrupt
            self._interrupt_after_save = True

    @contextlib.contextmanager
    def saving(self):
        """A block (a checkpoint's write) that a second signal does not cut: it stops right after."""
        self._saving = True
        try:
            yield
        finally:
            self._saving = False
            if self._interrupt_after_save:
                raise KeyboardInterrupt

    def __exit__(self, *exc) -> bool:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        return False


def _option(name: str) -> str:
    """The CLI option of a ``TrainConfig`` field, as messages name it: max_grad_norm → --max-grad-norm."""
    return "--" + name.replace("_", "-")


def _check_config(cfg: TrainConfig) -> None:
    from .models import model_names, model_spec

    if cfg.method not in METHODS:
        raise ValueError(f"unknown method {cfg.method!r}; choose from {', '.join(METHODS)}")
    if cfg.model not in model_names():
        raise ValueError(f"unknown model {cfg.model!r}; choose from {', '.join(model_names())}")
    for name in ("epochs", "batch_size", "rounds", "image_size"):
        check_positive_integer(_option(name), getattr(cfg, name))
    for name in ("physical_batch_size", "threads", "stop_after_steps", "max_length"):
        if getattr(cfg, name) is not None:
            check_positive_integer(_option(name), getattr(cfg, name))
    for name in ("lr", "max_grad_norm"):
        check_positive(_option(name), getattr(cfg, name))
    if cfg.momentum is not None:
        check_nonnegative("--momentum", cfg.momentum)
    check_delta("--delta", cfg.delta)
    if cfg.hybrid_weight is not None and cfg.method != "hybrid":
        raise ValueError(f"--hybrid-weight is for --method hybrid (this is --method {cfg.method}): "
                         f"hybrid_weight={cfg.hybrid_weight!r} would be ignored")
    if cfg.epsilon is not None:  # ε = inf would promise no privacy at all
        check_positive("--epsilon", cfg.epsilon)
    check_in_range("--test-fraction", cfg.test_fraction, low=0.0, high=1.0, low_open=False, high_open=True)
    check_int("--seed", cfg.seed, 0)
    if cfg.noise_seed is not None:
        check_int("--noise-seed", cfg.noise_seed, 0)
    if cfg.clipping == "per_layer" and cfg.mode == "ghost":     # (the engine says so too, in its argument names)
        raise ValueError("--clipping per_layer clips inside one backward; --mode ghost does not apply to it (use "
                         "--mode bk, the default)")
    # an option this run would not read is refused, not ignored
    unread = {"--momentum": (cfg.momentum, cfg.optimizer != "adam", "--optimizer sgd (Adam keeps its own moments)"),
              "--hidden": (cfg.hidden, cfg.model == "mlp", "--model mlp"),
              "--image-shape": (cfg.image_shape, cfg.model != "mlp",
                                "image models (--model mlp flattens its input whatever its shape)"),
              "--accountant": (None if cfg.accountant == "rdp" else cfg.accountant, cfg.method != "pdp",
                               "--method sample/scale/hybrid/dpsgd (PDP-SGD's rounds are accounted with RDP)")}
    for option, (value, read, where) in unread.items():
        if value is not None and not read:
            raise ValueError(f"{option} is for {where}; it would be ignored here")
    if cfg.model == "mlp":
        _hidden_widths(cfg)
    if cfg.image_shape:
        _image_shape(cfg)
    if (cfg.labels or cfg.label_column) and model_spec(cfg.model).task == "lm":
        given = "--labels" if cfg.labels else "--label-column"
        raise ValueError(f"{given}: --model {cfg.model} is a language model (next-token loss on the token ids) and "
                         "reads no labels")
    check_int("--checkpoint-every", cfg.checkpoint_every, 0)
    if cfg.checkpoint_every and not (cfg.checkpoint or cfg.resume):
        raise ValueError("--checkpoint-every needs --checkpoint PATH")
    check_choice("--optimizer", cfg.optimizer, ("sgd", "adam"))
    check_choice("--precision", cfg.precision, PRECISIONS)
    if cfg.precision != "fp32" and cfg.method == "pdp":
        raise ValueError("--precision bf16 is offered for --method sample/scale/hybrid/dpsgd (PDP-SGD's rounds train "
                         "in fp32)")
    if cfg.method == "pdp" and _processes(cfg) > 1:
        raise ValueError("--method pdp does not run data parallel (its rounds retrain on subsets); use one process "
                         "(--nproc 1)")
    if cfg.cuda_graph:
        if cfg.physical_batch_size is None:
            raise ValueError("--cuda-graph needs --physical-batch-size K: a captured step replays fixed shapes, and "
                             "Poisson draws are padded to physical batches of K rows")
        if cfg.mode == "ghost":
            raise ValueError("--cuda-graph captures one backward; --mode ghost needs two (use bk, the default)")
        if cfg.method == "pdp" or _processes(cfg) > 1:
            raise ValueError("--cuda-graph is offered for --method sample/scale/hybrid/dpsgd in one process")
        device = resolve_device(cfg.device)
        if device.type != "cuda":
            raise ValueError(f"--cuda-graph needs a CUDA device (--device cuda); this run is on {device.type}")


def _env_world_size() -> int:
    """WORLD_SIZE in the environment (set by a launcher: ``pdpfast.launch``, torchrun), 1 when unset or empty."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def _processes(cfg: TrainConfig) -> int:
    """The run's number of processes: ``--nproc``, or WORLD_SIZE under a launcher of the user's own."""
    return max(cfg.nproc, _env_world_size())


def check_data_parallel(cfg: TrainConfig) -> None:
    """The settings of a ``--nproc`` run, checked once by the command before it starts the ranks
    (``pdpfast.launch``): what every rank would refuse alike, refused in one line and no process.

    Args:
        cfg: the command's settings, with ``nproc`` > 1.
    Returns:
        None.
    Raises:
        ValueError as ``run`` would (settings, output paths; the data is each rank's to read, and an
        error in it one line all the same: ``pdpfast.launch``), and for a method or device the ranks
        cannot share: ``--method pdp``; ``--device cuda:N`` (each rank takes the GPU of its rank);
        fewer GPUs than processes.
    """
    _check_config(cfg)
    _check_outputs(cfg)
    device = resolve_device(cfg.device)
    if device.type == "cuda":
        if device.index is not None:
            raise ValueError(f"--device {cfg.device}: with --nproc each process takes the GPU of its rank (cuda:0 "
                             f"to cuda:{cfg.nproc - 1}); give --device cuda")
        if torch.cuda.device_count() < cfg.nproc:
            raise ValueError(f"--nproc {cfg.nproc} on --device cuda takes one GPU per process; "
                             f"{torch.cuda.device_count()} are visible")


def _hidden_widths(cfg: TrainConfig) -> list[int]:
    try:
        widths = [int(h) for h in str(cfg.hidden or DEFAULT_HIDDEN).split(",") if h.strip()]
    except ValueError:
        widths = None
    if widths is None or any(w <= 0 for w in widths):
        raise ValueError(f"--hidden must be comma-separated positive layer widths (e.g. 128 or 256,64), "
                         f"got {cfg.hidden!r}")
    return widths


def _image_shape(cfg: TrainConfig) -> tuple[int, int, int]:
    try:
        shape = tuple(int(s) for s in str(cfg.image_shape).split(","))
    except ValueError:
        shape = ()
    if len(shape) != 3 or min(shape) < 1:
        raise ValueError(f"--image-shape must be three positive ints C,H,W (e.g. 1,8,8), got {cfg.image_shape!r}")
    return shape


def _check_outputs(cfg: TrainConfig) -> None:
    """Every path the run will write, checked before any work: not a directory, under a writable
    directory, no two outputs on one path, and no existing checkpoint (a run and its privacy
    ledger) replaced unless it is the one being resumed or --overwrite says so."""
    from ._io import check_output_path, check_outputs_spare_inputs

    if cfg.overwrite and not cfg.checkpoint:
        raise ValueError("--overwrite replaces an existing --checkpoint; no --checkpoint is given")
    written = {}
    if cfg.resume:
        if os.path.isdir(cfg.resume):
            raise ValueError(f"--resume {cfg.resume!r} is a directory; give the checkpoint file")
        if not os.path.isfile(cfg.resume):
            raise FileNotFoundError(f"--resume {cfg.resume!r}: checkpoint does not exist")
        if not cfg.checkpoint:
            written["--resume"] = check_output_path(cfg.resume, "--resume")   # continued in place
    if cfg.checkpoint:
        written["--checkpoint"] = check_output_path(cfg.checkpoint, "--checkpoint")
    if cfg.out_json:
        written["--out-json"] = check_output_path(cfg.out_json, "--out-json")
    if cfg.save_model:
        written["--save-model"] = check_output_path(cfg.save_model, "--save-model")
    if len(set(written.values())) < len(written):
        raise ValueError(f"{' and '.join(written)} name the same file; give each output its own path")
    check_outputs_spare_inputs({k: v for k, v in written.items() if k != "--resume"},
                               {"--data": cfg.data, "--labels": cfg.labels, "--budgets": cfg.budgets})
    if cfg.overwrite and cfg.resume and os.path.exists(cfg.checkpoint) and os.path.samefile(cfg.resume, cfg.checkpoint):
        raise ValueError("--overwrite with --resume of the same checkpoint would be ignored: the run continues it. "
                         "Drop --resume to start afresh over it, or --overwrite to continue it")
    if cfg.checkpoint and os.path.exists(cfg.checkpoint) and not cfg.overwrite:
        if not cfg.resume:
            raise ValueError(f"--checkpoint {cfg.checkpoint!r} already exists (a run and its privacy ledger); "
                             f"continue it with --resume {cfg.checkpoint}, or start afresh over it with --overwrite")
        if not os.path.samefile(cfg.resume, cfg.checkpoint):
            raise ValueError(f"--checkpoint {cfg.checkpoint!r} already exists and is not the --resume checkpoint; "
                             "give a new path, or replace it with --overwrite")


def _warn(text: str) -> None:
    if _speaks():
        print(f"pdpfast train: warning: {text}", file=sys.stderr)


def _digest(array) -> str:
    array = np.ascontiguousarray(array)
    head = f"{array.dtype.str}{array.shape}".encode()
    return hashlib.sha256(head + array.tobytes()).hexdigest()


def _fingerprint(budgets: np.ndarray, data) -> dict:
    """What a checkpoint's spent budget belongs to: the training records (features and labels, by
    hash), their budgets and shapes. A resumed run must match it exactly."""
    return {"records": len(data), "input_shape": list(data.input_shape), "kind": data.kind,
            "features_sha256": _digest(data.features.numpy()), "labels_sha256": _digest(data.labels.numpy()),
            "budgets_sha256": _digest(np.asarray(budgets, dtype=np.float64))}


def _speaks() -> bool:
    """Whether this process reports: in a torchrun job of several processes (``--nproc``; the same
    test of WORLD_SIZE as ``_start_distributed``) only rank 0 does."""
    return _env_world_size() <= 1 or os.environ.get("RANK", "0") == "0"


def _say(cfg: TrainConfig, text: str) -> None:
    if _speaks():
        print(text, file=cfg.log or sys.stdout)


def load_training_data(cfg: TrainConfig):
    """Load the data ``cfg`` names and split off the test set.

    Args:
        cfg: the data options (data / labels / hf_dataset / budget_column / budgets / epsilon /
            text and image settings, test_fraction, seed).
    Returns:
        (train, test or None, budgets): ``TrainData`` splits and the (N_train,) float64 ε_i.
    """
    from .datasets import load_data, train_test_split
    from .models import model_spec

    spec = model_spec(cfg.model)
    # without a named tokenizer, text is hashed into the model's own vocabulary
    tokenizer = cfg.tokenizer or spec.vocab_size
    data = load_data(cfg.data, labels=cfg.labels, hf_dataset=cfg.hf_dataset, label_column=cfg.label_column,
                     budget_column=cfg.budget_column, budgets=cfg.budgets, text_column=cfg.text_column,
                     tokens=cfg.tokens or "tokens" in spec.inputs, tokenizer=tokenizer,
                     max_length=cfg.max_length, image_size=cfg.image_size, hf_split=cfg.hf_split,
                     hf_config=cfg.hf_config, lm=spec.task == "lm")
    if cfg.image_shape:
        data = data.as_images(_image_shape(cfg))
    if data.budgets is None:
        if cfg.epsilon is None:
            raise ValueError("no budgets: give --budget-column (CSV), --budgets FILE, or --epsilon E (the same ε for "
                             "every record)")
        data.budgets = np.full(len(data), float(cfg.epsilon))
    elif cfg.epsilon is not None:
        raise ValueError("--epsilon and per-record budgets given together; use one")
    train, test = train_test_split(data, cfg.test_fraction, cfg.seed)
    return train, test, train.budgets


def _build(cfg: TrainConfig, train):
    from .models import build_model, model_spec

    spec = model_spec(cfg.model)
    if spec.task == "classification" and train.num_classes < 2:
        raise ValueError(f"model {cfg.model!r} classifies, but the data have {train.num_classes} class; "
                         "name the label column (--label-column) or labels file (--labels)")
    if spec.task == "lm" and train.num_classes > 1:
        _warn(f"--model {cfg.model} is a language model (next-token loss on the token ids): the data's "
              f"{train.num_classes} label classes are not read")
    options = {"hidden": _hidden_widths(cfg)} if cfg.model == "mlp" else {}
    model_config = {"name": cfg.model, "input_shape": list(train.input_shape), "num_classes": train.num_classes,
                    "vocab_size": train.vocab_size, "input_kind": train.kind, "options": options}
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, input_shape=train.input_shape, num_classes=train.num_classes,
                        vocab_size=train.vocab_size, input_kind=train.kind, **options)
    return model, model_config


def _optimizer(cfg: TrainConfig, model):
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.optimizer == "adam":
        # a captured step (--cuda-graph) keeps Adam's step count on the GPU
        return torch.optim.Adam(params, lr=cfg.lr, capturable=cfg.cuda_graph)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=_momentum(cfg))


def _momentum(cfg: TrainConfig) -> float:
    return DEFAULT_MOMENTUM if cfg.momentum is None else cfg.momentum


def _load_checkpoint_file(path):
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:      # a truncated or foreign file
        raise ValueError(f"--resume {path!r} cannot be read as a checkpoint: {type(exc).__name__}: {exc}") from None


# the settings a resumed run must share with its checkpoint (the plan, the schedule, the optimizer state)
_RESUME_SETTINGS = ("method", "model", "delta", "epochs", "batch_size", "max_grad_norm", "clipping", "mode", "seed",
                    "noise_seed", "hybrid_weight", "accountant", "rounds", "pdp_loss", "pdp_charge", "test_fraction",
                    "optimizer")


# the settings a resumed run may change that change what its steps release: a continuation with other
# values must not add the checkpoint's noise (see _continuation_changes)
_CONTINUATION_SETTINGS = ("lr", "momentum", "precision")


def _continuation_changes(saved: dict, cfg: TrainConfig) -> list[str]:
    """The settings of ``_CONTINUATION_SETTINGS`` this run changes from the checkpoint's (``saved``:
    its train_args), as "--lr 0.1 → 0.05". A continuation with them would draw the checkpoint's noise
    (from its seed and the step), as does another continuation of the same checkpoint (the run that
    wrote it going on, or one with other values): the two releases' difference would be noise-free."""
    changes = []
    for key in _CONTINUATION_SETTINGS:
        before, now = saved.get(key), getattr(cfg, key)
        if key == "momentum" and cfg.optimizer == "sgd":
            before, now = (DEFAULT_MOMENTUM if v is None else v for v in (before, now))
        if before != now:
            changes.append(f"--{key} {before!r} → {now!r}")
    return changes


def _check_resume(checkpoint: dict, cfg: TrainConfig, fingerprint: dict, model_config: dict) -> None:
    extra = checkpoint.get("extra") if isinstance(checkpoint, dict) else None
    # a foreign or damaged file fails here, not on a TypeError deep inside the comparisons below
    if not (isinstance(extra, dict) and isinstance(extra.get("train_args"), dict)
            and isinstance(extra.get("data", {}), (dict, type(None)))
            and isinstance(extra.get("model_config", {}), dict)):
        raise ValueError(f"{cfg.resume!r} is not a `pdpfast train` checkpoint")
    saved = dict(extra["train_args"])
    saved["hybrid_weight"] = _hybrid_weight(saved.get("method"), saved.get("hybrid_weight"))
    for key in _RESUME_SETTINGS:
        now = _hybrid_weight(cfg.method, cfg.hybrid_weight) if key == "hybrid_weight" else getattr(cfg, key)
        if saved.get(key) != now:
            raise ValueError(f"the checkpoint was made with --{key.replace('_', '-')} {saved.get(key)!r}, not "
                             f"{now!r}; resume with the same settings")
    state = "pdp" if cfg.method == "pdp" else "engine"     # (PDP-SGD's state is in extra)
    damaged = [key for key in ("model", state)
               if not isinstance((extra if key == "pdp" else checkpoint).get(key), dict)]
    if extra.get("torch_rng") is not None and not is_cpu_rng_state(extra["torch_rng"]):
        damaged.append("torch_rng")
    if damaged:
        raise ValueError(f"the checkpoint {cfg.resume!r} is damaged: its {' and '.join(damaged)} "
                         f"{'is' if len(damaged) == 1 else 'are'} not what `pdpfast train` writes; resume from "
                         "another checkpoint, or start afresh (--overwrite)")
    data = extra.get("data") or {}
    if "features_sha256" not in data:
        raise ValueError(f"the checkpoint {cfg.resume!r} predates fingerprints of the features and labels, so it "
                         "cannot be checked against these data; start a fresh run instead (without --resume; "
                         "--overwrite replaces the old checkpoint)")
    for key, what in (("records", f"{data.get('records')} records, not {fingerprint['records']}"),
                      ("input_shape", "records of another shape"), ("kind", "records of another kind"),
                      ("features_sha256", "other features (as many records, other values)"),
                      ("labels_sha256", "other labels"), ("budgets_sha256", "other budgets")):
        if data.get(key) != fingerprint[key]:
            raise ValueError(f"cannot resume {cfg.resume!r}: it was made on {what}; its spent budget belongs to "
                             "those records, so resume with the same data and budgets")
    differences = _model_config_differences(extra.get("model_config") or {}, model_config)
    if differences:
        raise ValueError(f"the checkpoint's model configuration differs from this run's: {differences}; resume "
                         "with the settings it was made with")
    changes = _continuation_changes(saved, cfg)
    if changes and cfg.method == "pdp":
        raise ValueError(f"a PDP-SGD run resumes with the checkpoint's settings ({', '.join(changes)}): its rounds "
                         "draw records and noise from the checkpoint's seed, which another continuation of it "
                         "shares, so their difference would be noise-free. Resume with the same values")


def _model_config_differences(saved: dict, now: dict) -> str:
    """The fields of two model configurations (as :func:`_build` returns) that differ.

    Args:
        saved: the checkpoint's model configuration; now: this run's.
    Returns:
        "--hidden 128 in the checkpoint, 64 in this run, ..." (an option's words where a field has an option:
        the mlp's widths are --hidden), empty when they agree.
    """
    def fields(config):
        flat = {k: v for k, v in config.items() if k != "options"}
        options = config.get("options")
        flat.update(options if isinstance(options, dict) else {"options": options})
        return flat

    saved, now = fields(saved), fields(now)
    words = {"name": "--model", "hidden": "--hidden"}
    shown = {"hidden": lambda widths: ",".join(map(str, widths)) if isinstance(widths, list) else repr(widths)}
    differences = []
    for key in sorted(set(saved) | set(now), key=lambda k: (k not in words, k)):
        if saved.get(key) != now.get(key):
            show = shown.get(key, repr)
            differences.append(f"{words.get(key, key)} {show(saved.get(key))} in the checkpoint, "
                               f"{show(now.get(key))} in this run")
    return ", ".join(differences)


def _hybrid_weight(method, hybrid_weight):
    """λ as the run reads it: the default 0.5 for hybrid when not given, None for the other methods
    (checkpoints before 2026-11-25 saved 0.5 for every method)."""
    if method != "hybrid":
        return None
    return DEFAULT_HYBRID_WEIGHT if hybrid_weight is None else hybrid_weight


def _restore(cfg: TrainConfig, load) -> None:
    """Run ``load()`` (state into model / optimizer / engine), naming the checkpoint when the
    state does not fit (another optimizer's state raises KeyError 'step' deep inside torch)."""
    try:
        load()
    except (KeyError, ValueError, RuntimeError, TypeError) as exc:
        detail = f"{type(exc).__name__}: {exc}" if isinstance(exc, KeyError) else str(exc)
        raise ValueError(f"the state in checkpoint {cfg.resume!r} does not fit this run ({detail}); resume with the "
                         "settings it was made with") from None


def _warn_about_batch_size(cfg: TrainConfig, n: int) -> None:
    if cfg.batch_size > n:
        _warn(f"--batch-size {cfg.batch_size} exceeds the {n} training records: the sampling rate is capped at q = 1 "
              f"(every record in every step, expected batch {n})")


def under_spending_groups(budgets: np.ndarray, guaranteed: np.ndarray, ratio: float = 0.99) -> str:
    """The budget groups (as in :func:`group_report`) that under-spend.

    Args:
        budgets: (N,) ε_i; guaranteed: (N,) the ε the plan guarantees each record; ratio: a group
            under-spends when its largest guaranteed ε / budget is below this.
    Returns:
        "ε=2 (spends ≤ 1.23), ..." for those groups; empty when every group spends its budget.
    """
    short = [r for r in group_report(budgets, guaranteed) if r["max_ratio"] < ratio]
    return ", ".join(f"ε={r['budget']} (spends ≤ {r['max_spent']:.3g})" for r in short)


UNDER_SPENDING_AT_RATE_ONE = ("at q = 1 these budget groups under-spend, as their records cannot be sampled more "
                              "often: {groups}; lower the batch size, or use method scale, which spends them through "
                              "larger clip bounds")


def _warn_about_under_spending(cfg: TrainConfig, plan, budgets: np.ndarray) -> None:
    """With q capped at 1, records whose budget would need a rate above 1 cannot spend it all."""
    if cfg.batch_size < len(budgets) or cfg.method == "dpsgd":
        return
    groups = under_spending_groups(budgets, plan.epsilons())
    if groups:
        _warn(UNDER_SPENDING_AT_RATE_ONE.format(groups=groups))


def run(cfg: TrainConfig) -> dict:
    """The whole ``pdpfast train`` job. Under torchrun (WORLD_SIZE > 1) it is one rank of a
    data-parallel run (``--nproc``).

    Args:
        cfg: the command's settings (see ``pdpfast train --help``).
    Returns:
        the summary (also written to ``cfg.out_json``): method, steps, total_steps, finished,
        seconds (the whole job), train_seconds (its training steps), device, records_per_second
        (steps × expected batch / train_seconds), test metrics, ε per budget group ("groups"), and on a
        CPU cpu_allocator (``pdpfast._malloc.retain_unless_configured``), ...
    Raises:
        ValueError for settings, data or a checkpoint that do not fit; :class:`TrainingInterrupted`
        after SIGINT / SIGTERM (the final checkpoint saved).
    """
    _check_config(cfg)
    if cfg.nproc > 1 and _env_world_size() != cfg.nproc:
        raise ValueError(f"nproc={cfg.nproc}: run() trains in this process; start the processes with the command "
                         f"(`pdpfast train ... --nproc {cfg.nproc}`) or a launcher of your own (torchrun, with "
                         "nproc=1)")
    _check_outputs(cfg)
    device = resolve_device(cfg.device)
    rank, world_size = _start_distributed(cfg, device)
    if world_size > 1:
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        if rank != 0:  # one rank speaks and writes (checkpoints: the engine writes them on rank 0)
            cfg = dataclasses.replace(cfg, quiet=True, out_json=None, save_model=None)
    try:
        return _run(cfg, device, rank, world_size)
    finally:
        if world_size > 1:
            leave_process_group()


def _start_distributed(cfg: TrainConfig, device: torch.device) -> tuple[int, int]:
    """(rank, world size): under torchrun (WORLD_SIZE > 1) the process group is initialized here,
    NCCL on CUDA and gloo on the CPU, with a timeout so that a dead rank stops the others."""
    world_size = _env_world_size()
    if world_size == 1:
        return 0, 1
    import torch.distributed as dist

    if not dist.is_initialized():
        if launched_rank() is None and os.environ.get("RANK", "0") == "0":
            # a job of the user's own (torchrun), or WORLD_SIZE left over from one: say what it waits for
            print(f"pdpfast train: rank 0 of {world_size} (WORLD_SIZE in the environment): waiting up to "
                  f"{DISTRIBUTED_TIMEOUT_S // 60} minutes for the other ranks at {os.environ.get('MASTER_ADDR')}:"
                  f"{os.environ.get('MASTER_PORT')}", file=sys.stderr, flush=True)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                timeout=datetime.timedelta(seconds=DISTRIBUTED_TIMEOUT_S))
    return dist.get_rank(), dist.get_world_size()


# a rank that has not reached a collective this long after the others is taken to be dead
DISTRIBUTED_TIMEOUT_S = 600


def _run(cfg: TrainConfig, device: torch.device, rank: int, world_size: int) -> dict:
    from ._io import remove_stale_temporaries

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    # freed activations kept in the process, not faulted in again every step (ResNet-18-GN, 2 cores:
    # 55-60 -> 68-73 records/s); the user's own MALLOC_* settings or preloaded allocator win
    allocator = retain_unless_configured() if device.type == "cpu" else None
    train, test, budgets = load_training_data(cfg)
    n = len(train)
    too_large = large_delta_message(cfg.delta, n, "--delta")
    if too_large:
        _warn(too_large)
    _warn_about_batch_size(cfg, n)
    task = Task.for_model(cfg.model)
    model, model_config = _build(cfg, train)
    fingerprint = _fingerprint(budgets, train)
    checkpoint_path = cfg.checkpoint or cfg.resume
    resume_state = None
    if cfg.resume:
        resume_state = _load_checkpoint_file(cfg.resume)
        _check_resume(resume_state, cfg, fingerprint, model_config)
    for path in (checkpoint_path, cfg.out_json, cfg.save_model):
        if path and rank == 0:
            remove_stale_temporaries(path)
    model.to(device)
    if world_size > 1:  # one global Poisson draw shared out, noise once: see pdpfast.distributed
        model = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = _optimizer(cfg, model)
    sample_rate = min(1.0, cfg.batch_size / n)
    steps_per_epoch = max(1, round(1.0 / sample_rate))
    total_steps = cfg.epochs * steps_per_epoch
    train_args = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "log"}
    extra = {"model_config": model_config, "train_args": train_args, "data": fingerprint}
    start = time.perf_counter()
    _say(cfg, f"pdpfast train: {n} training records ({train.source}), {len(np.unique(budgets))} distinct budgets "
              f"in [{budgets.min():.4g}, {budgets.max():.4g}], model {cfg.model}, method {cfg.method}, "
              f"{cfg.epochs} epochs of {steps_per_epoch} steps (expected batch {sample_rate * n:.1f}), "
              f"δ={cfg.delta:g}, device {device}" + (f", {world_size} processes" if world_size > 1 else "")
              + (f", {cfg.precision} autocast" if cfg.precision != "fp32" else "")
              + (f", allocator: {allocator}" if allocator else ""))
    run_method = _run_pdp if cfg.method == "pdp" else _run_idp
    with _StopOnSignal() as stop:
        job = _Job(cfg, checkpoint_path, extra, resume_state, stop,
                   DistributedContext() if world_size > 1 else None, device)
        summary = run_method(job, model, optimizer, train, task, budgets, sample_rate, total_steps)
    if job.stopped() is not None:
        raise TrainingInterrupted(job.stopped(), summary["steps"], summary["total_steps"], checkpoint_path)
    summary["seconds"] = time.perf_counter() - start
    summary["device"] = str(device)
    summary["precision"] = cfg.precision
    if allocator:
        summary["cpu_allocator"] = allocator
    if test is not None:
        summary["test"] = task.evaluate(model, test.dataset())
        _say(cfg, "test: " + ", ".join(f"{k} {v:.4f}" for k, v in summary["test"].items()))
    summary["groups"] = group_report(budgets, summary.pop("spent"))
    _say(cfg, format_groups(summary["groups"], f"ε spent per budget group ({summary['ledger']})"))
    saved = f"; checkpoint {checkpoint_path}" if checkpoint_path else ""
    if summary["finished"] and not summary["records_per_second"]:  # resumed from a finished run's checkpoint
        _say(cfg, f"done: the run had finished ({summary['steps']} steps); nothing left to train{saved}")
    elif summary["finished"]:
        _say(cfg, f"done: {summary['steps']} steps in {summary['seconds']:.1f}s, {summary['train_seconds']:.1f}s "
                  f"of them training ({summary['records_per_second']:.0f} records/s on {device}){saved}")
    else:
        _say(cfg, f"stopped after step {summary['steps']} of {summary['total_steps']}; " +
             (f"continue with --resume {checkpoint_path}" if checkpoint_path else
              "no --checkpoint was given, so it cannot be continued"))
    if cfg.save_model:
        # no seeds, no data fingerprint, no optimizer state: unlike the checkpoint, safe to publish
        weights = {k: v.detach().cpu() for k, v in inner_module(model).state_dict().items()}
        atomic_write(cfg.save_model, lambda f: torch.save(weights, f))
        _say(cfg, f"model weights (nothing else) written to {cfg.save_model}")
    if cfg.out_json:
        import json

        from .plots import atomic_write_text
        atomic_write_text(cfg.out_json, json.dumps(summary, indent=1, default=float))
    return summary


def _rng_states(device: torch.device) -> dict:
    """torch's random states a resumed run continues from (e.g. dropout draws): the CPU's, and
    the GPU's when training there."""
    states = {"torch_rng": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda_rng"] = torch.cuda.get_rng_state(device)
    return states


def _set_rng_states(extra: dict, device: torch.device) -> None:
    if "torch_rng" in extra:
        torch.set_rng_state(extra["torch_rng"])
    if "cuda_rng" in extra and device.type == "cuda":
        torch.cuda.set_rng_state(extra["cuda_rng"], device)


class _Progress:
    """The progress bar of a run: steps, the last loss and the throughput in records per second
    (optimizer steps × expected batch size / seconds: the realized batch sizes are private)."""

    def __init__(self, cfg: TrainConfig, total: int, initial: int, desc: str, expected_batch_size: float,
                 clock=time.perf_counter):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, initial=initial, desc=desc, disable=cfg.quiet, leave=False, file=sys.stderr)
        self.expected_batch_size, self.clock = float(expected_batch_size), clock
        self.start = clock()
        self.steps = 0          # taken by this invocation (a resumed run starts at its checkpoint's step)

    def seconds(self) -> float:
        """Since the bar opened: the training steps of this invocation, not the setup before them."""
        return self.clock() - self.start

    def records_per_second(self) -> float:
        return self.steps * self.expected_batch_size / max(self.seconds(), 1e-9)

    def step(self, loss: float, **postfix) -> None:
        self.steps += 1
        self.bar.update(1)
        self.bar.set_postfix(**postfix, loss=f"{loss:.3f}", **{"rec/s": f"{self.records_per_second():.0f}"},
                             refresh=False)

    def close(self) -> None:
        self.bar.close()


@dataclass
class _Job:
    """What a run's method shares, whichever it is: the settings, where and with what to save, the
    checkpoint being resumed (or None) and the stop signal. One place for resume → train → save."""

    cfg: TrainConfig
    checkpoint_path: str | None
    extra: dict                  # written into every checkpoint (model config, settings, data fingerprint)
    resume_state: dict | None
    stop: _StopOnSignal
    ranks: DistributedContext | None = None     # several processes: they agree on the step to stop after
    device: torch.device | None = None          # where their agreement is reduced (NCCL: the rank's GPU)
    agreed: int | None = None                   # the signal the ranks agreed to stop on, at their last step

    def stopped(self) -> int | None:
        """The signal training stops on, or None: this process's; with several ranks the one they
        agreed on at their last step (a signal that came after it changes nothing: every rank
        ended its training the same way)."""
        return self.stop.received if self.ranks is None else self.agreed

    def resume(self, load, model: nn.Module, optimizer, where, reseed=None) -> None:
        """Restore the checkpoint, if any: ``load()`` puts the state into the run's objects, then
        torch's random states; ``where()`` → (step, total steps) for the message. The optimizer keeps
        its state (momentum buffers, Adam's moments) and takes this run's --lr and --momentum. Where
        those or --precision changed (``_continuation_changes``), ``reseed(label)`` derives the noise
        and draw seeds of the steps to come from the checkpoint's, its step and the new values
        (``PrivacyEngine.reseed``); ``_check_resume`` refused such changes where there is none."""
        if self.resume_state is None:
            return
        _restore(self.cfg, load)
        for group in optimizer.param_groups:          # the checkpoint's were loaded with its state
            group["lr"] = self.cfg.lr
            if "momentum" in group:
                group["momentum"] = _momentum(self.cfg)
        _set_rng_states(self.resume_state["extra"], model_device(model))
        step, total = where()
        _say(self.cfg, f"resumed from {self.cfg.resume} at step {step} of {total}")
        changes = _continuation_changes(self.resume_state["extra"]["train_args"], self.cfg)
        if changes:
            reseed(", ".join(changes))
            _say(self.cfg, f"{', '.join(changes)}: this continuation draws its own records and noise from here "
                           "(seeds derived from the checkpoint's, the step and the new values), so it shares none "
                           "with another continuation of the checkpoint; each spends the records' budgets")

    def train(self, train, save_state, model: nn.Module, progress: _Progress, postfix=dict):
        """``train(on_step)`` with the progress bar, a checkpoint every ``--checkpoint-every`` steps
        and a final one (``save_state(path, **extra)`` writes it); returns what ``train`` returns.
        A signal stops training after the step in progress (``on_step`` returns True)."""
        cfg, stop = self.cfg, self.stop

        def save():
            if self.checkpoint_path:
                with stop.saving():
                    save_state(self.checkpoint_path, **_rng_states(model_device(model)),
                               interrupted=self.stopped() is not None, **self.extra)

        def on_step(step, loss):
            progress.step(loss, **postfix())
            if self.ranks is not None:
                # a signal reaches the ranks at different moments (even during this all-reduce): every rank
                # acts on the agreed value alone, so all stop after the same step, in the same collectives
                # (a periodic checkpoint's barrier included), and rank 0's checkpoint holds every step taken
                self.agreed = self.ranks.max_over_ranks(stop.received or 0, f"agreeing whether to stop after step "
                                                        f"{step}", self.device) or None
            if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and self.stopped() is None:
                save()
            return self.stopped() is not None

        try:
            result = train(on_step)
        finally:
            progress.close()
        save()
        return result


def _run_idp(job: _Job, model, optimizer, train, task, budgets, sample_rate, total_steps) -> dict:
    cfg = job.cfg
    with warnings.catch_warnings():   # δ ≥ 1/N was said once, in --delta's words, when the data loaded
        warnings.simplefilter("ignore", LargeDeltaWarning)
        engine, model, optimizer, loader, criterion = private_engine(
            cfg.method, model, optimizer, train.dataset(), budgets, delta=cfg.delta, steps=total_steps,
            sample_rate=sample_rate, batch_size=cfg.batch_size, task=task, max_grad_norm=cfg.max_grad_norm,
            clipping=cfg.clipping, mode=cfg.mode, seed=cfg.noise_seed,
            hybrid_weight=cfg.hybrid_weight,
            accountant=cfg.accountant, physical_batch_size=cfg.physical_batch_size)
    plan = engine.plan

    def load():
        inner_module(model).load_state_dict(job.resume_state["model"])
        engine.load_state_dict(job.resume_state["engine"])

    job.resume(load, model, optimizer, lambda: (engine.steps, plan.steps), reseed=engine.reseed)
    note = f" (DP-SGD: every record at the smallest budget {budgets.min():.4g})" if cfg.method == "dpsgd" else ""
    _say(cfg, f"plan: σ={plan.noise_multiplier:.4g}, C={plan.max_grad_norm:g}, "
              f"expected batch {plan.expected_batch_size:.1f}{note}")
    _warn_about_under_spending(cfg, plan, budgets)
    until = plan.steps if cfg.stop_after_steps is None else min(plan.steps, engine.steps + cfg.stop_after_steps)
    progress = _Progress(cfg, plan.steps, engine.steps, cfg.method, plan.expected_batch_size)
    job.train(lambda on_step: private_steps(engine, model, optimizer, loader, task, criterion, until=until,
                                            on_step=on_step, cuda_graph=cfg.cuda_graph,
                                            autocast=PRECISIONS[cfg.precision]),
              lambda path, **extra: engine.save_checkpoint(path, model, **extra), model, progress)
    return {"method": cfg.method, "steps": engine.steps, "total_steps": plan.steps,
            "finished": engine.steps >= plan.steps, "spent": engine.epsilons(),
            "ledger": f"{engine.accountant.name.upper()} ledger at δ={cfg.delta:g}",
            "noise_multiplier": plan.noise_multiplier,
            "records_per_second": progress.records_per_second(), "train_seconds": progress.seconds()}


def _run_pdp(job: _Job, model, optimizer, train, task, budgets, sample_rate, total_steps) -> dict:
    from .pdp_sgd import PDPSGD

    cfg = job.cfg
    # each round: epochs/rounds expected passes over its subset, at the run's expected batch size
    expected_batch_size = sample_rate * len(train)
    driver = PDPSGD(model, train.dataset(), budgets, optimizer=optimizer, delta=cfg.delta, rounds=cfg.rounds,
                    epochs_per_round=cfg.epochs / cfg.rounds, expected_batch_size=expected_batch_size, task=task,
                    max_grad_norm=cfg.max_grad_norm, loss=cfg.pdp_loss, rule=cfg.pdp_charge, seed=cfg.noise_seed,
                    mode=cfg.mode, clipping=cfg.clipping, physical_batch_size=cfg.physical_batch_size)
    job.resume(lambda: driver.load_checkpoint_state(job.resume_state), model, optimizer,
               lambda: (driver.steps, driver.total_steps))
    progress = _Progress(cfg, driver.total_steps, driver.steps, "pdp", expected_batch_size)
    result = job.train(lambda on_step: driver.run(on_step=on_step, max_steps=cfg.stop_after_steps),
                       driver.save_checkpoint, model, progress, postfix=lambda: {"round": driver.round + 1})
    if job.stopped() is None:
        for r in result.rounds:
            _say(cfg, f"round {r.round + 1}: threshold τ={r.threshold:.4g}, {r.subset_size} records kept, σ="
                      f"{r.noise_multiplier:.4g}, {r.steps} steps, engine ε {r.engine_epsilon:.4g}")
        _say(cfg, f"δ_i spent: max {result.deltas.max():.3g} (≤ rounds·δ = {cfg.rounds * cfg.delta:.3g})")
    return {"method": "pdp", "steps": driver.steps, "total_steps": driver.total_steps, "finished": driver.finished,
            "spent": result.epsilons, "ledger": "PDP-SGD round guarantees charged", "rounds": [
                dataclasses.asdict(r) for r in result.rounds], "max_delta": float(result.deltas.max()),
            "records_per_second": progress.records_per_second(), "train_seconds": progress.seconds()}
