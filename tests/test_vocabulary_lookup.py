"""The fast paths of the encoding give exactly the ids of the reference ones: a vocabulary's direct table of integers
(``Vocabulary.lookup_ints``) against ``lookup`` of their splitmix64 keys, the encoder's int64 vocabulary columns against
the keys of their values, and bucket ids counted by comparisons against a binary search."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest

from recsys_runner.data.encoding.keys import splitmix64, unsplitmix64, value_keys
from recsys_runner.data.encoding.rows import Encoder, Location
from recsys_runner.data.encoding.values import bucket_ids
from recsys_runner.data.encoding.vocabulary import DIRECT_MAX, Vocabulary

EXTREMES = np.array([-(2**63), 2**63 - 1, -1, 0, 1, 2**62, -(2**62)], np.int64)


def keyed(values: np.ndarray) -> np.ndarray:
    return splitmix64(values.view(np.uint64))


def reference(vocabulary: Vocabulary, values: np.ndarray) -> np.ndarray:
    """What ``lookup_ints`` must equal: the hash lookup of the integers' keys."""
    return vocabulary.lookup(keyed(values))


def test_unsplitmix64_undoes_splitmix64() -> None:
    words = np.random.default_rng(0).integers(0, 2**64, 100_000, dtype=np.uint64, endpoint=False)
    assert (unsplitmix64(splitmix64(words)) == words).all()
    assert (splitmix64(unsplitmix64(words)) == words).all()


@pytest.mark.parametrize(("low", "high", "sampled", "capacity"), [
    (0, 100_000, 50_000, 10**6),          # dense ids from 0: a table indexed by the values as they are
    (-500, 500, 300, 200),                # negatives, and a capacity below the distinct values (the rest OOV)
    (10**12, 10**12 + 5_000, 4_000, 10**6),  # dense but far from 0: the table starts at the smallest
    (0, 2**40, 1_000, 10**6),             # sparse: no direct table, the hash lookup
    (0, 70_000, 69_000, 2**31),           # int64 rows (the table's narrowest type follows the capacity)
])
def test_lookup_ints_equals_the_lookup_of_keys(low: int, high: int, sampled: int, capacity: int) -> None:
    rng = np.random.default_rng(low % 1000 + sampled)
    sample = rng.integers(low, high, sampled)
    vocabulary = Vocabulary.build(keyed(sample), capacity, 16)
    queries = np.concatenate([rng.integers(low - 1_000, high + 1_000, 20_000), EXTREMES, sample[:500],
                              rng.integers(-(2**63), 2**63 - 1, 1_000)])
    present = rng.random(len(queries)) < 0.9
    assert (vocabulary.lookup_ints(queries) == reference(vocabulary, queries)).all()
    assert (vocabulary.lookup_ints(queries, present) == reference(vocabulary, queries[present])).all()
    inside = queries[(queries >= sample.min()) & (queries <= sample.max())]  # the gather alone, no value outside
    assert (vocabulary.lookup_ints(inside) == reference(vocabulary, inside)).all()
    assert vocabulary.lookup_ints(inside).dtype == np.int64
    assert (high - low > 4 * sampled + 2**16) == (vocabulary._direct is None)


def test_lookup_ints_of_an_empty_vocabulary_and_of_no_values() -> None:
    empty = Vocabulary.build(np.zeros(0, np.uint64), 10, 4)
    values = np.concatenate([EXTREMES, np.arange(100)])
    assert (empty.lookup_ints(values) == 10 + (keyed(values) % np.uint64(4)).astype(np.int64)).all()
    full = Vocabulary.build(keyed(np.arange(10)), 10, 4)
    assert full.lookup_ints(np.zeros(0, np.int64)).tolist() == []
    assert full.lookup_ints(np.arange(3), np.zeros(3, bool)).tolist() == []


def test_a_vocabulary_of_text_keys_reads_integers_as_their_keys() -> None:
    """Keys of text unmix to integers spread over 64 bits: no direct table, and any integer still reads its key's row."""
    text_keys = np.random.default_rng(1).integers(0, 2**64, 500, dtype=np.uint64, endpoint=False)
    vocabulary = Vocabulary.build(np.concatenate([text_keys, keyed(np.arange(5))]), 1_000, 8)
    values = np.concatenate([np.arange(-10, 10), EXTREMES])
    assert vocabulary._direct is None
    assert (vocabulary.lookup_ints(values) == reference(vocabulary, values)).all()


