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


def _open_figures() -> list[int]:
    import matplotlib.pyplot as plt

    return plt.get_fignums()


@pytest.mark.parametrize("texsystem", ["xelatex", "lualatex"])
def test_pgf_without_its_tex_program_is_refused_naming_the_option_and_the_program(tmp_path, monkeypatch,
                                                                                  texsystem):
    """``pdpfast calibrate --plot plan.pgf`` used to calibrate, then fail in savefig (no TeX)."""
    import matplotlib

    monkeypatch.setattr(plots.shutil, "which", lambda program: None)
    with matplotlib.rc_context({"pgf.texsystem": texsystem}):
        with pytest.raises(ValueError, match=rf"^--plot .*plan\.pgf.*'{texsystem}'.*pgf\.texsystem"):
            plots.check_image_path(tmp_path / "plan.pgf", "--plot")
        with pytest.raises(ValueError, match=rf"^path .*'{texsystem}'"):
            plots.plan_histograms(_plan(), tmp_path / "plan.pgf")
    assert not list(tmp_path.iterdir())


def test_pgf_is_accepted_when_its_tex_program_is_on_path(tmp_path, monkeypatch):
    monkeypatch.setattr(plots.shutil, "which", lambda program: f"/usr/bin/{program}")
    assert plots.check_image_path(tmp_path / "plan.pgf", "--plot") == "pgf"


@pytest.mark.parametrize("suffix,needed", [(".png", "'latex' and 'dvipng'"), (".eps", "'latex' and 'dvips'"),
                                           (".pdf", "'latex' \\(")])
def test_usetex_without_latex_is_refused_naming_the_programs_it_needs(tmp_path, monkeypatch, suffix, needed):
    import matplotlib

    monkeypatch.setattr(plots.shutil, "which", lambda program: None)
    with matplotlib.rc_context({"text.usetex": True}), pytest.raises(ValueError, match=rf"^--plot .*{needed}.*usetex"):
        plots.check_image_path(tmp_path / f"p{suffix}", "--plot")


@pytest.mark.parametrize("suffix", [".webp", ".avif", ".jpg"])
def test_a_format_pillow_was_built_without_is_refused_naming_pillow(tmp_path, monkeypatch, suffix):
    from PIL import features

    monkeypatch.setattr(features, "check", lambda feature: False)
    with pytest.raises(ValueError, match=r"^--plot .*Pillow .* cannot write"):
        plots.check_image_path(tmp_path / f"p{suffix}", "--plot")


def test_png_needs_no_external_program(tmp_path, monkeypatch):
    monkeypatch.setattr(plots.shutil, "which", lambda program: None)
    assert plots.check_image_path(tmp_path / "p.png") == "png"


def _plan_with(**attributes):
    plan = _plan()
    for name, value in attributes.items():
        setattr(plan, name, value)
    return plan


@pytest.mark.parametrize("call", [
    lambda p: plots.accuracy_curves(CURVES, p.with_suffix(".xyz")),
    lambda p: plots.accuracy_curves({"m": [([0, 1], [0.1, 0.2]), ([0, 2], [0.1, 0.2])]}, p),
    lambda p: plots.epsilon_curves({"m": ([0, 1], {"one": [0.0, 0.1]})}, p),
    lambda p: plots.plan_histograms(_plan((0.1, np.nan)), p),
    lambda p: plots.plan_histograms(_plan_with(noise_multiplier=None), p),     # fails while drawing the title
    lambda p: plots.bench_ratios([{"k": "fast", "model": "m", "provider": "x"}], p, key="k", title="t")])
def test_a_refused_or_failed_plot_leaves_no_figure_open(tmp_path, call):
    """A failed plot used to leave its figure in pyplot (75 open after 75 failures in a loop)."""
    before = _open_figures()
    with pytest.raises((ValueError, TypeError)):
        call(tmp_path / "p.png")
    assert _open_figures() == before
    assert not list(tmp_path.iterdir())


def test_a_written_plot_leaves_no_figure_open(tmp_path):
    before = _open_figures()
    plots.plan_histograms(_plan(), tmp_path / "p.png")
    assert _open_figures() == before


@pytest.mark.parametrize("attribute,values", [("group_sample_rates", (0.1, np.nan)),
                                              ("group_clip_norms", (1.0, np.inf))])
def test_a_plan_with_nan_or_inf_rates_or_clip_norms_is_refused_naming_the_array(tmp_path, attribute, values):
    """numpy's "supplied range of [nan, nan] is not finite" used to come out of ax.hist."""
    with pytest.raises(ValueError, match=rf"^plan\.{attribute} has 1 value\(s\) that are NaN or infinite \(group 1"):
        plots.plan_histograms(_plan_with(**{attribute: np.array(values)}), tmp_path / "p.png")
    assert not list(tmp_path.iterdir())


def test_bench_rows_whose_value_is_none_are_skipped_as_not_measured(tmp_path):
    """A JSON null used to fail inside ax.bar (int + NoneType)."""
    rows = [{"k": None, "model": "cnn", "provider": "x"}, {"k": None}, {"k": 1.2, "model": "cnn", "provider": "y"}]
    plots.bench_ratios(rows, tmp_path / "b.png", key="k", title="t")
    assert (tmp_path / "b.png").stat().st_size > 0


def test_a_bench_value_that_is_not_a_number_is_refused_naming_the_row_and_key(tmp_path):
    with pytest.raises(ValueError, match=r"^rows\[1\]\['k'\] is 'fast', not a number"):
        plots.bench_ratios([{"k": 1.0, "model": "m", "provider": "x"}, {"k": "fast", "model": "m", "provider": "y"}],
                           tmp_path / "b.png", key="k", title="t")
    assert not list(tmp_path.iterdir())


def test_epsilon_curves_plot_the_string_budget_keys_results_json_writes(tmp_path):
    """results.json keys budgets as strings ("1.0"); plotting them used to fail with "Unknown format code 'g'"."""
    import json

    from pdpfast.demo import RunResult, results_json

    run = RunResult(method="sample", accuracy=0.5, seconds=1.0, epsilons={1.0: 0.9, 3.0: 2.5}, steps=[0, 10],
                    accuracies=[0.1, 0.5], epsilon_curve={3.0: [0.0, 2.5], 1.0: [0.0, 0.9]})
    stored = json.loads(json.dumps(results_json({"sample": [run]})))["runs"]["sample"][0]
    assert set(stored["epsilon_curve"]) == {"1.0", "3.0"}
    plots.epsilon_curves({"sample": (stored["steps"], stored["epsilon_curve"])}, tmp_path / "e.png")
    assert (tmp_path / "e.png").read_bytes().startswith(MAGIC[".png"])


def test_a_budget_key_that_is_not_a_number_is_refused_naming_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"^curves\['m'\]: budget key 'one' is not a number"):
        plots.epsilon_curves({"m": ([0, 1], {"one": [0.0, 0.1]})}, tmp_path / "e.png")
    assert not list(tmp_path.iterdir())
