"""pdpfast.datasets: budget files, CSV / NumPy loading, tokenization, the data-independent split."""
import numpy as np
import pytest
import torch

from pdpfast import datasets


@pytest.mark.parametrize("name,text", [("b.txt", "1\n2.5\n3\n\n"), ("b.csv", "eps\n1\n2.5\n3\n"),
                                       ("b.csv", "1\n2.5\n3\n\n")])
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


def test_a_missing_image_folder_is_named_before_torchvision_is_needed(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torchvision", None)
    with pytest.raises(FileNotFoundError, match="image folder .*nowhere.* does not exist"):
        datasets.load_image_folder(tmp_path / "nowhere")


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


# ---------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("name,text,line", [("b.txt", "1\n\n3\n", 2), ("b.csv", "eps\n1\n\n3\n", 3),
                                            ("b.txt", "\n1\n3\n", 1)])
def test_a_blank_line_before_the_last_budget_is_refused_since_skipping_it_would_shift_later_budgets(
        tmp_path, name, text, line):
    (tmp_path / name).write_text(text)
    with pytest.raises(ValueError, match=f"line {line} is blank"):
        datasets.read_budgets(tmp_path / name, n=2)


@pytest.mark.parametrize("header,twice", [("a,a,label", "'a'"), ("a,label,label", "'label'")])
def test_a_csv_header_naming_a_column_twice_is_refused_naming_it(tmp_path, header, twice):
    """Two columns under one name: one of them was silently read in place of the other."""
    (tmp_path / "d.csv").write_text(f"{header}\n1,2,0\n3,4,1\n")
    with pytest.raises(ValueError, match=f"header names column\\(s\\) {twice} more than once"):
        datasets.load_csv(tmp_path / "d.csv", label_column="label")


@pytest.mark.parametrize("load", [lambda p: datasets.load_csv(p, label_column="label"),
                                  lambda p: datasets.load_data(p, label_column="label")])
def test_a_csv_that_is_not_utf8_is_refused_naming_the_file(tmp_path, load):
    (tmp_path / "d.csv").write_bytes("a,label\ncaf\u00e9,0\n".encode("latin-1"))
    with pytest.raises(ValueError, match="d.csv cannot be read: it is not UTF-8 text"):
        load(tmp_path / "d.csv")


def test_subset_reads_a_boolean_mask_as_the_records_to_keep():
    data = datasets.TrainData(torch.arange(6.0).reshape(3, 2), torch.tensor([0, 1, 0]), "features", np.ones(3))
    kept = data.subset(np.array([True, False, True]))
    assert kept.features.tolist() == [[0.0, 1.0], [4.0, 5.0]] and len(kept.budgets) == 2


@pytest.mark.parametrize("index,error,match", [([0, 3], ValueError, "index 3 is outside the records \\[0, 3\\)"),
                                               ([-1], ValueError, "index -1 is outside"),
                                               ([0.7], TypeError, "integer record indices"),
                                               (np.array([True, False]), ValueError, "one entry per record \\(3\\)")])
def test_subset_refuses_indices_it_would_wrap_truncate_or_misread(index, error, match):
    data = datasets.TrainData(torch.zeros(3, 2), torch.zeros(3, dtype=torch.long), "features")
    with pytest.raises(error, match=match):
        data.subset(index)


@pytest.mark.parametrize("features,labels,kind,error,match", [
    ([[1.0, 2.0]], torch.zeros(1, dtype=torch.long), "features", TypeError, "features must be a torch.Tensor"),
    (torch.zeros(2, 2), torch.tensor([0.5, 1.5]), "features", TypeError, "labels must be integer"),
    (torch.zeros(2, 2), torch.tensor([0, -1]), "features", ValueError, "labels must be class indices ≥ 0"),
    (torch.zeros(2, 2), torch.tensor(1), "features", ValueError, "labels must be \\(N,\\)"),
    (torch.zeros(2, 2), torch.zeros(3, dtype=torch.long), "features", ValueError,
     "^labels must be one per record: features has 2 records, labels has 3$"),
    (torch.zeros(2, 2), torch.zeros(2, dtype=torch.long), "bogus", ValueError, "kind must be one of")])
def test_train_data_refuses_records_it_cannot_hold(features, labels, kind, error, match):
    with pytest.raises(error, match=match):
        datasets.TrainData(features, labels, kind)


def test_complex_features_are_refused_rather_than_losing_their_imaginary_part(tmp_path):
    np.save(tmp_path / "x.npy", np.array([[1 + 2j, 3.0], [4.0, 5j]]))
    with pytest.raises(ValueError, match="features must be finite real numbers, got dtype complex128"):
        datasets.load_numpy(tmp_path / "x.npy")


@pytest.mark.parametrize("arrays,names", [(dict(x=np.ones((3, 2)), X=np.zeros((3, 2))), "'x' and 'X'"),
                                          (dict(x=np.ones((3, 2)), y=np.zeros(3), labels=np.ones(3)),
                                           "'y' and 'labels'")])
def test_an_npz_with_two_names_for_one_array_is_refused_as_ambiguous(tmp_path, arrays, names):
    np.savez(tmp_path / "d.npz", **arrays)
    with pytest.raises(ValueError, match=f"holds both {names}"):
        datasets.load_numpy(tmp_path / "d.npz")


def test_an_npz_with_arrays_that_are_not_read_is_refused_naming_them(tmp_path):
    np.savez(tmp_path / "d.npz", x=np.ones((3, 2)), y=np.zeros(3), budgets=np.ones(3), weights=np.ones(3))
    with pytest.raises(ValueError, match="holds arrays \\['weights'\\] that would not be read; .*'budgets'"):
        datasets.load_numpy(tmp_path / "d.npz")


