"""pdpfast.datasets: budget files, CSV / NumPy loading, tokenization, the data-independent split."""
import numpy as np
import pytest
import torch

from pdpfast import datasets


@pytest.mark.parametrize("name,text", [("b.txt", "1\n2.5\n\n3\n"), ("b.csv", "eps\n1\n2.5\n3\n"),
                                       ("b.csv", "1\n2.5\n3\n")])
def test_read_budgets_from_text_formats(tmp_path, name, text):
    (tmp_path / name).write_text(text)
    np.testing.assert_array_equal(datasets.read_budgets(tmp_path / name), [1.0, 2.5, 3.0])


def test_read_budgets_from_numpy_and_a_named_column(tmp_path):
    np.save(tmp_path / "b.npy", np.array([0.5, 1.0]))
    np.savez(tmp_path / "b.npz", budgets=np.array([2.0, 3.0]))
    (tmp_path / "b.csv").write_text("id,eps\n7,4\n8,5\n")
    assert datasets.read_budgets(tmp_path / "b.npy", n=2).tolist() == [0.5, 1.0]
    assert datasets.read_budgets(tmp_path / "b.npz").tolist() == [2.0, 3.0]
    assert datasets.read_budgets(tmp_path / "b.csv", column="eps").tolist() == [4.0, 5.0]
    with pytest.raises(ValueError, match="3 records"):
        datasets.read_budgets(tmp_path / "b.npy", n=3)


@pytest.mark.parametrize("values,match", [([1.0, np.nan], "non-finite"), ([1.0, 0.0], "≤ 0"), ([1.0, -2.0], "≤ 0"),
                                          ([], "empty"), ([[1.0, 2.0], [3.0, 4.0]], "1-D"),
                                          ([1.0, np.inf], "non-finite")])
def test_check_budgets_refuses_what_is_not_a_budget(values, match):
    with pytest.raises(ValueError, match=match):
        datasets.check_budgets(values, None)


def test_csv_labels_features_and_budget_column(tmp_path):
    (tmp_path / "d.csv").write_text("a,b,kind,eps\n1,2,cat,1\n3,4,dog,2\n5,6,cat,0.5\n")
    data = datasets.load_csv(tmp_path / "d.csv", label_column="kind", budget_column="eps")
    assert data.kind == "features" and data.features.shape == (3, 2)
    assert data.labels.tolist() == [0, 1, 0] and data.class_names == ["cat", "dog"]
    assert data.budgets.tolist() == [1.0, 2.0, 0.5]
    with pytest.raises(ValueError, match="row 3, column 'b'"):
        (tmp_path / "e.csv").write_text("a,b,y\n1,2,0\n3,x,1\n")
        datasets.load_csv(tmp_path / "e.csv", label_column="y")


def test_integer_token_columns_and_the_hashing_tokenizer(tmp_path):
    np.savez(tmp_path / "t.npz", x=np.array([[1, 5, 0], [2, 3, 4]]), y=np.array([1, 0]))
    data = datasets.load_numpy(tmp_path / "t.npz", tokens=True)
    assert data.kind == "tokens" and data.features.dtype == torch.int64 and data.vocab_size == 6
    tokenizer = datasets.HashingTokenizer(vocab_size=50, max_length=6)
    ids = tokenizer(["The plot, the actors", "the PLOT"])
    assert ids.shape == (2, 6) and int(ids.max()) < 50 and ids[0, 0] == 1
    assert ids[0, 1] == ids[0, 4] == ids[1, 1]          # "The", "the": one id, case-insensitive
    assert ids[0, 2] == ids[1, 2] and ids[0, 2] != ids[0, 1]
    assert ids[1, 3:].eq(datasets.PAD_ID).all()


def test_split_depends_only_on_size_and_seed():
    a = datasets.TrainData(torch.randn(50, 3), torch.zeros(50, dtype=torch.long), "features", np.ones(50))
    b = datasets.TrainData(torch.randn(50, 3) * 100, torch.ones(50, dtype=torch.long), "features", np.full(50, 2.0))
    (tr_a, te_a), (_, te_b) = datasets.train_test_split(a, 0.2, 3), datasets.train_test_split(b, 0.2, 3)
    assert len(te_a) == 10 and len(tr_a) == 40

    def rows(full, part):
        return [int(torch.nonzero((full.features == row).all(1))[0]) for row in part.features]

    assert rows(a, te_a) == rows(b, te_b)


def test_image_folder_without_torchvision_says_what_to_install(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torchvision", None)
    (tmp_path / "cats").mkdir()
    with pytest.raises(ImportError, match="torchvision"):
        datasets.load_data(tmp_path)


def test_hugging_face_without_datasets_says_what_to_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match="pip install datasets"):
        datasets.load_data(hf_dataset="imdb")


def test_a_path_that_is_not_a_file_says_what_it_is(tmp_path):
    """A directory given as a budgets or data file was reported as missing."""
    with pytest.raises(FileNotFoundError, match="budgets file .* is not a regular file \\(a directory\\)"):
        datasets.read_budgets(tmp_path)
    with pytest.raises(FileNotFoundError, match="budgets file .* does not exist"):
        datasets.read_budgets(tmp_path / "none.npy")
    with pytest.raises(FileNotFoundError, match="data file .* is not a regular file"):
        datasets.load_numpy(tmp_path)
