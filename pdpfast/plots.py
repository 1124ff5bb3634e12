"""Plots for the CLI (matplotlib, Agg backend) and atomic output files.

Every writer goes through a temporary file in the destination's directory and ``os.replace``, so
an output file is either absent or complete, never half-written. A plot is written in the format
its path's suffix names (``.png``, ``.pdf``, ``.svg``, ...); a path without a suffix matplotlib
writes is refused before anything is drawn.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

import numpy as np

from ._io import check_output_path

__all__ = ["accuracy_curves", "atomic_path", "atomic_write_text", "bench_ratios", "check_image_path",
           "epsilon_curves", "plan_histograms", "Staging"]


def _check_file_path(path, name: str) -> str:
    """A path a file can be written to (not empty, not a directory, under a writable directory)."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{name} must be a file path (str or Path), got {type(path).__name__} {path!r}")
    shown = os.fspath(path)
    if not shown:
        raise ValueError(f"{name} is empty; give a file path")
    check_output_path(shown, name)
    return shown


def _temp_file(directory: Path, name: str, suffix: str) -> str:
    """An empty temporary file next to the output, with the permissions a new file would get."""
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=suffix)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    return tmp


@contextlib.contextmanager
def atomic_path(path, suffix: str = ""):
    """A temporary path next to ``path`` that replaces it when the block succeeds.

    Args:
        path: the final file (str or ``Path``); its directory is created if missing.
        suffix: the temporary file's suffix (default: ``path``'s), e.g. for writers that pick a format
            from it.
    Returns:
        a context manager yielding the temporary path (a str, an existing empty file); on leaving the
        block normally it is moved onto ``path`` (``os.replace``), on an error it is removed.
    Raises:
        ValueError naming ``path`` for an empty path, a directory, or a parent that is a file or not
        writable (TypeError if it is not a path), before any file is created.
    """
    path = Path(_check_file_path(path, "path"))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_file(path.parent, path.name, suffix or path.suffix)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def atomic_write_text(path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (``atomic_path``).

    Args:
        path: the file (str or ``Path``); its directory is created if missing.
        text: the contents, written as UTF-8.
    Returns:
        None.
    """
    with atomic_path(path) as tmp:
        Path(tmp).write_text(text, encoding="utf-8")


class Staging:
    """Outputs of one command: written as temporary files, moved into place together by
    ``commit()``; ``discard()`` (or leaving the ``with`` block on an error) removes them all, and
    any directory this object created, so a failed command leaves no output behind.

    Takes no arguments; use it as ``with Staging() as staging: ... staging.commit()``.
    """

    def __init__(self):
        self._pending: list[tuple[str, Path]] = []
        self._created: list[Path] = []

    def path(self, final) -> str:
        """A temporary file to write ``final``'s contents to, moved onto ``final`` by ``commit()``.

        Args:
            final: the output file (str or ``Path``); missing parent directories are created now (and
                removed again by ``discard()``).
        Returns:
            the temporary file's path, a str (an existing empty file next to ``final``).
        """
        final = Path(final)
        missing = []
        parent = final.parent
        while not parent.exists():
            missing.append(parent)
            parent = parent.parent
        final.parent.mkdir(parents=True, exist_ok=True)
        self._created.extend(reversed(missing))
        tmp = _temp_file(final.parent, final.name, final.suffix)
        self._pending.append((tmp, final))
        return tmp

    def commit(self) -> list[Path]:
        """Move every staged file onto its final path (``os.replace``, one at a time).

        Returns:
            the final paths (``Path``), in staging order; nothing is left staged afterwards.
        """
        done = []
        for tmp, final in self._pending:
            os.replace(tmp, final)
            done.append(final)
        self._pending, self._created = [], []
        return done

    def discard(self) -> None:
        """Remove the staged files not yet committed, and the directories ``path()`` created (if empty).

        Returns:
            None.
        """
        for tmp, _ in self._pending:
            if os.path.exists(tmp):
                os.unlink(tmp)
        for directory in reversed(self._created):
            with contextlib.suppress(OSError):
                directory.rmdir()
        self._pending, self._created = [], []

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self.discard()
        return False


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def check_image_path(path, name: str = "path") -> str:
    """Check where a plot goes, before it is drawn: a file path whose suffix names a format matplotlib
    writes (the suffix decides the format, so ``x.pdf`` holds a PDF, never PNG bytes).

    Args:
        path: the image file (str or ``Path``); name: the argument or option, as the message names it.
    Returns:
        the format, the suffix in lower case without its dot ("png", "pdf", "svg", ...).
    Raises:
        TypeError if ``path`` is not a path; ValueError naming ``name`` for an empty path, a directory,
        a parent that is a file or not writable (``pdpfast._io.check_output_path``), or a suffix that is
        missing or names no format matplotlib writes.
    """
    from matplotlib.backend_bases import FigureCanvasBase

    shown = _check_file_path(path, name)
    suffix = Path(shown).suffix.lower()
    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix[1:] not in formats:
        known = ", ".join(f".{f}" for f in sorted(formats))
        said = f"suffix {suffix!r}" if suffix else "no suffix"
        raise ValueError(f"{name} {shown!r} has {said}; the suffix picks the image format, one of {known}")
    return suffix[1:]


def _save(fig, path, image_format: str) -> None:
    plt = _pyplot()
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format=image_format, dpi=120)
    plt.close(fig)


def accuracy_curves(curves: dict, path, *, title: str = "test accuracy during training") -> None:
    """Test accuracy against optimizer step: per method, the mean over seeds with a ± std band.

    Args:
        curves: {method name: [(steps (S,), accuracy (S,)), ...], one pair per seed} (sequences or
            arrays). Each method's runs are cut to the shortest, and must have been evaluated at the
            same steps up to there (a mean over seeds is taken step by step); empty runs and methods
            with none are skipped.
        path: the image file to write (atomically), in the format its suffix names.
        title: the plot's title.
    Returns:
        None.
    Raises:
        ValueError (TypeError for a path that is not one) for a bad path (:func:`check_image_path`),
        a run with as many steps as accuracies, or a method whose runs were taken at different steps.
    """
    image_format = check_image_path(path)
    for method, runs in curves.items():
        for k, (steps, accuracies) in enumerate(runs):
            if len(steps) != len(accuracies):
                raise ValueError(f"curves[{method!r}], run {k}: {len(steps)} steps but {len(accuracies)} "
                                 "accuracies; give one accuracy per step")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method, runs in curves.items():
        runs = [r for r in runs if len(r[0])]
        if not runs:
            continue
        length = min(len(r[0]) for r in runs)
        steps = np.asarray(runs[0][0][:length])
        if any(not np.array_equal(np.asarray(r[0][:length]), steps) for r in runs[1:]):
            plt.close(fig)
            raise ValueError(f"curves[{method!r}]: the runs were evaluated at different steps; a mean over "
                             "seeds needs the same steps in every run (evaluate at the same steps, or plot "
                             "the runs as separate methods)")
        acc = np.stack([np.asarray(r[1][:length]) for r in runs])
        line, = ax.plot(steps, acc.mean(0), label=method)
        if acc.shape[0] > 1:
            ax.fill_between(steps, acc.mean(0) - acc.std(0), acc.mean(0) + acc.std(0), alpha=0.2,
                            color=line.get_color())
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("test accuracy")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path, image_format)


def epsilon_curves(curves: dict, path, *, title: str = "ε spent per privacy group") -> None:
    """ε spent per privacy group over training: one panel per method, a line per group and its
    budget as a dashed line.

    Args:
        curves: {method name: (steps (S,), {budget ε: (S,) ε spent, the max over the group's records})};
            methods whose entry is None or has no steps are skipped.
        path: the image file to write (atomically), in the format its suffix names.
        title: the figure's title.
    Returns:
        None.
    Raises:
        ValueError (TypeError for a path that is not one) for a bad path (:func:`check_image_path`) or
        a group with another number of values than steps.
    """
    image_format = check_image_path(path)
    methods = [m for m, c in curves.items() if c is not None and len(c[0])]
    for method in methods:
        steps, per_group = curves[method]
        for budget, spent in per_group.items():
            if len(spent) != len(steps):
                raise ValueError(f"curves[{method!r}], budget {budget!r}: {len(steps)} steps but {len(spent)} "
                                 "values of ε spent; give one per step")
    plt = _pyplot()
    cols = min(3, max(1, len(methods)))
    rows = max(1, -(-len(methods) // cols))
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.3 * rows), squeeze=False, sharey=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, method in zip(axes.ravel(), methods):
        steps, per_group = curves[method]
        for k, b in enumerate(sorted(per_group)):
            color = colors[k % len(colors)]
            ax.plot(steps, per_group[b], color=color, label=f"budget ε={b:g}")
            ax.axhline(b, color=color, ls="--", lw=0.8)
        ax.set_title(method, fontsize=10)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    for ax in axes.ravel()[len(methods):]:
        ax.axis("off")
    axes[0, 0].set_ylabel("ε spent (ledger)")
    if methods:
        axes[0, 0].legend(fontsize=7)
    fig.suptitle(title)
    _save(fig, path, image_format)


def plan_histograms(plan, path) -> None:
    """Histograms of the plan's per-record sampling rates q_i and clip norms c_i.

    Args:
        plan: a ``PrivacyPlan``: its (G,) ``group_sample_rates`` and ``group_clip_norms`` are
            histogrammed with weights ``group_sizes`` (so the counts are records); ``method``,
            ``noise_multiplier``, ``steps`` and ``delta`` go into the title.
        path: the image file to write (atomically), in the format its suffix names.
    Returns:
        None.
    Raises:
        ValueError (TypeError for a path that is not one) for a bad path (:func:`check_image_path`), a
        plan without groups, or group arrays of different lengths.
    """
    image_format = check_image_path(path)
    sizes = [np.size(a) for a in (plan.group_sample_rates, plan.group_clip_norms, plan.group_sizes)]
    if sizes[0] == 0:
        raise ValueError("plan has no groups: there are no sample rates or clip norms to plot")
    if len(set(sizes)) != 1:
        raise ValueError(f"plan must have one sample rate, clip norm and size per group, got {sizes[0]}, "
                         f"{sizes[1]} and {sizes[2]}")
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.6))
    for ax, values, label in ((a, plan.group_sample_rates, "sample rate q_i"),
                              (b, plan.group_clip_norms, "clip norm c_i")):
        lo, hi = float(values.min()), float(values.max())
        if hi - lo <= 1e-12 * max(1.0, abs(hi)):
            lo, hi = lo - 0.5 * max(abs(lo), 1e-3) * 0.1, hi + 0.5 * max(abs(hi), 1e-3) * 0.1
        ax.hist(values, bins=40, range=(lo, hi), weights=plan.group_sizes)
        ax.xaxis.set_major_locator(MaxNLocator(5))
        ax.set_xlabel(label)
        ax.set_ylabel("records")
        ax.grid(alpha=0.3)
    fig.suptitle(f"PrivacyPlan({plan.method}): σ={plan.noise_multiplier:.4g}, {plan.steps} steps, "
                 f"δ={plan.delta:.2g}", fontsize=10)
    _save(fig, path, image_format)


def bench_ratios(rows: list, path, *, key: str, title: str) -> None:
    """Grouped bars: for each model, each provider's ``key`` (a ratio to non-private), a line at 1.

    Args:
        rows: benchmark result dicts with "model", "provider" and ``key``; rows without ``key`` are
            skipped, a missing (model, provider) pair is drawn as NaN (no bar).
        path: the image file to write (atomically), in the format its suffix names.
        key: the row field to plot, e.g. "throughput_ratio_vs_nonprivate".
        title: the plot's title.
    Returns:
        None.
    Raises:
        ValueError (TypeError for a path that is not one) for a bad path (:func:`check_image_path`), or
        a row with ``key`` but without "model" or "provider".
    """
    image_format = check_image_path(path)
    for i, row in enumerate(rows):
        missing = [k for k in ("model", "provider") if k not in row]
        if key in row and missing:
            raise ValueError(f"rows[{i}] has {key!r} but no {' or '.join(map(repr, missing))}; every plotted row "
                             "names its model and provider")
    rows = [r for r in rows if key in r]
    plt = _pyplot()
    models = list(dict.fromkeys(r["model"] for r in rows))
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(models) * max(1, len(providers)) / 2), 4))
    width = 0.8 / max(1, len(providers))
    for j, provider in enumerate(providers):
        values = [next((r[key] for r in rows if r["model"] == m and r["provider"] == provider), np.nan)
                  for m in models]
        ax.bar(np.arange(len(models)) + j * width, values, width, label=provider)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(np.arange(len(models)) + width * (len(providers) - 1) / 2, models)
    ax.set_ylabel(key.replace("_", " "))
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    _save(fig, path, image_format)
