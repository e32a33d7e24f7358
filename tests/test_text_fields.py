"""Numbers and ids read from text fields (CSV): each distinct text that Arrow's cast does not read is parsed once in
Python, never field by field, with the values a field-by-field ``int``/``float`` gives; and a missing field in a block
that also holds an unparsable one stays missing (docs/data.md, *Bad data*)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from recsys_runner.data.encoding.keys import PLAIN_HEX, PLAIN_INT, parse_hex, parse_int, parse_texts
from recsys_runner.data.encoding.rows import Encoder, Location
from recsys_runner.data.encoding.values import parse_numbers
from recsys_runner.data.schema import DenseColumn, Schema, SparseColumn
from recsys_runner.errors import DataError

INTS = [" 12", "12 ", "\t-7", "+12", "0012", "1_000", "١٢", "9223372036854775807", "9223372036854775808", "-9223372036854775808",
        "123456789012345678", "1.0", "abc", "", " ", "0x10"]
FLOATS = [" 1.5", "+1.5", "-.5", "5.", "1E+05", "1e309", "4.9e-325", "inf", "-Infinity", "nan", "1_0", "abc", "", "1d5",
          "0.1000000000000000055511151231257827", "12345678901234567890123"]
HEXES = ["1f", "ABC", "00000000000001f", "0x1f", "+1f", " 1f", "1_f", "-1f", "g1", "", "1234567890abcdef", "ffffffffffffffff"]


def _reference(texts: list[str], parse) -> tuple[list, list[bool]]:
    values, wrong = [], []
    for t in texts:
        try:
            values.append(parse(t))
            wrong.append(False)
        except (ValueError, OverflowError):
            values.append(0)
            wrong.append(True)
    return values, wrong


def _int64(t: str) -> int:
    v = int(t)
    if not -2**63 <= v < 2**63:
        raise OverflowError(t)
    return v


def _hex(t: str) -> int:
    v = int(t, 16)
    if not 0 < len(t) <= 15 or v < 0:
        raise ValueError(t)
    return v


def test_text_ints_floats_and_hex_read_as_python_reads_each_field() -> None:
    for texts, parse, ref in ((INTS, parse_int, _int64), (FLOATS, parse_numbers, float), (HEXES, parse_hex, _hex)):
        rng = np.random.default_rng(0)
        shuffled = [texts[i] for i in rng.integers(0, len(texts), 500)]  # repeats and every order
        values, wrong = parse(pa.array(shuffled))
        expected, refused = _reference(shuffled, ref)
        if parse is parse_numbers:  # NaN is no number
            refused = [r or (not r and np.isnan(v)) for v, r in zip(expected, refused, strict=True)]
        assert wrong.tolist() == refused, texts
        ok = ~np.array(refused)
        assert np.array_equal(values[ok], np.array(expected, dtype=values.dtype)[ok]), texts


def test_each_distinct_text_outside_the_plain_form_is_parsed_once() -> None:
    """A block of 100,000 CSV fields that Arrow's cast refuses as a whole (``True``/``False`` labels, padded ids, one
    bad field) made 100,000 Python calls; now one per distinct text that is not plain, the plain ones vectorized."""
    calls: list[str] = []

    def counted(text: str) -> int:
        calls.append(text)
        return int(text)

    texts = pa.array([str(i) for i in range(99_990)] + [" 7", "+8", "x"] * 3 + ["+8"])
    values, wrong = parse_texts(texts, PLAIN_INT, lambda plain: np.asarray(pc.ascii_trim(plain, " \t").cast(pa.int64())), counted, np.int64)
    assert sorted(calls) == ["+8", "x"]  # " 7" is plain (spaces trimmed)
    assert values[:99_990].tolist() == list(range(99_990)) and values[-1] == 8 and wrong.sum() == 3
    assert parse_texts(pa.array(["f"] * 10 + ["0x1"]), PLAIN_HEX, lambda p: np.full(len(p), 15), lambda t: int(t, 16), np.int64)[0].tolist() == \
        [15] * 10 + [1]


ITEM = [SparseColumn(name="item", num_embeddings=10, encoding="hash")]


@pytest.mark.parametrize("on_bad_rows", ["fail", "skip"])
def test_a_missing_field_stays_missing_in_a_block_with_an_unparsable_one(on_bad_rows: str) -> None:
    """A CSV block whose label or dense column holds an unparsable field: its missing fields read as 0 (a missing label
    as a negative, a missing price as 0, not its ``fill``), silently, where a block without one names them."""
    schema = Schema(label="click", dense=[DenseColumn(name="price", fill=-1.0)], sparse=ITEM)
    table = pa.table({"click": ["1", None, "abc", "True", "0"], "price": ["2", None, "x", "3", "4.5"], "item": ["a"] * 5})
    encoder = Encoder(schema, on_bad_rows, DataError)
    where = Location("f.csv", "lines 2-6", np.arange(5), 2)
    if on_bad_rows == "fail":
        with pytest.raises(DataError, match=r"bad row in f.csv, line 3, column 'click': the label is missing"):
            encoder.encode(table, where)
        return
    rows = encoder.encode(table, where)
    assert encoder.num_bad_rows == 2  # the missing label and the unparsable one
    assert rows.labels.tolist() == [1.0, 1.0, 0.0] and rows.dense[:, 0].tolist() == [2.0, 3.0, 4.5]
    kept = Encoder(schema, "skip", DataError).encode(pa.table({"click": ["1", "0", "1"], "price": ["2", None, "bad"], "item": ["a"] * 3}),
                                                     where)
    assert kept.dense[:, 0].tolist() == [2.0, -1.0]  # the missing price takes its fill, the bad one is skipped
