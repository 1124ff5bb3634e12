"""`pdpfast bench`: runs the checkout's benchmark scripts, writes JSON + a ratio plot; says why not."""
import json
import sys
from pathlib import Path

import pytest
import torch

from pdpfast import cli as pdpfast_cli


def test_bench_e2e_smoke_writes_json_and_plot(cli, tmp_path):
    pytest.importorskip("opacus")
    out = tmp_path / "res" / "e2e.json"
    rc, stdout, err = cli("bench", "--suite", "e2e", "--device", "cpu", "--size", "micro", "--models", "bert",
                          "--repeats", 1, "--out", out)
    assert rc == 0, err
    rows = json.loads(out.read_text())
    assert {r["provider"] for r in rows} >= {"non-private", "pdpfast bk"}
    assert all(r["device"].startswith("cpu") for r in rows)
    png = out.with_suffix(".png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in out.parent.iterdir()) == ["e2e.json", "e2e.png"]
    assert f"written to {out}" in stdout  # the path the user gave, not the staging file's


def test_bench_e2e_without_cuda_says_so(cli, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    message = cli.fails("bench", "--suite", "e2e", "--out", tmp_path / "x.json")
    assert "CUDA" in message
    assert not (tmp_path / "x.json").exists()


def test_bench_outside_a_checkout_says_to_run_it_from_the_repository(tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m == "bench" or m.startswith("bench.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".") and not (Path(p) / "bench").is_dir()])
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RuntimeError, match="repository root"):
        pdpfast_cli._import_bench("bench_cpu", roots=[tmp_path])


@pytest.mark.parametrize("args,expected", [
    (("--suite", "cpu", "--dtype", "bf16"), "--dtype: for the end-to-end suite (--suite e2e) only"),
    (("--suite", "cpu", "--device", "cpu", "--size", "tiny"), "--device, --size: for the end-to-end suite"),
    (("--suite", "cpu", "--repeats", 0), "--repeats must be a positive integer"),
    (("--suite", "cpu", "--models", "transformer,bogus"), "--models: unknown bogus for the cpu suite; choose from "
                                                           "transformer, cnn"),
    (("--suite", "e2e", "--device", "cpu", "--models", "resnet"), "--models: unknown resnet for the e2e suite"),
    (("--suite", "e2e", "--device", "bogus"), "--device bogus: not a device")])
def test_bench_options_that_would_be_ignored_or_fail_deep_inside_are_refused_first(cli, tmp_path, args, expected):
    """``--suite cpu --dtype bf16`` used to run the fp32 CPU suite; ``--repeats -1`` failed with "no median
    for empty data", ``--models bogus`` with a bare KeyError."""
    message = cli.fails("bench", *args, "--out", tmp_path / "x.json")
    assert expected in message, message
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("plot,expected", [("b.xyz", "--plot '{}' has suffix '.xyz'"),
                                           ("b", "--plot '{}' has no suffix")])
def test_bench_plot_whose_suffix_names_no_image_format_is_refused_before_the_run(cli, tmp_path, plot, expected):
    """``--plot b3.pdf`` used to get PNG bytes; a suffix no format has is refused before the benchmark runs."""
    message = cli.fails("bench", "--suite", "cpu", "--out", tmp_path / "x.json", "--plot", tmp_path / plot)
    assert expected.format(tmp_path / plot) in message, message
    assert not list(tmp_path.iterdir())
