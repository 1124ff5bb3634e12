"""pdpfast.datasets refuses input it would misread instead of training on it: labels that disagree with
their class names, features that become inf, columns named twice over, budgets it would skip, numbers
Python reads differently than people write them; and it documents how a budgets file maps to records."""
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from pdpfast import datasets

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def hub(monkeypatch):
    """A stand-in for the Hugging Face hub: ``hub(table, features=None)`` makes ``load_hf("d")`` return
    an in-memory ``datasets.Dataset`` of ``table`` (no network)."""
    hf = pytest.importorskip("datasets")

    def serve(table, features=None):
        dataset = hf.Dataset.from_dict(table, features=features)
        monkeypatch.setattr(hf, "load_dataset", lambda name, config=None, split="train": dataset)
        return dataset

    return serve


# ---------------------------------------------------------------------------------------------- labels
def test_a_class_label_column_keeps_its_indices_and_names(hub):
    hf = pytest.importorskip("datasets")
    names = ["neg", "neutral", "pos"]
    # only the classes 1 and 2 present: remapping by rank would shift every record onto its neighbour's name
    hub({"a": [0.1, 0.2, 0.3, 0.4], "label": [2, 1, 2, 2]},
        hf.Features({"a": hf.Value("float64"), "label": hf.ClassLabel(names=names)}))
    data = datasets.load_hf("d")
    assert data.labels.tolist() == [2, 1, 2, 2]
    assert data.class_names == names and data.num_classes == 3


def test_a_class_label_of_minus_one_is_refused_as_unlabelled_not_trained_as_a_class(hub):
    hf = pytest.importorskip("datasets")
    hub({"a": [0.1, 0.2, 0.3], "label": [-1, 0, 1]},
        hf.Features({"a": hf.Value("float64"), "label": hf.ClassLabel(names=["neg", "pos"])}))
    with pytest.raises(ValueError, match=r"label column 'label' .* holds -1 at record 0 .*outside its ClassLabel "
                                         r"classes 0\.\.1 .*-1 means unlabelled"):
        datasets.load_hf("d")


@pytest.mark.parametrize("largest", [9999, 10_000, 123_456])
def test_integer_labels_follow_one_rule_at_every_size_and_a_stray_label_is_named(tmp_path, largest):
    (tmp_path / "d.csv").write_text("a,y\n" + "".join(f"{i / 10},{i % 2}\n" for i in range(9)) + f"0.5,{largest}\n")
    with pytest.warns(UserWarning, match=rf"integer labels 0, 1, {largest} are not class indices .*the largest, "
                                         rf"{largest}, would make {largest + 1} classes .*held by 1 of 10 records"):
        data = datasets.load_csv(tmp_path / "d.csv", label_column="y")
    assert data.num_classes == 3 and data.class_names == ["0", "1", str(largest)]
    assert data.labels.tolist() == [i % 2 for i in range(9)] + [2]