def test_labels_beside_an_npz_are_refused_since_it_holds_its_own(tmp_path):
    np.savez(tmp_path / "d.npz", x=np.ones((3, 2)), y=np.zeros(3))
    np.save(tmp_path / "y.npy", np.ones(3))
    with pytest.raises(ValueError, match="labels applies to a .npy path"):
        datasets.load_numpy(tmp_path / "d.npz", labels=tmp_path / "y.npy")


@pytest.mark.parametrize("make,match", [
    (lambda p: p.write_text("a,b\n1,2\n"), "is not NumPy .npy/.npz data"),
    (lambda p: np.save(p, np.array([{"a": 1}], dtype=object)), "holds an array of Python objects")])
@pytest.mark.parametrize("role", ["data", "labels", "budgets"])
def test_a_numpy_file_that_cannot_be_read_is_named_without_inviting_unpickling(tmp_path, make, match, role):
    """numpy's own message for these suggests allow_pickle=True, which would run code from the file."""
    np.save(tmp_path / "x.npy", np.ones((3, 2)))
    make(tmp_path / "bad.npy")
    load = {"data": lambda: datasets.load_numpy(tmp_path / "bad.npy"),
            "labels": lambda: datasets.load_numpy(tmp_path / "x.npy", labels=tmp_path / "bad.npy"),
            "budgets": lambda: datasets.read_budgets(tmp_path / "bad.npy")}[role]
    with pytest.raises(ValueError, match=f"{role} file '.*bad.npy' {match}") as caught:
        load()
    assert "allow_pickle" not in str(caught.value)


@pytest.mark.parametrize("vocab_size,max_length,name", [("100", 8, "vocab_size"), (None, 8, "vocab_size"),
                                                        (10.7, 8, "vocab_size"), (2, 8, "vocab_size"),
                                                        (100, 0, "max_length"), (100, -3, "max_length")])
def test_the_hashing_tokenizer_refuses_sizes_that_are_not_ints_in_range(vocab_size, max_length, name):
    with pytest.raises(ValueError, match=f"{name} must be an int ≥"):
        datasets.HashingTokenizer(vocab_size, max_length)


def test_the_hashing_tokenizer_refuses_one_string_that_it_would_read_letter_by_letter():
    with pytest.raises(TypeError, match="single string"):
        datasets.HashingTokenizer(100, 4)("hello")


@pytest.mark.parametrize("options,match", [(dict(max_length=0), "max_length must be an int ≥ 1"),
                                           (dict(tokenizer=0), "tokenizer \\(a hashing vocabulary size\\)"),
                                           (dict(tokenizer=2.5), "tokenizer must be None, a vocabulary size")])
def test_text_options_out_of_range_are_refused_not_replaced(tmp_path, options, match):
    """tokenizer=0 used to fall back to the default vocabulary, max_length=0 to fail inside torch."""
    (tmp_path / "t.csv").write_text("text,label\nthe plot,0\nthe actors,1\n")
    with pytest.raises((ValueError, TypeError), match=match):
        datasets.load_csv(tmp_path / "t.csv", label_column="label", text_column="text", **options)


@pytest.mark.parametrize("fraction,seed,error,match", [
    (0.5, -1, ValueError, "seed must be an int ≥ 0"), (0.5, "a", ValueError, "seed must be an int ≥ 0"),
    (0.5, 1.5, ValueError, "seed must be an int ≥ 0"), ("0.5", 0, TypeError, "--test-fraction"),
    (1.0, 0, ValueError, "--test-fraction\\) must lie in \\[0, 1\\)")])
def test_the_split_refuses_a_seed_or_fraction_numpy_would_misread(fraction, seed, error, match):
    data = datasets.TrainData(torch.zeros(4, 2), torch.zeros(4, dtype=torch.long), "features")
    with pytest.raises(error, match=match):
        datasets.train_test_split(data, fraction, seed)


@pytest.mark.parametrize("name,save", [("b.txt", lambda p: p.write_text("1\n2\n")),
                                       ("b.npy", lambda p: np.save(p, np.ones(2)))])
def test_a_budget_column_for_a_file_without_columns_is_refused_not_ignored(tmp_path, name, save):
    save(tmp_path / name)
    with pytest.raises(ValueError, match="--column 'eps' applies to a .csv or .npz file"):
        datasets.read_budgets(tmp_path / name, column="eps", column_option="--column")


@pytest.mark.parametrize("n", [-1, "2", 2.0])
def test_read_budgets_refuses_a_record_count_that_is_not_an_int(tmp_path, n):
    np.save(tmp_path / "b.npy", np.ones(2))
    with pytest.raises(ValueError, match="n must be an int ≥ 0"):
        datasets.read_budgets(tmp_path / "b.npy", n=n)


def test_a_budget_column_beside_an_image_folder_is_refused_before_the_images_load(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torchvision", None)       # the folder is never opened
    (tmp_path / "cats").mkdir()
    with pytest.raises(ValueError, match="--budget-column applies to CSV data"):
        datasets.load_data(tmp_path, budget_column="eps")


@pytest.mark.parametrize("shape,error,match", [((1.5, 1, 2), ValueError, r"shape\[0\] must be an int ≥ 1"),
                                               ((2, 0, 1), ValueError, r"shape\[1\] must be an int ≥ 1"),
                                               ((1, 2), ValueError, r"shape must have 3 entries \(C, H, W\)"),
                                               ("abc", TypeError, "shape must be a sequence of ints"),
                                               (2, TypeError, "shape must be a sequence of ints")])
def test_as_images_refuses_a_shape_that_is_not_three_positive_ints(shape, error, match):
    data = datasets.TrainData(torch.zeros(2, 2), torch.zeros(2, dtype=torch.long), "features")
    with pytest.raises(error, match=match):
        data.as_images(shape)
