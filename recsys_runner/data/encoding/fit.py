"""A schema completed from a sample of the files: what the data config leaves open, decided when training starts.

When ``data=csv`` / ``data=parquet`` get no ``data.dense`` / ``data.sparse`` (and no ``data.schema`` file, nor a
schema stored by ``convert``), the data module reads ``data.infer.sample_rows`` rows (:attr:`InferConfig.sample_rows`: in
pieces spread over the files) and infers the label and
each column's role (:mod:`recsys_runner.data.encoding.roles`). With or without a column list, it then fits what the
columns leave open: a ``zscore`` column's mean and std, a ``quantiles`` column's boundaries, a ``vocab_file``'s
vocabulary, and each sparse feature's **rows** (``num_embeddings``; also for ``data.sparse`` entries without one and
``data=criteo data.num_embeddings=null``):

* when the sample covers the column (it holds every row of the files, or the values seen once in it make up at
  most ``data.infer.max_unseen_fraction`` of its values: Good–Turing's estimate of the share of later values it
  has not seen) → ``encoding: vocab``: a row per distinct value of the sample plus ``data.infer.oov_buckets`` rows
  that every other value is hashed into (:class:`~recsys_runner.data.encoding.vocabulary.Vocabulary`), so an id unseen in
  training never shares a row with one seen in training;
* otherwise (a column with more values than the sample shows) → ``encoding: hash`` (``mod`` for ``hex``): the
  distinct values in the sample times ``data.infer.bucket_margin`` (room for values the sample missed, fewer hash
  collisions), rounded up to 1, 2 or 5 × 10^k (at least 4).

The result is logged as a schema file (:func:`~recsys_runner.data.schema_files.schema_yaml`): save it, edit it and
pass ``data.schema=<file>`` to train with exactly that schema (``convert --schema`` reads the same form).
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from recsys_runner.data.encoding.keys import as_ids, value_keys
from recsys_runner.data.encoding.roles import detect_label, infer_columns
from recsys_runner.data.encoding.sparse_ids import float_ids
from recsys_runner.data.encoding.values import dense_transformed, is_list, parse_numbers, split_pairs
from recsys_runner.data.encoding.vocab_file import read_vocab_file
from recsys_runner.data.encoding.vocabulary import Vocabulary
from recsys_runner.data.schema import DenseColumn, Schema, SparseColumn
from recsys_runner.errors import ConfigError, DataError, require
from recsys_runner.features import SequenceGroup

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class InferConfig:
    """``data.infer``: how a schema is inferred from the files (see :mod:`recsys_runner.data.encoding.fit`)."""

    sample_rows: int = 100_000
    """Rows read to infer column roles and fit what the columns leave open (table sizes, encodings, vocabularies, zscore
    statistics, quantile boundaries): taken as many short runs evenly spaced over the files
    (:mod:`recsys_runner.data.files.spread_sample`: byte spans of plain text, runs over Parquet row groups), so that
    files sorted by time give later rows too; of compressed text, each file's first rows (its later lines are reached
    only by decompressing every line before them; a single such file is said in a warning); every row where the files
    hold no more."""
    bucket_margin: float = 2.0
    """A sized sparse feature gets ``distinct values in the sample × this`` buckets (rounded up to 1/2/5 × 10^k):
    room for values the sample missed and fewer hash collisions."""
    dense_min_distinct_fraction: float = 0.5
    """An integer column is dense (a count, a measurement) when more than this fraction of its sampled values
    are distinct; otherwise it is categorical (ids, codes), hashed into a sized table."""
    exclude: list[str] = field(default_factory=list)
    """Columns never used as features (e.g. ``[id]``)."""
    separators: list[str] = field(default_factory=lambda: ["|"])
    """Characters that split a text field into several values (a multi-hot feature, e.g. ``Action|Comedy``)."""
    oov_buckets: int = 16
    """Out-of-vocabulary rows of a column given a vocabulary (``encoding: vocab``): every value the sample did not
    hold (a cold-start user, an item new in the eval data) is hashed into one of them, apart from the rows of the
    values seen in training."""
    max_unseen_fraction: float = 0.05
    """An unsized id column gets a vocabulary when the sample covers it: the sample holds every row of the files, or
    values seen once make up at most this share of its sampled values (the estimated share of later values that are
    not in the sample). Otherwise it is hashed into ``distinct × bucket_margin`` rows; ``0``: only a sample of
    every row gives vocabularies, ``1``: always."""

    def __post_init__(self) -> None:
        require(self.sample_rows > 0, f"data.infer.sample_rows must be positive, got {self.sample_rows}")
        require(self.bucket_margin >= 1, f"data.infer.bucket_margin must be >= 1, got {self.bucket_margin}. Fix: data.infer.bucket_margin=2")
        require(0 < self.dense_min_distinct_fraction <= 1,
                f"data.infer.dense_min_distinct_fraction must lie in (0, 1], got {self.dense_min_distinct_fraction}")
        require(all(len(s) == 1 for s in self.separators), f"data.infer.separators must be single characters, got {self.separators}")
        require(self.oov_buckets >= 1, f"data.infer.oov_buckets must be at least 1, got {self.oov_buckets}. Fix: data.infer.oov_buckets=16")
        require(0 <= self.max_unseen_fraction <= 1, f"data.infer.max_unseen_fraction must lie in [0, 1], got {self.max_unseen_fraction}")


def bucket_count(distinct: int, margin: float) -> int:
    """``distinct × margin`` rounded up to 1, 2 or 5 × 10^k, at least 4: a table size that reads well and leaves room."""
    target = max(4, math.ceil(distinct * margin))
    power = 10 ** int(math.floor(math.log10(target)))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= target)


def _text(arr: pa.Array) -> bool:
    return pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)


def _flat_values(arr: pa.Array, separator: str | None) -> pa.Array:
    """The non-null values of a column, lists flattened and text split at ``separator``."""
    if separator is not None and _text(arr):
        arr = pc.split_pattern(arr, separator)
    if pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type):
        arr = pc.list_flatten(arr)
    arr = as_ids(arr.drop_null())
    return pc.filter(arr, pc.not_equal(arr, "")) if _text(arr) else arr


@dataclass
class Inferred:
    """A schema completed from a sample: the schema, what was inferred (for the log), and why columns were left out."""

    schema: Schema
    inferred: list[str]
    notes: list[str]

    def summary(self) -> str:
        """:attr:`inferred` for the log, ``; ``-joined, with a run of three or more columns that got the same said once
        (``26 columns cat_0 … cat_25: num_embeddings=516 (vocabulary of 500 + 16 OOV rows) each``): a Criteo file's 26
        alike lines made one line of ~1800 characters, and the schema printed under it lists every column anyway."""
        runs: list[tuple[list[str], str]] = []
        for line in self.inferred:
            name, _, rest = line.partition(" ")
            if runs and rest and runs[-1][1] == rest:
                runs[-1][0].append(name)
            else:
                runs.append(([name], rest))
        said = [f"{len(names)} columns {names[0]} … {names[-1]}: {rest} each" if len(names) > 2
                else "; ".join(f"{name} {rest}".rstrip() for name in names) for names, rest in runs]
        return "; ".join(said)


def complete_schema(
    *,
    label: str | None,
    labels: dict[str, str] | None,
    label_kinds: dict[str, str] | None,
    label_threshold: float | None,
    dense: list[DenseColumn],
    sparse: list[SparseColumn],
    sample: Callable[[], pa.Table],
    config: InferConfig,
    where: str,
    column_names: Callable[[], list[str]] | None = None,
    sequences: list[SequenceGroup] | None = None,
) -> Inferred:
    """The schema of the given fields, with what they leave open inferred from ``sample()`` (read only if needed).

    Open are: the label when neither ``label`` nor ``labels`` is set (found among ``column_names()``, or the
    sample's columns); every column's role when ``dense`` and ``sparse`` are both empty; the size of each
    sparse column without ``num_embeddings`` (columns sharing a table are sized together: one id space). ``sequences``
    are the schema's histories (``data.sequences``).

    A ``vocab_file`` column's vocabulary is read from its file; the columns a cross combines and a ``weights`` column
    must be columns of the files (``column_names()``, or the sample's).

    Raises:
        DataError: no label can be found, no sparse feature is left, a named column is not in the sample.
        ConfigError: a cross or ``weights`` names a column the files lack; a ``vocab_file`` cannot be read, is empty, repeats
            a value or disagrees with ``num_embeddings``.
    """
    table: pa.Table | None = None

    def read() -> pa.Table:
        nonlocal table
        if table is None:
            table = sample()
        return table

    inferred: list[str] = []
    notes: list[str] = []
    if label is None and labels is None:
        label = detect_label(column_names() if column_names is not None else read().column_names, where)
        inferred.append(f"label {label!r}")
    label_columns = list(labels.values()) if labels is not None else [label] if label is not None else []
    dense, sparse = list(dense), list(sparse)
    if any(c.cross is not None or c.weights is not None for c in sparse):
        _check_inputs(sparse, column_names() if column_names is not None else read().column_names, where)
    if not dense and not sparse:
        t = read()
        dense, sparse, notes = infer_columns(t, set(label_columns) | set(config.exclude), config, where)
        inferred.append(f"{len(dense)} dense and {len(sparse)} sparse columns from {t.num_rows} sampled rows")
    dense = [_fit_zscore(c, read, where, inferred, notes) if c.normalize == "zscore" and (c.mean is None or c.std is None) else c
             for c in dense]
    sparse = [_fit_boundaries(c, read(), where, inferred) if c.encoding == "bucketize" and c.boundaries is None else c for c in sparse]
    sparse, vocabularies = _size_tables(sparse, read, config, where, inferred)
    if table is not None:  # read for what was left open: check the list columns' separators on it while it is here
        _check_separators(sparse, sequences or [], table, where)
    schema = Schema(label=label, labels=labels, label_kinds=label_kinds, label_threshold=label_threshold, dense=dense, sparse=sparse,
                    sequences=list(sequences or []), vocabularies=vocabularies)
    return Inferred(schema, inferred, notes)


OTHER_SEPARATORS = ("|", ";", ",", " ", "\t", "#", "/")
"""Characters that separate a list's values in files that others write (pandas, Spark, Hive, a shell export): what a text
list column is checked for when its own ``separator`` splits nothing (:func:`_check_separators`)."""


def _check_separators(sparse: list[SparseColumn], sequences: list[SequenceGroup], t: pa.Table, where: str) -> None:
    """Refuse a text list of ids (``separator`` set on a history feature, or on a column sharing its table with another:
    a list of item ids beside the item) whose sampled values never hold its separator but often another one.

    Why: a history ``38;1119;7`` read with ``separator: '|'`` is one id, ``'38;1119;7'``, on every row, without a word: the
    vocabulary is fitted on those texts, so nothing is out of vocabulary or bad, and DIN, MIND or a tower trains on one
    opaque "event" per row. Only lists of ids are checked: a multi-hot column of names may hold a space or a slash in a
    single value (``new york``). A column whose values are single ids (no separator anywhere, none of the others in a
    tenth of the values) is fine.

    Raises:
        ConfigError: naming the column, its separator, the separator its values hold (with one) and the fix.
    """
    in_groups = {f for g in sequences for f in g.features}
    tables = Counter(c.table_name for c in sparse)
    for col in sparse:
        ids = col.name in in_groups or tables[col.table_name] > 1
        if col.separator is None or not ids or col.name not in t.column_names or not _text(t.column(col.name)):
            continue
        arr = t.column(col.name).combine_chunks().drop_null()
        if not len(arr) or pc.any(pc.match_substring(arr, col.separator)).as_py():
            continue
        counts = {c: int(pc.sum(pc.match_substring(arr, c)).as_py() or 0) for c in OTHER_SEPARATORS if c != col.separator}
        other, held = max(counts.items(), key=lambda kv: kv[1])
        if held * 10 < len(arr):
            continue
        example = pc.filter(arr, pc.match_substring(arr, other))[0].as_py()
        raise ConfigError(f"data.sparse[{col.name}].separator={col.separator!r}, but none of the {len(arr)} sampled values of column "
                          f"{col.name!r} in {where} holds {col.separator!r}, while {held} hold {other!r} (e.g. {example!r}): each would be "
                          f"read as one id, the whole list. Fix: data.sparse[{col.name}].separator={other!r} (the files' separator)")


def _check_inputs(sparse: list[SparseColumn], columns: list[str], where: str) -> None:
    """Every column a cross combines, and every ``weights`` column, is one of the files' ``columns``.

    Raises:
        ConfigError: naming the entry, the column, the files' columns and the fix.
    """
    for c in sparse:
        missing = [n for n in c.cross or () if n not in columns]
        require(not missing, f"data.sparse[{c.name}].cross={c.cross} names {missing}, not column(s) of {where} (its columns: "
                f"{columns}). Fix: cross columns of the files (they need not be features themselves)")
        require(c.weights is None or c.weights in columns, f"data.sparse[{c.name}].weights={c.weights!r} is not a column of {where} "
                f"(its columns: {columns}). Fix: name the list column of {c.name!r}'s weights")


def _sample_numbers(name: str, t: pa.Table, where: str, separator: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Column ``name`` of the sampled table ``t``: its values that are numbers (lists flattened, text split at ``separator``
    and parsed; values that are no number, NaN or infinite left out), and a mask of the rows where it is missing.

    Raises:
        DataError: ``t`` has no such column.
    """
    if name not in t.column_names:
        raise DataError(f"{where} has no column {name!r}; its columns are {t.column_names}. Fix: correct the column names in "
                        f"data.dense / data.sparse")
    arr = t.column(name).combine_chunks()
    missing = np.asarray(arr.is_null().to_numpy(zero_copy_only=False), dtype=bool)
    if _text(arr):
        missing |= np.asarray(pc.fill_null(pc.equal(arr, ""), False).to_numpy(zero_copy_only=False), dtype=bool)
    numbers, wrong = parse_numbers(_flat_values(arr, separator))
    numbers = numbers[~wrong]
    return numbers[np.isfinite(numbers)], missing


def _fit_zscore(col: DenseColumn, read: Callable[[], pa.Table], where: str, inferred: list[str], notes: list[str]) -> DenseColumn:
    """``col`` with its unset ``mean`` / ``std`` fitted on the sampled values as the encoder sees them (missing ones filled,
    then clipped and transformed); a ``std`` of 0 (a constant column) is stored as 1, with a note."""
    t = read()
    numbers, missing = _sample_numbers(col.name, t, where)
    values = dense_transformed(col, np.concatenate([numbers, np.full(int(missing.sum()), col.fill)]))
    if not len(values):
        raise DataError(f"data.dense[{col.name}].normalize=zscore: no number in the {t.num_rows} sampled rows of {where} to fit its "
                        f"mean and std on. Fix: set data.dense[{col.name}].mean and .std, or normalize=none")
    with np.errstate(over="ignore", invalid="ignore"):  # the overflow is the finding, said below
        mean = col.mean if col.mean is not None else float(values.mean())
        std = col.std if col.std is not None else float(values.std())
    if not (np.isfinite(mean) and np.isfinite(std)):
        raise DataError(f"data.dense[{col.name}].normalize=zscore: the mean and std of its {len(values)} sampled values in {where} "
                        f"overflow a float (mean={mean:g}, std={std:g}; the largest value is {float(np.abs(values).max()):g}). Fix: "
                        f"data.dense[{col.name}].transform=log1p or clip=[low, high], or set its mean and std")
    if std == 0:
        notes.append(f"data.dense[{col.name}]: every sampled value is {values[0]:g} (std 0); zscore divides by std=1 instead")
        std = 1.0
    inferred.append(f"{col.name} zscore mean={mean:.6g} std={std:.6g} from {len(values)} sampled values")
    return replace(col, mean=mean, std=std)


def _fit_boundaries(col: SparseColumn, t: pa.Table, where: str, inferred: list[str]) -> SparseColumn:
    """``col`` (``quantiles`` set) with ``boundaries``: the ``quantiles``-quantiles of its sampled numbers, repeats dropped,
    and ``num_embeddings`` (``len(boundaries) + 1`` unless set).

    Raises:
        DataError: the sample holds no number in the column.
    """
    assert col.quantiles is not None
    numbers, _ = _sample_numbers(col.name, t, where, col.separator)
    if not len(numbers):
        raise DataError(f"data.sparse[{col.name}].quantiles={col.quantiles}: no number in the {t.num_rows} sampled rows of {where} to "
                        f"fit boundaries on. Fix: set data.sparse[{col.name}].boundaries, e.g. [0, 10, 100]")
    boundaries = [float(b) for b in np.unique(np.quantile(numbers, np.arange(1, col.quantiles) / col.quantiles))]
    inferred.append(f"{col.name} boundaries={[float(f'{b:.6g}') for b in boundaries]} ({col.quantiles} quantiles of "
                    f"{len(numbers)} sampled values)")
    return replace(col, boundaries=boundaries)


def _size_tables(sparse: list[SparseColumn], read: Callable[[], pa.Table], config: InferConfig, where: str,
                 inferred: list[str]) -> tuple[list[SparseColumn], dict[str, Vocabulary]]:
    """Each sparse column sized, and the vocabulary of each ``encoding: vocab`` column; ``inferred`` gets a line per size chosen.

    Columns sharing a table (``table:``, e.g. a history ``hist_item_id`` and its candidate ``item_id``) share one id
    space: an unsized one takes a sized sibling's size and encoding, unsized ones are sized together from all their
    values, and one vocabulary is built from the values of every ``vocab`` column on the table.
    """
    sparse = list(sparse)
    tables: dict[str, list[int]] = {}
    for i, col in enumerate(sparse):
        tables.setdefault(col.table_name, []).append(i)
    vocabularies: dict[str, Vocabulary] = {}
    for members in tables.values():
        cols = [sparse[i] for i in members]
        if any(c.vocab_file is not None for c in cols):
            _file_vocabulary_table(sparse, members, read, config, where, inferred, vocabularies)
            continue
        joint = next((c for c in cols if c.num_embeddings is not None), None)
        if joint is None:
            joint = _sized(cols, read(), config, where)
            inferred.append(f"{' + '.join(c.name for c in cols)} num_embeddings={joint.num_embeddings}"
                            + (f" (vocabulary of {joint.size - (joint.oov_buckets or 0)} + {joint.oov_buckets} OOV rows)" if joint.encoding == "vocab"
                               else f" (encoding={joint.encoding}: more values than the sample covers)"))
        for i in members:
            col = sparse[i]
            if col.num_embeddings is None:
                col = replace(col, num_embeddings=joint.num_embeddings, encoding=joint.encoding, oov_buckets=joint.oov_buckets)
            if col.encoding == "vocab" and col.oov_buckets is None:
                col = replace(col, oov_buckets=min(config.oov_buckets, col.size - 1))
            sparse[i] = col
        in_vocab = [sparse[i] for i in members if sparse[i].encoding == "vocab"]
        if in_vocab:
            first = in_vocab[0]
            assert first.oov_buckets is not None
            keys = np.concatenate([_keys(c, read(), where) for c in in_vocab])
            vocabulary = Vocabulary.build(keys, first.size - first.oov_buckets, first.oov_buckets)
            vocabularies.update((c.name, vocabulary) for c in in_vocab)
    return sparse, vocabularies


def _file_vocabulary_table(sparse: list[SparseColumn], members: list[int], read: Callable[[], pa.Table], config: InferConfig,
                           where: str, inferred: list[str], vocabularies: dict[str, Vocabulary]) -> None:
    """The columns ``members`` of ``sparse`` (one table, some with a ``vocab_file``) given the file's vocabulary: each with
    the file, and each other one left unsized or ``encoding: vocab``, becomes ``encoding: vocab`` with ``num_embeddings`` =
    lines + ``oov_buckets`` (in place); their vocabulary goes into ``vocabularies``.

    Raises:
        ConfigError: the table's columns name different files, or the file cannot be used (:func:`~recsys_runner.data.encoding.vocab_file.read_vocab_file`).
    """
    cols = [sparse[i] for i in members]
    listed = [c for c in cols if c.vocab_file is not None]
    first = listed[0]
    other = next((c for c in listed if c.vocab_file != first.vocab_file), None)
    require(other is None, f"data.sparse[{first.name}] and data.sparse[{other.name if other else ''}] share table {first.table_name!r} "
            f"(one id space) but name different vocab_file ({first.vocab_file!r} vs {other.vocab_file if other else ''!r}). Fix: "
            f"give them the same file, or separate tables")
    oov = first.oov_buckets or config.oov_buckets
    t = read()
    readers = [c for c in cols if c.vocab_file is not None or c.num_embeddings is None or c.encoding == "vocab"]
    kinds = {c.name: _integer_ids(c, t, where) for c in readers}
    require(len(set(kinds.values())) == 1, f"the columns {list(kinds)} of table {first.table_name!r} share vocab_file="
            f"{first.vocab_file!r}, but some hold integers and some text in {where} ({kinds}: True is integers), which key values "
            f"differently. Fix: give them one type in the files")
    assert first.vocab_file is not None
    vocabulary = read_vocab_file(first.vocab_file, f"data.sparse[{first.name}]", oov, integers=kinds[first.name], hex_digits=first.hex)
    size = vocabulary.capacity + oov
    for c in listed:
        require(c.num_embeddings in (None, size), f"data.sparse[{c.name}].num_embeddings={c.num_embeddings}, but vocab_file="
                f"{c.vocab_file!r} has {vocabulary.capacity} values and oov_buckets={oov}: {size} rows. Fix: drop "
                f"data.sparse[{c.name}].num_embeddings (the file sets it)")
    for i in members:
        if sparse[i] in readers:
            sparse[i] = replace(sparse[i], encoding="vocab", num_embeddings=size, oov_buckets=oov)
            vocabularies[sparse[i].name] = vocabulary
    inferred.append(f"{' + '.join(c.name for c in readers)} vocabulary of {vocabulary.capacity} values from vocab_file="
                    f"{first.vocab_file!r} + {oov} OOV rows (num_embeddings={size})")


def _integer_ids(col: SparseColumn, t: pa.Table, where: str) -> bool:
    """Whether the training reader reads ``col``'s values as integers (a typed Parquet column of them, or a list of them:
    a vocabulary then keys them as integers) rather than text (every CSV column; a ``hex`` column is parsed from text).

    Raises:
        DataError: the sample has no such column.
    """
    if col.name not in t.column_names:
        raise DataError(f"{where} has no column {col.name!r} (data.sparse); its columns are {t.column_names}. Fix: correct "
                        f"the column names in data.sparse")
    typ = t.schema.field(col.name).type
    typ = typ.value_type if is_list(typ) else typ
    return (pa.types.is_integer(typ) or pa.types.is_boolean(typ)) and not col.hex


def _keys(col: SparseColumn, t: pa.Table, where: str) -> np.ndarray:
    """The vocabulary keys (:func:`~recsys_runner.data.encoding.keys.value_keys`) of ``col``'s sampled values, repeats kept.

    Raises:
        DataError: ``t`` has no such column.
    """
    if col.name not in t.column_names:
        raise DataError(f"{where} has no column {col.name!r} (data.sparse); its columns are {t.column_names}. Fix: correct "
                        f"the column names in data.sparse")
    values = _flat_values(t.column(col.name).combine_chunks(), col.separator)
    if pa.types.is_floating(values.type) and col.encoding != "bucketize":  # no value keyed: said here, not as a table of OOV rows
        raise DataError(f"{where}: {float_ids(col, t.column(col.name).type)}")
    if col.weighted and _text(values):  # id:weight pairs: the vocabulary keys the ids
        ids, _, no_colon, not_number = split_pairs(values)
        values = pc.filter(ids, pa.array(~(no_colon | not_number)))
    keys, wrong = value_keys(values, col.hex)
    return keys if wrong is None else keys[~wrong]


def unseen_share(keys: np.ndarray) -> float:
    """Good–Turing's estimate of the share of later values not among ``keys`` (a sample): values seen once / values."""
    if not len(keys):
        return 1.0
    _, counts = np.unique(keys, return_counts=True)
    return float((counts == 1).sum()) / len(keys)


def _sized(cols: list[SparseColumn], t: pa.Table, config: InferConfig, where: str) -> SparseColumn:
    """The first of ``cols`` (columns of one table) with ``num_embeddings`` (and, left open, its encoding) from all their
    values in the sampled table ``t``: a vocabulary and ``oov_buckets`` rows when the sample covers the columns (or
    ``encoding: vocab`` asks for one), else ``distinct × bucket_margin`` hashed rows.

    Raises:
        DataError: ``t`` has no such column.
    """
    col = replace(cols[0], encoding=next((c.encoding for c in cols if c.encoding is not None), None))
    keys = np.concatenate([_keys(c, t, where) for c in cols])
    distinct = len(np.unique(keys))
    if col.encoding == "vocab" or (col.encoding is None and (t.num_rows < config.sample_rows or unseen_share(keys) <= config.max_unseen_fraction)):
        oov = col.oov_buckets or config.oov_buckets
        return replace(col, encoding="vocab", num_embeddings=distinct + oov, oov_buckets=oov)
    return replace(col, num_embeddings=bucket_count(distinct, config.bucket_margin), encoding=col.encoding or ("mod" if col.hex else "hash"))