@pytest.mark.parametrize("labels,expected", [([0, 1, 2, 1], 3), ([1, 2, 1, 2], 3), ([0, 1, 3, 3], 4), ([1], 2)])
def test_integer_labels_close_to_zero_to_k_keep_their_values_without_a_warning(tmp_path, labels, expected):
    (tmp_path / "d.csv").write_text("a,y\n" + "".join(f"{i},{v}\n" for i, v in enumerate(labels)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        data = datasets.load_csv(tmp_path / "d.csv", label_column="y")
    assert data.labels.tolist() == labels and data.num_classes == expected


def test_negative_integer_labels_are_mapped_in_sorted_order_with_a_warning(tmp_path):
    (tmp_path / "d.csv").write_text("a,y\n1,-1\n2,1\n3,-1\n")
    with pytest.warns(UserWarning, match="negative labels are not class indices"):
        data = datasets.load_csv(tmp_path / "d.csv", label_column="y")
    assert data.labels.tolist() == [0, 1, 0] and data.class_names == ["-1", "1"]


@pytest.mark.parametrize("make,error,match", [
    (lambda n: (np.arange(n) % 2).reshape(n // 2, 2), ValueError, r"must be a 1-D array \(N,\).*shape \(6, 2\)$"),
    (lambda n: (np.arange(n) % 2).reshape(n, 1), ValueError, r"must be a 1-D .*shape \(12, 1\) \(use y.ravel\(\)"),
    (lambda n: (np.arange(n) % 2).astype(complex), TypeError, "must be integer class labels .*got dtype complex128"),
    (lambda n: np.arange(n) % 2 == 0, TypeError, "must be integer class labels .*got dtype bool"),
])
def test_labels_that_are_not_one_dimensional_integers_are_refused_not_flattened(tmp_path, make, error, match):
    np.save(tmp_path / "x.npy", np.zeros((12, 3), np.float32))
    np.save(tmp_path / "y.npy", make(12))
    with pytest.raises(error, match=r"labels file '.*y\.npy' " + match):
        datasets.load_numpy(tmp_path / "x.npy", labels=tmp_path / "y.npy")


@pytest.mark.parametrize("y,names", [(np.array([0.0, 1.0, 1.0]), ["0", "1"]), (np.array(["dog", "cat", "dog"]),
                                                                               ["cat", "dog"])])
def test_whole_real_and_string_labels_stay_classes(tmp_path, y, names):
    np.save(tmp_path / "x.npy", np.zeros((3, 2), np.float32))
    np.save(tmp_path / "y.npy", y)
    assert datasets.load_numpy(tmp_path / "x.npy", labels=tmp_path / "y.npy").class_names == names


def test_a_language_model_dataset_without_a_label_column_loads_without_labels(hub):
    hub({"text": ["the cat sat", "a dog ran", "hello world"], "eps": [1.0, 2.0, 1.0]})
    data = datasets.load_data(hf_dataset="d", budget_column="eps", max_length=4)
    assert data.kind == "tokens" and data.features.shape == (3, 4)
    assert data.labels.tolist() == [0, 0, 0] and data.class_names == [] and data.num_classes == 1
    with pytest.raises(ValueError, match="has no label column 'y'"):        # a column named explicitly must exist
        datasets.load_data(hf_dataset="d", label_column="y", budget_column="eps")


def test_a_text_only_hugging_face_dataset_trains_a_language_model(hub, capsys, tmp_path):
    from pdpfast.cli import main

    hub({"text": ["the cat sat on the mat", "a dog ran", "hello world again"] * 4, "eps": [1.0] * 12})
    rc = main(["train", "--hf-dataset", "d", "--budget-column", "eps", "--model", "gpt2-micro", "--max-length", "8",
               "--epochs", "1", "--batch-size", "4", "--quiet", "--device", "cpu", "--test-fraction", "0",
               "--stop-after-steps", "1", "--out-json", str(tmp_path / "s.json")])
    assert rc == 0, capsys.readouterr().err
    assert (tmp_path / "s.json").exists()


def test_a_language_model_reads_no_labels_so_an_unlabelled_split_trains_it(hub, capsys, tmp_path):
    from pdpfast.cli import main

    hf = pytest.importorskip("datasets")
    text = ["the cat sat on the mat", "a dog ran", "hello world again"] * 4
    features = hf.Features({"text": hf.Value("string"), "label": hf.ClassLabel(names=["neg", "pos"]),
                            "eps": hf.Value("float64")})
    hub({"text": text, "label": [-1] * 12, "eps": [1.0] * 12}, features)     # an unsupervised split: all -1
    data = datasets.load_data(hf_dataset="d", budget_column="eps", max_length=4, lm=True)
    assert data.kind == "tokens" and data.class_names == [] and data.labels.tolist() == [0] * 12
    with pytest.raises(ValueError, match="-1 means unlabelled"):      # a classifier still refuses them
        datasets.load_data(hf_dataset="d", budget_column="eps", max_length=4)
    rc = main(["train", "--hf-dataset", "d", "--budget-column", "eps", "--model", "gpt2-micro", "--max-length", "8",
               "--epochs", "1", "--batch-size", "4", "--quiet", "--device", "cpu", "--test-fraction", "0",
               "--stop-after-steps", "1", "--out-json", str(tmp_path / "s.json")])
    assert rc == 0, capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- features
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_hugging_face_features_that_are_not_finite_are_refused(hub, bad):
    hub({"a": [0.5, 0.1, bad], "b": [1.0, 2.0, 3.0], "label": [0, 1, 0]})
    with pytest.raises(ValueError, match=r"hf:d\[train\] record 2, column 'a': .* features must be finite"):
        datasets.load_hf("d")


def test_features_beyond_float32_are_refused_naming_where_they_are(tmp_path, hub):
    (tmp_path / "d.csv").write_text("a,b,y\n0.1,0.2,0\n0.3,-1e39,1\n")
    with pytest.raises(ValueError, match=r"d\.csv row 3, column 'b': -1e\+39 .*within float32's range"):
        datasets.load_csv(tmp_path / "d.csv", label_column="y")
    x = np.zeros((4, 2))
    x[3, 1] = 1e39
    np.save(tmp_path / "x.npy", x)
    with pytest.raises(ValueError, match=r"x\.npy record 3, column 1: 1e\+39 .*within float32's range"):
        datasets.load_numpy(tmp_path / "x.npy")
    hub({"a": [0.1, 3e38 * 10], "label": [0, 1]})
    with pytest.raises(ValueError, match=r"record 1, column 'a': 3e\+39 .*within float32's range"):
        datasets.load_hf("d")


def test_features_at_the_float32_limit_load_finite(tmp_path):
    limit = float(np.finfo(np.float32).max)
    np.save(tmp_path / "x.npy", np.array([[limit, -limit], [0.0, 1.0]]))
    assert torch.isfinite(datasets.load_numpy(tmp_path / "x.npy").features).all()


@pytest.mark.parametrize("save", [lambda d: (np.save(d / "x.npy", np.zeros((0, 3))), np.save(d / "y.npy", np.zeros(0)),
                                             ("x.npy", d / "y.npy"))[-1],
                                  lambda d: (np.savez(d / "x.npz", x=np.zeros((0, 3)), y=np.zeros(0, int)),
                                             ("x.npz", None))[-1]])
def test_zero_records_with_labels_are_refused_as_no_records(tmp_path, save):
    name, labels = save(tmp_path)
    with pytest.raises(ValueError, match=rf"{name}: no records"):
        datasets.load_numpy(tmp_path / name, labels=labels)


def test_an_unnamed_csv_column_is_refused_as_a_pandas_index_column(tmp_path):
    pd = pytest.importorskip("pandas")
    pd.DataFrame({"a": [0.1, 0.2, 0.3], "y": [0, 1, 0], "eps": 1.0}).to_csv(tmp_path / "d.csv")    # index=True
    with pytest.raises(ValueError, match="column 1 of the header has no name; it looks like a pandas index column "
                                         r".*index=False"):
        datasets.load_csv(tmp_path / "d.csv", label_column="y", budget_column="eps")
    (tmp_path / "e.csv").write_text("a,,y\n1,2,0\n")
    with pytest.raises(ValueError, match="column 2 of the header has no name; give every column a name"):
        datasets.load_csv(tmp_path / "e.csv", label_column="y")


# ---------------------------------------------------------------------------------------------- columns
def test_one_column_for_labels_and_budgets_is_refused(tmp_path, hub):
    (tmp_path / "d.csv").write_text("a,y\n0.1,1\n0.2,2\n")
    match = "the label column and the budget column are the same column 'y'"
    with pytest.raises(ValueError, match=match):
        datasets.load_csv(tmp_path / "d.csv", label_column="y", budget_column="y")
    hub({"a": [0.1, 0.2], "y": [1, 2]})
    with pytest.raises(ValueError, match=match):
        datasets.load_data(hf_dataset="d", label_column="y", budget_column="y")


# ---------------------------------------------------------------------------------------------- numbers
@pytest.mark.parametrize("name,text,where", [("b.txt", "1\n1_0\n", "line 2"), ("b.csv", "eps\n1\n2_5\n", "row 3")])
def test_a_budget_with_underscores_is_refused_not_read_as_another_number(tmp_path, name, text, where):
    (tmp_path / name).write_text(text)
    with pytest.raises(ValueError, match=rf"{where}.*'\d_\d' is not a plain decimal number"):
        datasets.read_budgets(tmp_path / name)


@pytest.mark.parametrize("text,match", [("a,y\n1_0,0\n2,1\n", r"row 2, column 'a': '1_0' is not a plain decimal"),
                                        ("a,y\n1,0\n2,1_0\n", r"'1_0' is not a plain decimal"),
                                        ("a,y\n1,0\n\u0662,1\n", r"row 3, column 'a': '\u0662' is not a plain")])
def test_features_and_labels_with_underscores_or_other_digits_are_refused(tmp_path, text, match):
    (tmp_path / "d.csv").write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match=match):
        datasets.load_csv(tmp_path / "d.csv", label_column="y")


def test_plain_decimal_numbers_are_still_read(tmp_path):
    (tmp_path / "b.txt").write_text("1\n+2.5\n.5\n3e-1\n 4E2 \n")
    assert datasets.read_budgets(tmp_path / "b.txt").tolist() == [1.0, 2.5, 0.5, 0.3, 400.0]


# ---------------------------------------------------------------------------------------------- budgets files
def test_a_budgets_npz_with_another_array_beside_the_budgets_is_refused(tmp_path):
    np.savez(tmp_path / "b.npz", budgets=np.ones(3), budgets_v2=np.full(3, 8.0))
    with pytest.raises(ValueError, match=r"has arrays \['budgets', 'budgets_v2'\]; a budgets .npz must hold one array"):
        datasets.read_budgets(tmp_path / "b.npz", n=3)
    # naming the array (calibrate's --column) chooses it
    chosen = datasets.read_budgets(tmp_path / "b.npz", column="budgets_v2", column_option="--column")
    assert chosen.tolist() == [8.0] * 3
    np.savez(tmp_path / "c.npz", eps=np.full(2, 3.0))     # one array, under any name
    assert datasets.read_budgets(tmp_path / "c.npz").tolist() == [3.0, 3.0]


def test_the_order_budgets_follow_for_image_folders_and_hugging_face_splits_is_documented():
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("- **Budgets**: `--budget-column`"):readme.index("- **Models**")]
    assert re.search(r"split's row order", section) and re.search(r"ImageFolder.*order", section)
    assert re.search(r"class folders sorted\s+by name, then the image paths sorted", section)
    from pdpfast.cli import build_parser

    help_text = " ".join(build_parser()._subparsers._group_actions[0].choices["train"].format_help().split())
    assert "an --hf-dataset split's row order, an image folder's classes sorted by name, then its images sorted " \
           "by path" in help_text


def test_image_folder_records_follow_sorted_classes_then_sorted_paths(tmp_path):
    pytest.importorskip("torchvision")
    image = pytest.importorskip("PIL.Image")
    # written out of order: class "b" first, "2.png" before "1.png"
    for cls, name, value in [("b", "1.png", 50), ("a", "2.png", 200), ("a", "1.png", 100)]:
        (tmp_path / cls).mkdir(exist_ok=True)
        image.new("L", (2, 2), value).save(tmp_path / cls / name)
    data = datasets.load_image_folder(tmp_path, image_size=2)
    assert data.class_names == ["a", "b"] and data.labels.tolist() == [0, 0, 1]
    assert (data.features[:, 0, 0, 0] * 255).round().tolist() == [100.0, 200.0, 50.0]


def test_a_budgets_text_file_with_a_byte_order_mark_is_read_as_a_csv_is(tmp_path):
    (tmp_path / "b.txt").write_text("1\n2.5\n", encoding="utf-8-sig")
    (tmp_path / "b.csv").write_text("1\n2.5\n", encoding="utf-8-sig")
    assert datasets.read_budgets(tmp_path / "b.txt").tolist() == datasets.read_budgets(tmp_path / "b.csv").tolist()
    assert datasets.read_budgets(tmp_path / "b.txt").tolist() == [1.0, 2.5]
