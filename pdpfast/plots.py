"""Plots for the CLI (matplotlib, Agg backend) and atomic output files.

Every writer goes through a temporary file in the destination's directory and ``os.replace``, so
an output file is either absent or complete, never half-written. A plot is written in the format
its path's suffix names (``.png``, ``.pdf``, ``.svg``, ...); a path without a suffix matplotlib
writes, or whose format needs a program or Pillow codec this machine lacks (a TeX system for ``.pgf``,
``latex`` when ``rcParams["text.usetex"]`` is set, Pillow's WebP/AVIF/JPEG support), is refused before
anything is drawn. A plot that is refused or fails closes its figure: none is left open in pyplot.
"""
from __future__ import annotations

import contextlib
import math
import numbers
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import numpy as np

from ._io import check_output_path

__all__ = ["accuracy_curves", "atomic_path", "atomic_write_text", "bench_ratios", "check_image_path",
           "epsilon_curves", "figure", "plan_histograms", "save_figure", "Staging"]


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


# Formats matplotlib draws with Agg (pixels): with usetex, their text goes through dvipng.
_RASTER_FORMATS = frozenset({"png", "raw", "rgba", "gif", "jpg", "jpeg", "tif", "tiff", "webp", "avif"})
# Formats Pillow encodes with an optional library (a Pillow built without it cannot write them).
_PILLOW_FEATURES = {"jpg": "jpg", "jpeg": "jpg", "webp": "webp", "avif": "avif"}


def _why_unwritable(image_format: str) -> str | None:
    """Why this machine cannot write ``image_format`` with the current rcParams (a program missing from
    PATH, or Pillow without the codec), or None when it can. Checked up front: matplotlib finds out only
    in ``savefig``, after the work the plot shows (a calibration, a benchmark) is done."""
    import matplotlib

    rc = matplotlib.rcParams
    if image_format == "pgf":
        programs, setting = [rc["pgf.texsystem"]], "rcParams['pgf.texsystem']"
        instead = "set rcParams['pgf.texsystem'] to an installed one (xelatex, lualatex or pdflatex)"
    elif rc["text.usetex"]:
        # usetex renders text with latex, then dvipng for pixels or dvips for PostScript; pdf and svg
        # read the dvi file themselves.
        programs = ["latex"]
        if image_format in _RASTER_FORMATS:
            programs.append("dvipng")
        elif image_format in ("ps", "eps"):
            programs.append("dvips")
        setting, instead = "rcParams['text.usetex'] = True", "set rcParams['text.usetex'] = False"
    else:
        programs = []
    missing = [program for program in programs if shutil.which(program) is None]
    if missing:
        return (f"writing .{image_format} needs {' and '.join(map(repr, missing))} ({setting}), not found on "
                f"PATH; install {'it' if len(missing) == 1 else 'them'}, {instead}, or pick another suffix such as "
                ".pdf or .svg")
    feature = _PILLOW_FEATURES.get(image_format)
    if feature is not None:
        from PIL import __version__ as pillow_version
        from PIL import features

        with warnings.catch_warnings():         # an older Pillow warns "Unknown feature 'avif'"
            warnings.simplefilter("ignore")
            supported = features.check(feature)
        if not supported:
            return (f"the installed Pillow {pillow_version} cannot write {feature.upper()} (built without "
                    "it); install a Pillow that supports it, or pick another suffix such as .png or .pdf")
    return None


def check_image_path(path, name: str = "path") -> str:
    """Check where a plot goes, before it is drawn: a file path whose suffix names a format matplotlib
    writes (the suffix decides the format, so ``x.pdf`` holds a PDF, never PNG bytes) and this machine
    can write with the current rcParams.

    Args:
        path: the image file (str or ``Path``); name: the argument or option, as the message names it.
    Returns:
        the format, the suffix in lower case without its dot ("png", "pdf", "svg", ...).
    Raises:
        TypeError if ``path`` is not a path; ValueError naming ``name`` for an empty path, a directory,
        a parent that is a file or not writable (``pdpfast._io.check_output_path``), a suffix that is
        missing or names no format matplotlib writes, or a format that needs what this machine lacks:
        ``.pgf`` without the TeX program ``rcParams["pgf.texsystem"]`` names on PATH; with
        ``rcParams["text.usetex"]``, any format without ``latex`` (and ``dvipng`` for pixel formats,
        ``dvips`` for ``.ps``/``.eps``); ``.jpg``/``.jpeg``/``.webp``/``.avif`` with a Pillow built
        without that codec.
    """
    from matplotlib.backend_bases import FigureCanvasBase

    shown = _check_file_path(path, name)
    suffix = Path(shown).suffix.lower()
    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix[1:] not in formats:
        known = ", ".join(f".{f}" for f in sorted(formats))
        said = f"suffix {suffix!r}" if suffix else "no suffix"
        raise ValueError(f"{name} {shown!r} has {said}; the suffix picks the image format, one of {known}")
    why = _why_unwritable(suffix[1:])
    if why is not None:
        raise ValueError(f"{name} {shown!r}: {why}")
    return suffix[1:]


