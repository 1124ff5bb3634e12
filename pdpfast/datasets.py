"""User data for ``pdpfast train``: CSV, NumPy (.npy / .npz), image folders, Hugging Face datasets,
and per-record privacy budgets (a column, or a separate file).

Everything is loaded into memory as tensors (``TrainData``): features (N, d) float32, images
(N, C, H, W) float32 or token ids (N, T) int64, with labels (N,) int64 (class indices) and, when
given, budgets (N,) float64 ε_i > 0.

Optional dependencies stay optional: image folders need ``torchvision``, Hugging Face datasets need
``datasets``; without them the loader raises ImportError saying what to install.

Budgets are inputs, never derived from the data (DESIGN.md §3.2): they come from a column the
user filled in or a file, and are only checked (finite, > 0, one per record).
"""
from __future__ import annotations

import csv
import math
import os
import re
import warnings
import zipfile
import zlib
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch.utils.data import TensorDataset

from ._checks import check_budgets, check_choice, check_flag, check_in_range, check_int, check_sizes

__all__ = ["HashingTokenizer", "TrainData", "check_budgets", "load_csv", "load_data", "load_hf", "load_image_folder",
           "load_numpy", "read_budgets", "train_test_split"]

PAD_ID = 0
KINDS = ("features", "image", "tokens")
DEFAULT_MAX_LENGTH = 64     # tokens per text when no max_length is given


@dataclass
class TrainData:
    """In-memory records.

    Attributes:
        features: (N, ...) float32 (kind "features" or "image") or int64 token ids (kind "tokens").
        labels: (N,) int64 class indices (zeros for language modelling without labels).
        kind: "features", "image" or "tokens".
        budgets: (N,) float64 ε_i > 0, or None.
        class_names: the original label of each class index.
        vocab_size: 1 + the largest token id (tokens only).
        source: where the data came from.
    Raises:
        TypeError when features or labels are not tensors, or the labels not integers; ValueError when
        there are no records, features and labels differ in length, a label is negative, the kind is
        not one of ``KINDS``, or the budgets are not N finite values > 0.
    """

    features: torch.Tensor
    labels: torch.Tensor
    kind: str
    budgets: np.ndarray | None = None
    class_names: list = field(default_factory=list)
    vocab_size: int | None = None
    source: str = ""

    def __post_init__(self):
        where = f"{self.source}: " if self.source else ""
        for name in ("features", "labels"):
            value = getattr(self, name)
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor (torch.as_tensor(...)), got {type(value).__name__}")
        check_choice("kind", self.kind, KINDS)
        if self.features.dim() < 2:
            raise ValueError(f"{where}features must be (N, ...) with N records, got shape "
                             f"{tuple(self.features.shape)}")
        if self.labels.dim() != 1:
            raise ValueError(f"{where}labels must be (N,) class indices, got shape {tuple(self.labels.shape)}")
        if self.labels.is_floating_point() or self.labels.is_complex() or self.labels.dtype == torch.bool:
            raise TypeError(f"{where}labels must be integer class indices, got {self.labels.dtype}")
        if self.features.shape[0] != self.labels.shape[0]:
            raise ValueError(f"{where}labels must be one per record: features has {self.features.shape[0]} records, "
                             f"labels has {self.labels.shape[0]}")
        if self.features.shape[0] == 0:
            raise ValueError(f"{self.source}: no records")
        if int(self.labels.min()) < 0:
            raise ValueError(f"{where}labels must be class indices ≥ 0, got {int(self.labels.min())}")
        if self.budgets is not None:
            self.budgets = check_budgets(self.budgets, len(self), "budgets")

    def __len__(self) -> int:
        return int(self.features.shape[0])

    @property
    def input_shape(self) -> tuple:
        """One record's shape: ``features.shape[1:]``."""
        return tuple(self.features.shape[1:])

    @property
    def num_classes(self) -> int:
        """K: the number of class names, or 1 + the largest label if that is more."""
        return max(len(self.class_names), int(self.labels.max()) + 1 if len(self.labels) else 1)

    def dataset(self) -> TensorDataset:
        """The records as a torch dataset.

        Returns:
            a ``TensorDataset`` of (features, labels), yielding (x, y) per record (no copy).
        """
        return TensorDataset(self.features, self.labels)

    def subset(self, index) -> TrainData:
        """Some of the records, with their labels and budgets.

        Args:
            index: (M,) int indices of the records to keep (repeats allowed), in the order wanted, each in
                [0, N); or an (N,) bool mask of the records to keep.
        Returns:
            a new ``TrainData`` of M records; the other fields are shared.
        Raises:
            TypeError for indices that are not integers (floats would be truncated); ValueError for an index
            outside [0, N) (-1 is not read as the last record) or a mask of another length than N.
        """
        n = len(self)
        index = np.asarray(index.detach().cpu() if isinstance(index, torch.Tensor) else index)
        if index.dtype.kind == "b":
            if index.shape != (n,):
                raise ValueError(f"a boolean mask must have one entry per record ({n}), got shape {index.shape}")
            index = np.flatnonzero(index)
        elif index.size == 0:
            index = index.astype(np.int64)
        elif index.dtype.kind not in "iu":
            raise TypeError(f"index must be integer record indices or a boolean mask, got {index.dtype}")
        if index.ndim != 1:
            raise ValueError(f"index must be 1-D (M,) record indices, got shape {index.shape}")
        outside = (index < 0) | (index >= n)
        if outside.any():
            raise ValueError(f"index {int(index[outside][0])} is outside the records [0, {n})")
        index = index.astype(np.int64, copy=False)
        rows = torch.as_tensor(index)
        return replace(self, features=self.features[rows], labels=self.labels[rows],
                       budgets=None if self.budgets is None else self.budgets[index])

    def as_images(self, shape) -> TrainData:
        """View flat features (N, C·H·W) as images (N, C, H, W).

        Args:
            shape: (C, H, W), whose product is the number of features per record.
        Returns:
            a new ``TrainData`` of kind "image" (the features reshaped, no copy when they are contiguous).
        Raises:
            TypeError for a shape that is not a sequence; ValueError for token records, a shape that is not
            3 ints ≥ 1, or a product that does not match.
        """
        shape = check_sizes("shape", shape, length=3, form=" (C, H, W)")
        if self.kind not in ("features", "image") or math.prod(shape) != math.prod(self.input_shape):
            raise ValueError(f"cannot view records of shape {self.input_shape} as images of shape {shape} (C,H,W)")
        return replace(self, features=self.features.reshape(len(self), *shape), kind="image")