def test_a_span_beyond_the_direct_limit_is_hashed() -> None:
    vocabulary = Vocabulary.build(keyed(np.array([0, DIRECT_MAX + 2**20])), 10, 2)
    assert vocabulary._direct is None


class _Schema:
    """The schema the encoder reads by attribute: a label, no dense, one vocabulary column."""

    def __init__(self, vocabulary: Vocabulary, type_of: str = "int64") -> None:
        self.dense, self.sequences, self.labels, self.label_threshold = [], [], None, None
        self.label_columns, self.label_tasks = ["label"], ["label"]
        self.sparse = [SimpleNamespace(name="id", encoding="vocab", separator=None, hex=False, size=vocabulary.capacity
                                       + vocabulary.oov_buckets, weighted=False, weights=None, cross=None)]
        self.vocabularies = {"id": vocabulary}

    @staticmethod
    def label_kind(task: str) -> str:
        return "binary"


@pytest.mark.parametrize("arrow_type", [pa.int64(), pa.int32(), pa.uint64()])
def test_the_encoder_gives_vocabulary_columns_the_rows_of_their_keys(arrow_type: pa.DataType) -> None:
    rng = np.random.default_rng(2)
    vocabulary = Vocabulary.build(keyed(rng.integers(0, 1_000, 800)), 500, 16)
    low = 0 if arrow_type == pa.uint64() else -5
    values = [None if rng.random() < 0.1 else int(v) for v in rng.integers(low, 1_200, 5_000)]
    values += [None, 2**31 - 1, 0] if arrow_type != pa.uint64() else [None, 2**64 - 1, 0]
    column = pa.array(values, arrow_type)
    table = pa.table({"label": pa.array(np.zeros(len(values))), "id": column}).slice(3)  # an offset into the buffers
    encoder = Encoder(_Schema(vocabulary))
    rows = encoder.encode(table, Location("t", "", np.arange(table.num_rows)))
    flat = table.column("id").combine_chunks().drop_null()
    ids, lengths = rows.sparse[0]
    assert (ids == vocabulary.lookup(value_keys(flat, False)[0])).all()
    assert lengths.tolist() == [0 if v is None else 1 for v in values[3:]]
    assert encoder.oov["id"] == [int((ids >= 500).sum()), len(flat)]


def test_bucket_ids_count_boundaries_as_a_binary_search_does() -> None:
    rng = np.random.default_rng(3)
    numbers = np.concatenate([rng.normal(size=10_000), [np.inf, -np.inf, np.nan, 0.0, 1.0]])
    wrong = np.isnan(numbers)
    for boundaries in (np.sort(rng.normal(size=10)), np.array([0.0, 0.0, 1.0]), np.sort(rng.normal(size=40)), np.array([])):
        col = SimpleNamespace(name="n", boundaries=boundaries.tolist())
        expected = np.where(wrong, 0, np.searchsorted(boundaries, numbers, side="right"))
        got = bucket_ids(col, numbers, wrong)
        assert got.dtype == np.int64 and (got == expected).all()


@pytest.mark.parametrize("column", [pa.nulls(5, pa.int64()), pa.array([], pa.int64()), pa.array([None, 3, None, 2**40], pa.int64())])
def test_an_int64_vocabulary_column_of_nulls_or_no_rows(column: pa.Array) -> None:
    vocabulary = Vocabulary.build(keyed(np.arange(100)), 50, 4)
    table = pa.table({"label": pa.array(np.zeros(len(column))), "id": column})
    rows = Encoder(_Schema(vocabulary)).encode(table, Location("t", "", np.arange(len(column))))
    ids, lengths = rows.sparse[0]
    present = column.drop_null()
    assert ids.tolist() == vocabulary.lookup(value_keys(present, False)[0]).tolist()
    assert lengths.tolist() == [int(v is not None) for v in column.to_pylist()]