@contextlib.contextmanager
def figure(*args, **kwargs):
    """``plt.subplots(*args, **kwargs)`` as ``(fig, axes)``, closed on leaving the block however it is left:
    pyplot keeps every figure until it is closed, so one left by a failed plot is memory a long-lived
    process never gets back (and matplotlib warns after 20).

    Args:
        args, kwargs: those of ``plt.subplots``.
    Returns:
        a context manager yielding ``(fig, axes)``.
    """
    plt = _pyplot()
    fig, axes = plt.subplots(*args, **kwargs)
    try:
        yield fig, axes
    finally:
        plt.close(fig)


def save_figure(fig, path, image_format: str) -> None:
    """Lay ``fig`` out and write it to ``path`` atomically.

    Args:
        fig: the figure. path: the file. image_format: its format (what :func:`check_image_path` returned).
    Returns:
        None.
    """
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format=image_format, dpi=120)


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
        a run without as many steps as accuracies, or a method whose runs were taken at different steps;
        all before anything is drawn.
    """
    image_format = check_image_path(path)
    for method, runs in curves.items():
        for k, (steps, accuracies) in enumerate(runs):
            if len(steps) != len(accuracies):
                raise ValueError(f"curves[{method!r}], run {k}: {len(steps)} steps but {len(accuracies)} "
                                 "accuracies; give one accuracy per step")
    lines = []                                  # (method, steps (S,), accuracy (runs, S))
    for method, runs in curves.items():
        runs = [r for r in runs if len(r[0])]
        if not runs:
            continue
        length = min(len(r[0]) for r in runs)
        steps = np.asarray(runs[0][0][:length])
        if any(not np.array_equal(np.asarray(r[0][:length]), steps) for r in runs[1:]):
            raise ValueError(f"curves[{method!r}]: the runs were evaluated at different steps; a mean over "
                             "seeds needs the same steps in every run (evaluate at the same steps, or plot "
                             "the runs as separate methods)")
        lines.append((method, steps, np.stack([np.asarray(r[1][:length]) for r in runs])))
    with figure(figsize=(7, 4.5)) as (fig, ax):
        for method, steps, acc in lines:
            line, = ax.plot(steps, acc.mean(0), label=method)
            if acc.shape[0] > 1:
                ax.fill_between(steps, acc.mean(0) - acc.std(0), acc.mean(0) + acc.std(0), alpha=0.2,
                                color=line.get_color())
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("test accuracy")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        save_figure(fig, path, image_format)


def _budget(method, key) -> float:
    """A group's budget key as a number: results.json writes them as strings ("1.0")."""
    try:
        budget = float(key)
    except (TypeError, ValueError):
        budget = math.nan
    if math.isnan(budget):
        raise ValueError(f"curves[{method!r}]: budget key {key!r} is not a number; key each group by its "
                         "budget ε, a number or a numeric string such as '1.0'")
    return budget