# ---------------------------------------------------------------------------------------------- budgets
# check_budgets (re-exported here, where users import it from) lives in pdpfast._checks
# a plain decimal number as people write one: Python's float() also reads '1_0' as 10 and other
# scripts' digits ('١'), which in data are typos rather than numbers (re.ASCII: \d is 0-9 only)
_PLAIN_NUMBER = re.compile(r"[+-]?(?:(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?|nan|inf|infinity)", re.ASCII | re.IGNORECASE)


def _plain_float(text: str) -> float | None:
    """The number ``text`` writes in plain decimal (surrounding blanks allowed), or None."""
    text = text.strip()
    return float(text) if _PLAIN_NUMBER.fullmatch(text) else None


def _python_reads_as_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def _number(text: str, what: str) -> float:
    value = _plain_float(text)
    if value is None:
        if _python_reads_as_number(text):
            raise ValueError(f"{what}: {text!r} is not a plain decimal number (digits 0-9, '.', an exponent; "
                             "no '_' separators): write it as one")
        raise ValueError(f"{what}: {text!r} is not a number")
    return value


def read_budgets(path, *, column: str | None = None, n: int | None = None,
                 column_option: str | None = None) -> np.ndarray:
    """Per-record budgets from a file.

    Args:
        path: .npy (1-D array), .npz (its only array, or ``column``), .csv (``column``, or the
            only column; a header row is detected) or .txt (one number per line).
        column: the CSV column (or .npz array); only those two formats have columns. n: the number of
            records they must match (None: any).
        column_option: the command-line option that names ``column``, for the messages (None: there
            is none, so a file must hold one column or array).
    Returns:
        (N,) float64 ε_i, each finite and > 0.
    Raises:
        FileNotFoundError for a missing path; ValueError for a file that cannot be read (not UTF-8 text,
        damaged or pickled NumPy data), a ``column`` beside a .npy / .txt file, an .npz of several arrays
        without a ``column`` naming one, a number not in plain decimal ('1_0'), a blank line before the
        last value (a missing budget: dropping it would shift every later record's budget), or budgets
        ``check_budgets`` refuses.
    """
    path = os.fspath(path)
    _check_file("budgets file", path)
    if n is not None:
        check_int("n", n, 0)
    ext = os.path.splitext(path)[1].lower()
    if column is not None and ext not in (".csv", ".npz"):
        raise ValueError(f"budgets file {path!r}: {column_option or 'column'} {column!r} applies to a .csv or .npz "
                         "file; this one holds a single list of budgets")
    try:
        if ext == ".npy":
            values = _np_load(path, "budgets file")
        elif ext == ".npz":
            with _np_load(path, "budgets file", archive=True) as z:
                # without a named column the .npz must hold one array: beside 'budgets', another one
                # (say 'budgets_v2') could be the real budgets, so it is refused rather than skipped
                key = column or (z.files[0] if len(z.files) == 1 else None)
                if key not in z.files:
                    raise ValueError(f"budgets file {path!r} has arrays {z.files}; " + (
                        f"name one with {column_option}" if column_option else
                        "a budgets .npz must hold one array (the budgets), nothing else"))
                values = _np_array(z, key, path, "budgets file")
        elif ext == ".csv":
            values = _csv_column(path, column, column_option)
        elif ext in (".txt", ""):
            with open(path, encoding="utf-8-sig") as f:     # a BOM is read as the CSV reader reads it
                lines = [line.strip() for line in f]
            last = max((i for i, line in enumerate(lines) if line), default=-1)
            _refuse_blank_line(path, lines[: last + 1], lambda i: i + 1)
            values = [_number(line, f"{path} line {i + 1}") for i, line in enumerate(lines[: last + 1])]
        else:
            raise ValueError(f"budgets file {path!r}: unsupported extension {ext!r} (use .npy, .npz, .csv or .txt)")
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise ValueError(f"budgets file {path!r} cannot be read: {exc}") from None
    except ValueError as exc:
        if "budgets file" in str(exc) or path in str(exc):
            raise
        raise ValueError(f"budgets file {path!r} cannot be read: {exc}") from None
    return check_budgets(values, n, f"budgets in {path!r}")


def _refuse_blank_line(path: str, lines, line_number) -> None:
    """A blank line before a budgets file's last value is a missing budget, not nothing: skipping it
    would give every later record its neighbour's ε."""
    blank = next((i for i, line in enumerate(lines) if not any(c.strip() for c in line)), None)
    if blank is not None:
        raise ValueError(f"{path} line {line_number(blank)} is blank: every record needs a budget (is one "
                         "missing?); only blank lines at the end are skipped")


