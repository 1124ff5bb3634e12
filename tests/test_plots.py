"""The plots (``pdpfast.plots``): a file in the format its suffix names, written atomically, and inputs
that would draw something misleading (seeds averaged over different steps) or fail inside matplotlib
refused naming the argument, before any file is written."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from pdpfast import plots

MAGIC = {".png": b"\x89PNG\r\n\x1a\n", ".pdf": b"%PDF-", ".svg": b"<?xml"}
CURVES = {"sample": [([0, 10, 20], [0.1, 0.5, 0.7]), ([0, 10, 20], [0.2, 0.4, 0.8])]}


def _plan(rates=(0.1, 0.2), clips=(1.0, 2.0), sizes=(3, 5)):
    return SimpleNamespace(group_sample_rates=np.array(rates), group_clip_norms=np.array(clips),
                           group_sizes=np.array(sizes), method="sample", noise_multiplier=1.0, steps=10, delta=1e-5)


def _written(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


@pytest.mark.parametrize("suffix", sorted(MAGIC))
def test_a_plot_is_written_in_the_format_its_suffix_names(tmp_path, suffix):
    """``pdpfast bench --plot b.pdf`` used to write PNG bytes into b.pdf."""
    path = tmp_path / f"acc{suffix}"
    plots.accuracy_curves(CURVES, path)
    assert path.read_bytes().startswith(MAGIC[suffix])
    assert _written(tmp_path) == [path.name]                  # no temporary file left


def test_a_staged_plot_keeps_the_format_of_its_final_name(tmp_path):
    with plots.Staging() as staging:
        plots.plan_histograms(_plan(), staging.path(tmp_path / "out" / "plan.pdf"))
        staging.commit()
    assert (tmp_path / "out" / "plan.pdf").read_bytes().startswith(b"%PDF-")
    assert _written(tmp_path / "out") == ["plan.pdf"]


@pytest.mark.parametrize("name,expected", [("a.xyz", "has suffix '.xyz'"), ("a", "has no suffix"),
                                           ("", "is empty"), (".", "is a directory"),
                                           ("f.txt/a.png", "is a file, not a directory")])
def test_a_path_no_image_can_be_written_to_is_refused_naming_path_before_drawing(tmp_path, name, expected):
    (tmp_path / "f.txt").write_text("x")
    path = "" if name == "" else tmp_path / name
    with pytest.raises(ValueError, match=rf"^path\b.*{expected}"):
        plots.accuracy_curves(CURVES, path)
    assert _written(tmp_path) == ["f.txt"]


def test_a_directory_is_refused_by_the_atomic_text_writer_too(tmp_path):
    with pytest.raises(ValueError, match="is a directory"):
        plots.atomic_write_text(tmp_path, "x")


def test_seeds_evaluated_at_different_steps_are_not_averaged(tmp_path):
    """The mean used to be drawn against the first seed's steps."""
    curves = {"sample": [([0, 10, 20], [0.1, 0.5, 0.7]), ([0, 15, 30], [0.2, 0.4, 0.8])]}
    with pytest.raises(ValueError, match=r"curves\['sample'\]: the runs were evaluated at different steps"):
        plots.accuracy_curves(curves, tmp_path / "a.png")
    assert not list(tmp_path.iterdir())


def test_runs_cut_to_the_shortest_are_averaged_when_they_share_its_steps(tmp_path):
    curves = {"sample": [([0, 10, 20], [0.1, 0.5, 0.7]), ([0, 10], [0.2, 0.4])]}
    plots.accuracy_curves(curves, tmp_path / "a.png")
    assert (tmp_path / "a.png").stat().st_size > 0


@pytest.mark.parametrize("call,expected", [
    (lambda p: plots.accuracy_curves({"m": [([1, 2, 3], [0.1, 0.2])]}, p), r"curves\['m'\], run 0: 3 steps but 2"),
    (lambda p: plots.epsilon_curves({"m": ([1, 2], {1.0: [0.1, 0.2, 0.3]})}, p), r"curves\['m'\], budget 1.0: 2 steps"),
    (lambda p: plots.plan_histograms(_plan((), (), ()), p), "plan has no groups"),
    (lambda p: plots.plan_histograms(_plan(sizes=(3,)), p), "plan must have one sample rate, clip norm and size"),
    (lambda p: plots.bench_ratios([{"k": 1.0, "provider": "x"}], p, key="k", title="t"), r"rows\[0\] has 'k' but no "
                                                                                          "'model'")])
def test_inputs_that_failed_inside_matplotlib_or_numpy_are_refused_naming_the_argument(tmp_path, call, expected):
    with pytest.raises(ValueError, match=expected):
        call(tmp_path / "p.png")
    assert not list(tmp_path.iterdir())


def test_bench_rows_without_the_plotted_key_are_skipped_whatever_else_they_lack(tmp_path):
    plots.bench_ratios([{"note": "no model"}, {"k": 1.2, "model": "cnn", "provider": "x"}], tmp_path / "b.png",
                       key="k", title="t")
    assert (tmp_path / "b.png").stat().st_size > 0