def epsilon_curves(curves: dict, path, *, title: str = "ε spent per privacy group") -> None:
    """ε spent per privacy group over training: one panel per method, a line per group and its
    budget as a dashed line.

    Args:
        curves: {method name: (steps (S,), {budget ε: (S,) ε spent, the max over the group's records})};
            a budget is a number or a numeric string (results.json's keys, e.g. "1.0"); methods whose
            entry is None or has no steps are skipped.
        path: the image file to write (atomically), in the format its suffix names.
        title: the figure's title.
    Returns:
        None.
    Raises:
        ValueError (TypeError for a path that is not one) for a bad path (:func:`check_image_path`),
        a budget key that is not a number, or a group with another number of values than steps; all
        before anything is drawn.
    """
    image_format = check_image_path(path)
    panels = []                                 # (method, steps (S,), [(budget ε, (S,) ε spent)] by budget)
    for method, curve in curves.items():
        if curve is None or not len(curve[0]):
            continue
        steps, per_group = curve
        groups = []
        for key, spent in per_group.items():
            budget = _budget(method, key)
            if len(spent) != len(steps):
                raise ValueError(f"curves[{method!r}], budget {key!r}: {len(steps)} steps but {len(spent)} "
                                 "values of ε spent; give one per step")
            groups.append((budget, spent))
        panels.append((method, steps, sorted(groups, key=lambda group: group[0])))
    plt = _pyplot()
    cols = min(3, max(1, len(panels)))
    rows = max(1, -(-len(panels) // cols))
    with figure(rows, cols, figsize=(4.2 * cols, 3.3 * rows), squeeze=False, sharey=True) as (fig, axes):
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        for ax, (method, steps, groups) in zip(axes.ravel(), panels):
            for k, (budget, spent) in enumerate(groups):
                color = colors[k % len(colors)]
                ax.plot(steps, spent, color=color, label=f"budget ε={budget:g}")
                ax.axhline(budget, color=color, ls="--", lw=0.8)
            ax.set_title(method, fontsize=10)
            ax.set_xlabel("optimizer step")
            ax.grid(alpha=0.3)
        for ax in axes.ravel()[len(panels):]:
            ax.axis("off")
        axes[0, 0].set_ylabel("ε spent (ledger)")
        if panels:
            axes[0, 0].legend(fontsize=7)
        fig.suptitle(title)
        save_figure(fig, path, image_format)


def plan_histograms(plan, path) -> None:
    """Histograms of the plan's per-record sampling rates q_i and clip norms c_i.

    Args:
        plan: a ``PrivacyPlan``: its (G,) ``group_sample_rates`` and ``group_clip_norms`` (finite) are
            histogrammed with weights ``group_sizes`` (so the counts are records); ``method``,
            ``noise_multiplier``, ``steps`` and ``delta`` go into the title.
        path: the image file to write (atomically), in the format its suffix names.
    Returns:
        None.
    Raises:
        ValueError (TypeError for a path that is not one) for a bad path (:func:`check_image_path`), a
        plan without groups, group arrays of different lengths, or a sample rate or clip norm that is
        NaN or infinite; all before anything is drawn.
    """
    image_format = check_image_path(path)
    sizes = [np.size(a) for a in (plan.group_sample_rates, plan.group_clip_norms, plan.group_sizes)]
    if sizes[0] == 0:
        raise ValueError("plan has no groups: there are no sample rates or clip norms to plot")
    if len(set(sizes)) != 1:
        raise ValueError(f"plan must have one sample rate, clip norm and size per group, got {sizes[0]}, "
                         f"{sizes[1]} and {sizes[2]}")
    panels = []
    for attribute, label in (("group_sample_rates", "sample rate q_i"), ("group_clip_norms", "clip norm c_i")):
        values = np.asarray(getattr(plan, attribute), dtype=np.float64)
        bad = ~np.isfinite(values)
        if bad.any():
            raise ValueError(f"plan.{attribute} has {int(bad.sum())} value(s) that are NaN or infinite (group "
                             f"{int(np.flatnonzero(bad)[0])}: {values[bad][0]}); a plan to plot has finite "
                             "ones: check how it was built or loaded")
        panels.append((values, label))
    from matplotlib.ticker import MaxNLocator

    with figure(1, 2, figsize=(9, 3.6)) as (fig, axes):
        for ax, (values, label) in zip(axes, panels):
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
        save_figure(fig, path, image_format)


def bench_ratios(rows: list, path, *, key: str, title: str) -> None:
    """Grouped bars: for each model, each provider's ``key`` (a ratio to non-private), a line at 1.

    Args:
        rows: benchmark result dicts with "model", "provider" and ``key``; rows without ``key``, or
            whose ``key`` is None (JSON null: not measured), are skipped; a missing (model, provider)
            pair is drawn as NaN (no bar).
        path: the image file to write (atomically), in the format its suffix names.
        key: the row field to plot, e.g. "throughput_ratio_vs_nonprivate".
        title: the plot's title.
    Returns:
        None.
    Raises:
        ValueError (TypeError for a path that is not one) for a bad path (:func:`check_image_path`), or
        a row with ``key`` but without "model" or "provider", or whose ``key`` is not a number; all
        before anything is drawn.
    """
    image_format = check_image_path(path)
    for i, row in enumerate(rows):
        missing = [k for k in ("model", "provider") if k not in row]
        if row.get(key) is not None and missing:
            raise ValueError(f"rows[{i}] has {key!r} but no {' or '.join(map(repr, missing))}; every plotted row "
                             "names its model and provider")
        if row.get(key) is not None and not isinstance(row[key], numbers.Real):
            raise ValueError(f"rows[{i}][{key!r}] is {row[key]!r}, not a number; give a number, or None for "
                             "one not measured (drawn as no bar)")
    rows = [r for r in rows if r.get(key) is not None]
    models = list(dict.fromkeys(r["model"] for r in rows))
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    with figure(figsize=(max(6, 1.3 * len(models) * max(1, len(providers)) / 2), 4)) as (fig, ax):
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
        save_figure(fig, path, image_format)