def _csv_column(path: str, column: str | None, column_option: str | None = None) -> list[float]:
    header, rows = _read_csv(path, blank_is_missing=True)
    if header is None:          # no header: one number per row
        if column is not None:
            raise ValueError(f"{path}: no header row, so there is no column {column!r}")
        if rows and len(rows[0]) != 1:
            raise ValueError(f"{path}: {len(rows[0])} columns and no header; name the budget column")
        return [_number(r[0], f"{path} row {i + 1}") for i, r in enumerate(rows)]
    if column is None:
        if len(header) != 1:
            raise ValueError(f"{path} has columns {_columns(header)}; " + (
                f"name the budget column ({column_option})" if column_option else "give a file with one column"))
        column = header[0]
    if column not in header:
        raise ValueError(f"{path} has no column {column!r} (columns: {_columns(header)})")
    j = header.index(column)
    return [_number(r[j], f"{path} row {i + 2}, column {column!r}") if r[j].strip() else math.nan
            for i, r in enumerate(rows)]


def _shown(text: str) -> str:
    return repr(text.strip()) if text.strip() else "an empty value"


def _columns(names, show: int = 8) -> str:
    names = list(names)
    if len(names) <= show:
        return ", ".join(names)
    return ", ".join(names[: show - 2]) + f", ..., {', '.join(names[-2:])} ({len(names)} columns)"


def _check_file(kind: str, path: str) -> None:
    """FileNotFoundError unless ``path`` is a regular file, saying which it is not."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{kind} {path!r} does not exist")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{kind} {path!r} is not a regular file"
                                + (" (a directory)" if os.path.isdir(path) else ""))


def _read_csv(path: str, *, blank_is_missing: bool = False):
    """(header or None, rows): the first row is a header unless all of its fields are numbers.
    Blank lines are skipped (``blank_is_missing``: only at the end, where they mark no record).
    ValueError for a file that is not UTF-8 text, or a header naming a column twice."""
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            reader = csv.reader(f)
            lines = [(reader.line_num, r) for r in reader]
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} cannot be read: it is not UTF-8 text ({exc.reason} at byte {exc.start}); "
                         "save it as UTF-8") from None
    if blank_is_missing:
        last = max((i for i, (_, r) in enumerate(lines) if any(c.strip() for c in r)), default=-1)
        _refuse_blank_line(path, [r for _, r in lines[: last + 1]], lambda i: lines[i][0])
    rows = [r for _, r in lines if r and any(c.strip() for c in r)]
    if not rows:
        raise ValueError(f"{path} is empty")
    width = len(rows[0])
    for i, r in enumerate(rows):
        if len(r) != width:
            raise ValueError(f"{path} row {i + 1} has {len(r)} fields, the first row has {width}")

    # lenient on purpose: a first row '1_0' is data (then refused as not plain), not a header
    if all(_python_reads_as_number(c) for c in rows[0]):
        return None, rows
    header = [c.strip() for c in rows[0]]
    unnamed = next((j for j, h in enumerate(header) if not h), None)
    if unnamed is not None:
        # pandas' DataFrame.to_csv writes the row index as a first column with no name: read as a
        # feature, the model would train on the row number
        raise ValueError(f"{path}: column {unnamed + 1} of the header has no name" + (
            "; it looks like a pandas index column (DataFrame.to_csv writes one unless index=False): write the "
            "file with index=False, or drop that column" if unnamed == 0 else "; give every column a name"))
    twice = sorted({h for h in header if header.count(h) > 1})
    if twice:
        # one name for two columns: the later one would silently shadow the earlier
        raise ValueError(f"{path}: the header names column(s) {', '.join(map(repr, twice))} more than once; "
                         "give each column its own name")
    return header, rows[1:]


def _numpy_error(exc: Exception, what: str, path: str) -> ValueError:
    """numpy's error for a file it cannot load, as one naming the file. numpy's own advice for pickled
    data (allow_pickle=True) is not passed on: unpickling a file runs code from it."""
    text = str(exc)
    if "Object arrays" in text:
        why = "holds an array of Python objects (dtype=object), which is not loaded; save numbers or strings"
    elif "pickled" in text:
        why = "is not NumPy .npy/.npz data (a text file, a pickle or a damaged file?)"
    else:
        why = f"cannot be read as NumPy data ({type(exc).__name__}: {text})"
    return ValueError(f"{what} {path!r} {why}")


_NUMPY_ERRORS = (OSError, EOFError, ValueError, zipfile.BadZipFile, zlib.error)


def _np_load(path: str, what: str, *, archive: bool = False):
    """``np.load(path)`` without unpickling: an array (a .npy), or with ``archive`` an open ``NpzFile``
    (an .npz)."""
    try:
        loaded = np.load(path, allow_pickle=False)
    except _NUMPY_ERRORS as exc:
        raise _numpy_error(exc, what, path) from None
    if isinstance(loaded, np.ndarray) == archive:
        if archive:
            raise ValueError(f"{what} {path!r} holds one .npy array, not an .npz archive; name it .npy")
        loaded.close()
        raise ValueError(f"{what} {path!r} is an .npz archive, not a .npy array" + (
            "; name it .npz" if what == "data file" else ""))
    return loaded


def _np_array(npz, key: str, path: str, what: str) -> np.ndarray:
    """One array of an open .npz (read, and so checked, only here)."""
    try:
        return npz[key]
    except _NUMPY_ERRORS as exc:
        raise _numpy_error(exc, what, path) from None


# ---------------------------------------------------------------------------------------------- tokens
class HashingTokenizer:
    """Lower-cased words hashed (CRC32) into ids [2, vocab_size); 0 pads, 1 starts a sequence.

    For models built from a config with random weights no pretrained vocabulary exists, so any fixed
    map from words to ids works; hashing needs no download and no fitting on the data (a vocabulary
    fitted on the training set would be a function of the private data).

    Args:
        vocab_size: V, an int ≥ 3 (ids 0 and 1 are reserved); max_length: T, an int ≥ 1, the tokens
            kept per text (the start token included).
    Raises:
        ValueError for either outside its range, or not an int.
    """

    def __init__(self, vocab_size: int, max_length: int = 64):
        self.vocab_size = check_int("vocab_size", vocab_size, 3)
        self.max_length = check_int("max_length", max_length, 1)

    def __call__(self, texts) -> torch.Tensor:
        """Token ids of each text.

        Args:
            texts: a sequence of N strings (one string alone is refused: it is not N texts).
        Returns:
            (N, T) int64 ids, padded with ``PAD_ID``.
        """
        if isinstance(texts, (str, bytes)):
            raise TypeError("texts must be a sequence of texts, got a single string (wrap it in a list)")
        out = torch.full((len(texts), self.max_length), PAD_ID, dtype=torch.int64)
        for i, text in enumerate(texts):
            ids = [1] + [2 + zlib.crc32(w.encode()) % (self.vocab_size - 2)
                         for w in re.findall(r"\w+|[^\w\s]", str(text).lower())]
            ids = ids[: self.max_length]
            out[i, : len(ids)] = torch.tensor(ids)
        return out


def _tokenize(texts, tokenizer, max_length: int):
    if tokenizer is None:
        return HashingTokenizer(30522, max_length)(texts)
    if isinstance(tokenizer, (int, np.integer)):       # bools are refused by check_int
        return HashingTokenizer(check_int("tokenizer (a hashing vocabulary size)", tokenizer, 3), max_length)(texts)
    if callable(tokenizer) and not isinstance(tokenizer, str):
        return tokenizer(texts)
    if not isinstance(tokenizer, str):
        raise TypeError("tokenizer must be None, a vocabulary size (int), a callable or a Hugging Face tokenizer "
                        f"name, got {type(tokenizer).__name__} {tokenizer!r}")
    from transformers import AutoTokenizer  # a named Hugging Face tokenizer (may download)

    tok = AutoTokenizer.from_pretrained(tokenizer)
    return tok(list(map(str, texts)), padding="max_length", truncation=True, max_length=max_length,
               return_tensors="pt")["input_ids"]


def _labels(values, what: str):
    """(labels (N,) int64, class names) from N labels as read (numbers or names).

    Integer labels are class indices as they are when they are ≥ 0 and the largest, M, is below twice
    the number K of distinct labels (so at most half of the M + 1 classes have no record: 1-based
    labels, a class absent from the data). Other integers (a negative one, or M ≥ 2K: say a stray
    9999 among 0 and 1) are mapped to their rank among the sorted distinct values, with a warning
    naming them, as names always are; ``class names`` holds each index's original label. Numbers that
    are not whole (a regression target) are refused, as are a missing or non-finite one (NaN, inf;
    the message names its record) and a number Python reads but that is not written in plain decimal
    ('1_0').
    """
    values = [str(v).strip() for v in values]
    if not values:
        return torch.zeros(0, dtype=torch.int64), []     # TrainData then says "no records"
    if any(v == "" for v in values):
        raise ValueError(f"{what} has an empty label at record {values.index('')}")
    numbers = [_plain_float(v) for v in values]
    if None in numbers:
        if all(_python_reads_as_number(v) for v in values):
            odd = values[numbers.index(None)]
            raise ValueError(f"{what}: {odd!r} is not a plain decimal number (digits 0-9, '.', an exponent; no '_' "
                             "separators): write it as one")
        names = sorted(set(values))
        index = {v: j for j, v in enumerate(names)}
        return torch.tensor([index[v] for v in values], dtype=torch.int64), names
    missing = next((i for i, x in enumerate(numbers) if not math.isfinite(x)), None)
    if missing is not None:     # NaN is how a float array marks a missing label: not a regression target
        raise ValueError(f"{what} has a missing or non-finite label at record {missing} ({values[missing]}); every "
                         "record needs a class label")
    fractional = next((v for v, x in zip(values, numbers) if x != round(x)), None)
    if fractional is not None:
        # numbers that are not whole are a regression target, not class names: as classes, N
        # records would silently become up to N classes of one record each
        raise ValueError(f"{what} are not class labels: {fractional!r} is not an integer "
                         f"({len(set(numbers))} distinct values); pdpfast train classifies, it does not do "
                         "regression: give integer or named classes (e.g. bin the target)")
    ints = [int(x) for x in numbers]
    distinct = sorted(set(ints))
    if distinct[0] >= 0 and distinct[-1] < 2 * len(distinct):
        return torch.tensor(ints, dtype=torch.int64), [str(i) for i in range(distinct[-1] + 1)]
    # one rule for every size (no cliff at some largest label): a label far above the others would
    # otherwise make as many outputs as its value, most of them classes without a record
    largest = distinct[-1]
    why = (f"negative labels are not class indices (the smallest is {distinct[0]})" if distinct[0] < 0 else
           f"the largest, {largest}, would make {largest + 1} classes for {len(distinct)} distinct labels")
    warnings.warn(f"{what}: integer labels {_columns(map(str, distinct))} are not class indices 0..K-1 ({why}); "
                  f"they are mapped in sorted order to class indices 0..{len(distinct) - 1}. The largest label "
                  f"{largest} is held by {ints.count(largest)} of {len(ints)} records: if a label is a typo, fix "
                  "the data", stacklevel=3)
    index = {v: j for j, v in enumerate(distinct)}
    return torch.tensor([index[i] for i in ints], dtype=torch.int64), [str(v) for v in distinct]


# ---------------------------------------------------------------------------------------------- loaders
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _check_features(matrix: np.ndarray, place, *, tokens: bool = False) -> None:
    """ValueError naming the first feature that is NaN or ±inf, or (unless ``tokens``) beyond float32's
    range: features are stored as float32, so 1e39 would silently become inf after the check.

    Args:
        matrix: (N, ...) numbers as read; place: index tuple → where that value is, for the message.
    """
    with np.errstate(invalid="ignore", over="ignore"):
        bad = ~np.isfinite(matrix)
        if not tokens and matrix.dtype.kind == "f":
            bad |= np.abs(matrix) > _FLOAT32_MAX
    if bad.any():
        index = tuple(int(i) for i in np.argwhere(bad)[0])
        value = float(matrix[index])
        why = ("features must be finite numbers" if not math.isfinite(value) or tokens else
               f"features must be finite numbers within float32's range (|x| ≤ {_FLOAT32_MAX:.4g}): they are "
               "stored as float32, where this would become inf")
        raise ValueError(f"{place(index)}: {value:g} is not allowed; {why}")


def _check_distinct_columns(source: str, **columns) -> None:
    """ValueError when one column is named for two roles (label and budget: each record's class would
    also be its ε)."""
    named = [(role, col) for role, col in columns.items() if col is not None]
    for a, (role_a, col_a) in enumerate(named):
        for role_b, col_b in named[a + 1:]:
            if col_a == col_b:
                raise ValueError(f"{source}: the {role_a.replace('_', ' ')} and the {role_b.replace('_', ' ')} are "
                                 f"the same column {col_a!r}; each role needs its own column")
def load_csv(path, *, label_column: str | None, budget_column: str | None = None, text_column: str | None = None,
             tokens: bool = False, tokenizer=None, max_length: int = 64) -> TrainData:
    """A CSV file with a header row.

    Args:
        path: the file. label_column: the labels (None: no labels, language modelling).
        budget_column: per-record ε_i (optional). text_column: a text column tokenized into token
            ids (``tokenizer``: None → :class:`HashingTokenizer`, an int vocabulary size, a
            callable, or a Hugging Face tokenizer name; ``max_length`` tokens per record).
        tokens: the feature columns are integer token ids (N, T) rather than numbers.
    Returns:
        ``TrainData``: features (N, D) float32 from every other column (all numeric), or token
        ids (N, T) int64; labels (N,) int64; budgets (N,) float64 or None.
    Raises:
        FileNotFoundError for a missing file; ValueError for a file that is not UTF-8 text, a header
        naming a column twice or leaving one unnamed (pandas' index column), one column named for two
        roles, a missing column, a value that is not a plain decimal number, a feature that is not finite
        within float32's range, ``max_length`` < 1.
    """
    path = os.fspath(path)
    check_int("max_length", max_length, 1)
    check_flag("tokens", tokens)
    _check_file("data file", path)
    _check_distinct_columns(path, label_column=label_column, budget_column=budget_column, text_column=text_column)
    header, rows = _read_csv(path)
    if header is None:
        raise ValueError(f"{path} needs a header row naming its columns")
    for name, col in (("label", label_column), ("budget", budget_column), ("text", text_column)):
        if col is not None and col not in header:
            raise ValueError(f"{path} has no {name} column {col!r} (columns: {_columns(header)})")
    if not rows:
        raise ValueError(f"{path} has a header but no records")
    n = len(rows)
    columns = {h: [r[j] for r in rows] for j, h in enumerate(header)}
    used = {label_column, budget_column, text_column}
    feature_names = [h for h in header if h not in used]
    budgets = None
    if budget_column is not None:
        budgets = [_number(v, f"{path} row {i + 2}, column {budget_column!r}") if v.strip() else math.nan
                   for i, v in enumerate(columns[budget_column])]
        bad = [i for i, b in enumerate(budgets) if not (math.isfinite(b) and b > 0)]
        if bad:
            raise ValueError(f"budget column {budget_column!r} of {path}, row {bad[0] + 2}: "
                             f"{_shown(columns[budget_column][bad[0]])} is not a budget ε > 0")
        budgets = check_budgets(budgets, n, f"budget column {budget_column!r} of {path}")
    if label_column is not None:
        labels, names = _labels(columns[label_column], f"label column {label_column!r} of {path}")
    else:
        labels, names = torch.zeros(n, dtype=torch.int64), []
    if text_column is not None:
        features = _tokenize(columns[text_column], tokenizer, max_length)
        return TrainData(features, labels, "tokens", budgets, names, int(features.max()) + 1, path)
    if not feature_names:
        raise ValueError(f"{path}: no feature columns besides the label/budget columns")
    matrix = np.empty((n, len(feature_names)), dtype=np.float64)
    for j, h in enumerate(feature_names):
        for i, v in enumerate(columns[h]):
            if not v.strip():
                raise ValueError(f"{path} row {i + 2}, column {h!r}: missing value")
            matrix[i, j] = _number(v, f"{path} row {i + 2}, column {h!r}")
    _check_features(matrix, lambda at: f"{path} row {at[0] + 2}, column {feature_names[at[1]]!r}", tokens=tokens)
    return _from_matrix(matrix, labels, names, budgets, tokens, path)


def _from_matrix(matrix: np.ndarray, labels, names, budgets, tokens: bool, source: str) -> TrainData:
    if tokens:
        if not np.array_equal(matrix, np.round(matrix)) or matrix.min() < 0:
            raise ValueError(f"{source}: token ids must be integers ≥ 0 (for bert/gpt2/llama models every feature "
                             "column is one token position)")
        ids = torch.as_tensor(matrix.reshape(matrix.shape[0], -1), dtype=torch.int64)
        return TrainData(ids, labels, "tokens", budgets, names, int(ids.max()) + 1, source)
    kind = "image" if matrix.ndim == 4 else "features"
    return TrainData(torch.as_tensor(matrix, dtype=torch.float32), labels, kind, budgets, names, None, source)


def load_numpy(path, *, labels=None, tokens: bool = False) -> TrainData:
    """Records from numpy files (read without unpickling: arrays of numbers, or strings for labels).

    Args:
        path: .npy features (N, ...), or an .npz holding ``x`` (or ``features`` / ``X``), ``y`` (or
            ``labels``) and optionally ``budgets``, and nothing else. labels: a .npy of (N,) labels
            (1-D: integers, whole reals or strings) for a .npy path.
        tokens: read integer token ids (N, T).
    Returns:
        ``TrainData`` ((N, C, H, W) arrays are images).
    Raises:
        FileNotFoundError for a missing file; ValueError for a file numpy cannot read (damaged, not
        NumPy data, arrays of Python objects), an .npz holding two names for one array (``x`` and
        ``X``, ``y`` and ``labels``) or arrays that are not read, ``labels`` beside an .npz, no records,
        features that are not finite real numbers within float32's range (complex ones too), or labels
        that are not 1-D (N,) (an (N, 1) column too), not one per record (the message names the labels
        file) or missing or non-finite (NaN; the message names the record); TypeError for labels of
        dtype bool, complex or other than integers, reals and strings.
    """
    path = os.fspath(path)
    check_flag("tokens", tokens)
    _check_file("data file", path)
    budgets = y = None
    if path.endswith(".npz"):
        if labels is not None:
            raise ValueError(f"labels applies to a .npy path; the .npz {path!r} holds its own labels (as 'y')")
        with _np_load(path, "data file", archive=True) as z:
            keys = _npz_keys(path, z.files)
            x = _np_array(z, keys["x"], path, "data file")
            if "y" in keys:
                y = _np_array(z, keys["y"], path, "data file")
            if "budgets" in keys:
                budgets = _np_array(z, "budgets", path, "data file")
    else:
        x = _np_load(path, "data file")
    if labels is not None:
        _check_file("labels file", os.fspath(labels))
        y = _np_load(os.fspath(labels), "labels file")
    if x.ndim < 2:
        raise ValueError(f"{path}: features must be (N, ...) with N records, got shape {x.shape}")
    if x.shape[0] == 0:
        raise ValueError(f"{path}: no records")
    if x.dtype.kind not in "iuf":           # complex ones would lose their imaginary part
        raise ValueError(f"{path}: features must be finite real numbers, got dtype {x.dtype}")
    _check_features(x, lambda at: f"{path} record {at[0]}, " + (
        f"column {at[1]}" if len(at) == 2 else f"index {at}"), tokens=tokens)
    if y is None:
        y_t, names = torch.zeros(x.shape[0], dtype=torch.int64), []
    else:
        where = f"labels of {path}" if labels is None else f"labels file {os.fspath(labels)!r}"
        _check_label_array(y, where)
        if y.shape[0] != x.shape[0]:
            # a labels file of another length is that file's fault, not the data's
            raise ValueError(f"{path}: {x.shape[0]} records but {y.shape[0]} labels" if labels is None else
                             f"{where} has {y.shape[0]} labels for the {x.shape[0]} records of {path}; give one "
                             "label per record")
        y_t, names = _labels(y.tolist(), where)
    if budgets is not None:
        budgets = check_budgets(budgets, x.shape[0], f"budgets in {path}")
    return _from_matrix(x.astype(np.float64) if tokens else x.astype(np.float32), y_t, names, budgets, tokens, path)


def _check_label_array(y: np.ndarray, where: str) -> None:
    """Labels as NumPy stores them: a 1-D (N,) array of integers, whole reals or names (strings). An
    (N, 1) column or an (N/2, 2) table is refused rather than flattened (flattening a table pairs
    records with other records' labels); booleans and complex numbers are not class labels."""
    if y.ndim != 1:
        raise ValueError(f"{where} must be a 1-D array (N,) of labels, one per record, got shape {y.shape}"
                         + (" (use y.ravel() for an (N, 1) column)" if y.ndim == 2 and y.shape[1] == 1 else ""))
    if y.dtype.kind not in "iufUS":
        raise TypeError(f"{where} must be integer class labels (or whole reals, or names as strings), got dtype "
                        f"{y.dtype}")


_NPZ_NAMES = {"x": ("x", "features", "X"), "y": ("y", "labels"), "budgets": ("budgets",)}


def _npz_keys(path: str, files) -> dict:
    """Which array of an .npz holds each of x, y, budgets ({"x": "features", ...}); every array must be
    one of them, each named once."""
    keys = {}
    for role, names in _NPZ_NAMES.items():
        found = [k for k in names if k in files]
        if len(found) > 1:
            raise ValueError(f"{path} holds both {' and '.join(map(repr, found))}, two names for the same "
                             f"{'features' if role == 'x' else role}; keep one")
        if found:
            keys[role] = found[0]
    if "x" not in keys:
        raise ValueError(f"{path} must hold an array named 'x' (or 'features'); it has {files}")
    unread = [k for k in files if k not in keys.values()]
    if unread:
        read = ", ".join(repr(k) for names in _NPZ_NAMES.values() for k in names)
        raise ValueError(f"{path} holds arrays {unread} that would not be read; an .npz is read for {read} only")
    return keys


def load_image_folder(path, *, image_size: int = 32) -> TrainData:
    """Images in torchvision's ImageFolder layout.

    Args:
        path: ``path/<class>/<image>``; image_size: the side S they are resized to.
    Returns:
        ``TrainData``: images (N, 3, S, S) float32 RGB in [0, 1], labels (N,) class indices.
    Raises:
        FileNotFoundError for a path that is not a directory (checked before torchvision is needed);
        ImportError without torchvision; ValueError for a folder not in that layout.
    """
    check_int("image_size", image_size, 1)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"image folder {os.fspath(path)!r} does not exist or is not a directory")
    try:
        from torchvision import datasets as tv_datasets
        from torchvision import transforms
    except ImportError:
        raise ImportError("image folders need torchvision, which is not installed (pip install torchvision)") from None
    transform = transforms.Compose([transforms.Lambda(lambda im: im.convert("RGB")),
                                    transforms.Resize((image_size, image_size)), transforms.ToTensor()])
    try:
        folder = tv_datasets.ImageFolder(os.fspath(path), transform=transform)
    except (FileNotFoundError, RuntimeError) as exc:
        raise ValueError(f"{path}: not an image folder ({str(exc).splitlines()[0]})") from None
    xs, ys = zip(*(folder[i] for i in range(len(folder))))
    return TrainData(torch.stack(xs), torch.tensor(ys, dtype=torch.int64), "image", None, list(folder.classes),
                     None, os.fspath(path))


def load_hf(name: str, *, split: str = "train", config: str | None = None, label_column: str | None = "label",
            text_column: str | None = None, budget_column: str | None = None, tokenizer=None,
            max_length: int = 64, limit: int | None = None) -> TrainData:
    """A Hugging Face dataset (``datasets.load_dataset(name, config, split=split)``), its records in the
    split's row order (the order a ``--budgets`` file follows).

    Args:
        name, split, config: of ``load_dataset``. label_column: the labels (None: none). The default,
            "label", is read when the dataset has it; without it the records have no labels (a text-only
            dataset, for a language model). A ``ClassLabel`` column keeps its class indices and names.
            text_column, budget_column, tokenizer, max_length: as in :func:`load_csv`. limit: the first
            ``limit`` records only.
    Returns:
        ``TrainData``: text columns tokenized; an ``input_ids`` column used as is; otherwise every
        numeric column other than the label / budget columns a feature.
    Raises:
        ImportError without ``datasets``; ValueError for a missing column, one column named for two
        roles, a ``ClassLabel`` label outside its classes (-1, Hugging Face's "no label" in test splits,
        included), or features that are not finite numbers within float32's range.
    """
    check_int("max_length", max_length, 1)
    if limit is not None:
        check_int("limit", limit, 1)
    try:
        import datasets as hf_datasets
    except ImportError:
        raise ImportError("--hf-dataset needs the Hugging Face `datasets` package, which is not installed "
                          "(pip install datasets)") from None
    _check_distinct_columns(f"dataset {name!r}", label_column=label_column, budget_column=budget_column,
                            text_column=text_column)
    ds = hf_datasets.load_dataset(name, config, split=split)
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
    columns = list(ds.column_names)
    if label_column == "label" and "label" not in columns:
        label_column = None         # the default: a dataset without labels (language modelling)
    for what, col in (("label", label_column), ("budget", budget_column), ("text", text_column)):
        if col is not None and col not in columns:
            raise ValueError(f"dataset {name!r} has no {what} column {col!r} (columns: {_columns(columns)})")
    if text_column is None and "input_ids" not in columns:
        text_column = next((c for c in ("text", "sentence", "content") if c in columns), None)
    n = len(ds)
    source = f"hf:{name}" + (f"/{config}" if config else "") + f"[{split}]"
    budgets = None if budget_column is None else check_budgets(ds[budget_column], n,
                                                               f"budget column {budget_column!r} of {source}")
    if label_column is not None:
        what = f"label column {label_column!r} of {source}"
        schema = getattr(ds, "features", None) or {}
        feature = schema.get(label_column)
        if feature is not None and hasattr(feature, "names"):
            labels, names = _class_label(ds[label_column], list(feature.names), what)
        else:
            labels, names = _labels(ds[label_column], what)
    else:
        labels, names = torch.zeros(n, dtype=torch.int64), []
    if "input_ids" in columns and text_column is None:
        rows = ds["input_ids"]
        ids = torch.full((n, max_length), PAD_ID, dtype=torch.int64)
        for i, r in enumerate(rows):
            r = list(r)[:max_length]
            ids[i, : len(r)] = torch.tensor(r, dtype=torch.int64)
        return TrainData(ids, labels, "tokens", budgets, names, int(ids.max()) + 1 if n else None, source)
    if text_column is not None:
        features = _tokenize(ds[text_column], tokenizer, max_length)
        return TrainData(features, labels, "tokens", budgets, names, int(features.max()) + 1 if n else None, source)
    feats = [c for c in columns if c not in (label_column, budget_column)]
    if not feats:
        raise ValueError(f"{source}: no feature columns")
    try:
        blocks = [np.asarray(ds[c], dtype=np.float64).reshape(n, -1) for c in feats]
    except (TypeError, ValueError):
        raise ValueError(f"{source}: columns {feats} are not all numeric; name a text column (--text-column)") from None
    owner = [c for c, block in zip(feats, blocks) for _ in range(block.shape[1])]     # flat position → column
    matrix = np.concatenate(blocks, axis=1)
    _check_features(matrix, lambda at: f"{source} record {at[0]}, column {owner[at[1]]!r}")
    return _from_matrix(matrix, labels, names, budgets, False, source)


def _class_label(values, names: list, what: str):
    """A Hugging Face ``ClassLabel`` column: its integers already are class indices into ``names`` (no
    remapping, which would shift the names off their classes); one outside [0, K) is refused."""
    labels = np.asarray(values)
    if labels.size and labels.dtype.kind not in "iu":
        raise ValueError(f"{what}: a ClassLabel column must hold integer class indices, got {labels.dtype}")
    labels = labels.astype(np.int64).reshape(-1)
    outside = (labels < 0) | (labels >= len(names))
    if outside.any():
        i = int(np.flatnonzero(outside)[0])
        raise ValueError(f"{what} holds {int(labels[i])} at record {i} ({int(outside.sum())} records in all), outside "
                         f"its ClassLabel classes 0..{len(names) - 1} ({_columns(names)}); -1 means unlabelled in "
                         "Hugging Face datasets (e.g. a GLUE test split): use a labelled split (--hf-split) or drop "
                         "the unlabelled rows")
    return torch.as_tensor(labels), names


def load_data(data=None, *, labels=None, hf_dataset=None, label_column=None, budget_column=None, budgets=None,
              text_column=None, tokens=False, tokenizer=None, max_length=None, image_size=32, hf_split=None,
              hf_config=None, lm=False) -> TrainData:
    """Load records by what ``data`` is (a directory → image folder, .csv, .npy/.npz) or from
    ``hf_dataset``, then attach budgets from ``budgets`` (a file) when given.

    Args:
        data / hf_dataset: where the records are; the other arguments as in the loaders above
            (``hf_split`` None: "train"). lm: the records feed a language model, which reads no
            labels: a Hugging Face dataset's "label" column is not read (nor its -1 "no label" refused).
    Returns:
        ``TrainData`` (budgets None when none were given).
    Raises:
        ValueError for budgets given twice, or for an argument the source does not read (``labels``
        beside anything but a .npy, a column beside anything but a CSV or a Hugging Face dataset, a
        tokenizer name or ``max_length`` without text, ``hf_split`` / ``hf_config`` beside ``data``):
        nothing given is ignored. ``max_length`` None: 64 tokens per text.
    """
    if (data is None) == (hf_dataset is None):
        raise ValueError("give exactly one of --data and --hf-dataset")
    ext = "" if data is None else os.path.splitext(os.fspath(data))[1].lower()
    unread = {"--labels": (labels, "a .npy --data (an .npz holds its labels as y, a CSV in --label-column)",
                           ext == ".npy"),
              "--label-column": (label_column, "CSV or Hugging Face data", ext == ".csv" or data is None),
              "--text-column": (text_column, "CSV or Hugging Face data", ext == ".csv" or data is None),
              "--tokenizer": (tokenizer if isinstance(tokenizer, str) else None,      # a name; ints are defaults
                              "text (a CSV's --text-column, or a Hugging Face dataset)",
                              data is None or (ext == ".csv" and text_column is not None)),
              "--max-length": (max_length, "text (a CSV's --text-column, or a Hugging Face dataset)",
                               data is None or (ext == ".csv" and text_column is not None)),
              "--hf-split": (hf_split, "--hf-dataset", data is None),
              "--hf-config": (hf_config, "--hf-dataset", data is None)}
    for option, (value, where, read) in unread.items():
        if value is not None and not read:
            raise ValueError(f"{option} applies to {where}; it would be ignored here")
    max_length = DEFAULT_MAX_LENGTH if max_length is None else max_length
    if budget_column is not None and data is not None and ext != ".csv":    # checked before an image folder loads
        raise ValueError("--budget-column applies to CSV data; use --budgets FILE for other data")
    if hf_dataset is not None:
        default = None if lm else "label"
        out = load_hf(hf_dataset, split=hf_split or "train", config=hf_config, label_column=label_column or default,
                      text_column=text_column, budget_column=budget_column, tokenizer=tokenizer, max_length=max_length)
    else:
        path = os.fspath(data)
        if os.path.isdir(path):
            out = load_image_folder(path, image_size=image_size)
        elif ext == ".csv":
            out = load_csv(path, label_column=label_column, budget_column=budget_column, text_column=text_column,
                           tokens=tokens, tokenizer=tokenizer, max_length=max_length)
        elif ext in (".npy", ".npz"):
            out = load_numpy(path, labels=labels, tokens=tokens)
        elif not os.path.exists(path):
            raise FileNotFoundError(f"data {path!r} does not exist")
        else:
            raise ValueError(f"data {path!r}: unsupported format (use .csv, .npy, .npz or an image folder)")
    if budgets is not None:
        if out.budgets is not None:
            raise ValueError("budgets given twice (a budget column or array in the data, and --budgets)")
        out.budgets = read_budgets(budgets, n=len(out))
    return out


def train_test_split(data: TrainData, test_fraction: float, seed: int = 0):
    """A seeded random split that depends only on (N, seed), never on the records' values.

    Args:
        data: N records; test_fraction: in [0, 1) (0: no test set); seed: of the split.
    Returns:
        (train, test or None), ``TrainData`` each, budgets split with their records.
    Raises:
        TypeError for ``data`` that is not a ``TrainData``; ValueError (naming --test-fraction, which sets
        it) for a fraction outside [0, 1) or one that leaves no training record, or a seed that is not an
        int ≥ 0.
    """
    if not isinstance(data, TrainData):
        raise TypeError(f"data must be a TrainData (from load_data), got {type(data).__name__}")
    check_in_range("test fraction (--test-fraction)", test_fraction, low=0.0, high=1.0, low_open=False,
                   high_open=True)
    check_int("seed", seed, 0)
    n = len(data)
    n_test = int(round(test_fraction * n))
    if n_test == 0:
        return data, None
    if n - n_test < 1:
        raise ValueError(f"test fraction {test_fraction} leaves no training records out of {n}")
    perm = np.random.default_rng([seed, 0x7E57]).permutation(n)
    return data.subset(np.sort(perm[n_test:])), data.subset(np.sort(perm[:n_test]))
