"""Stable 64-bit keys of raw values — FNV-1a of text, splitmix64 of integers, crosses of keys — and the hex and decimal
parsing that ids start from.

The ``hash`` encoding takes a key modulo its table, a vocabulary (:mod:`~recsys_runner.data.encoding.vocabulary`) maps
keys to rows, a cross (:func:`cross_keys`) mixes the keys of its columns: one key per value, identical across
processes, runs and machines, which is what lets a stored encoder (``encoders.json``) give the ids training gave.
:func:`unsplitmix64` undoes :func:`splitmix64` (a bijection), so a vocabulary of integer keys knows its integers.

**Standalone on purpose**, like :mod:`~recsys_runner.data.encoding.rows`: NumPy and PyArrow only, and copied into the
MLflow model's ``code/`` (:data:`~recsys_runner.data.encoding.served.SHIPPED`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


def as_ids(flat: pa.Array) -> pa.Array:
    """A flat array of booleans as the ids they are read as: ``False`` 0, ``True`` 1 (other arrays as they are).

    Why: a Parquet ``bool`` column (``is_new_user``, ``has_coupon``) is a two-valued categorical. A dense column reads it
    as 0/1 and a cross keys it as the integers 0/1 (:func:`raw_keys`); as a sparse id it was a bad row (``id True is
    outside [0, 4)``) for ``encoding: id`` and ``mod``, and not keyed at all for ``hash`` and ``vocab``. Read as the
    integers 0/1, it is one id space wherever the row encoder reads it (training, evaluation, predict) and for fitting."""
    return flat.cast(pa.int8()) if pa.types.is_boolean(flat.type) else flat


def is_text(t: pa.DataType) -> bool:
    """Whether ``t`` is text (``string`` or ``large_string``): text is keyed by :func:`fnv1a64`."""
    return pa.types.is_string(t) or pa.types.is_large_string(t)


_HEX = np.full(256, -1, dtype=np.int64)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEX[_c] = 10 + _i


def _string_buffers(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(offsets [n+1] relative to data, data bytes) of a string array without nulls."""
    if pa.types.is_large_string(arr.type):
        arr = arr.cast(pa.string())
    _, offsets_buf, data_buf = arr.buffers()
    offsets = np.frombuffer(offsets_buf, dtype=np.int32)[arr.offset : arr.offset + len(arr) + 1].astype(np.int64)
    data = np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.zeros(0, np.uint8)
    return offsets, data


PROBE_ROWS = 64
"""Fields :func:`cast_or_none` casts first: a block whose first fields Arrow's cast refuses is not cast whole."""


def cast_or_none(texts: pa.Array, target: pa.DataType) -> pa.Array | None:
    """``texts`` cast to ``target`` by Arrow, or ``None`` where the cast refuses a field. Its first :data:`PROBE_ROWS`
    fields are tried first, because a refused cast of a block costs about a full parse of it (0.45 s per million
    ``True``/``False`` fields, 30x a cast that succeeds), and a text form that is not a number (``True``, ``" 12"``)
    is usually in every row."""
    try:
        if len(texts) > PROBE_ROWS:
            texts.slice(0, PROBE_ROWS).cast(target)
        return texts.cast(target)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return None


def parse_texts(texts: pa.Array, plain: str, parse_plain: Callable[[pa.Array], np.ndarray], parse: Callable[[str], Any],
                dtype: type) -> tuple[np.ndarray, np.ndarray]:
    """Texts without nulls → ``dtype`` values and a mask of texts ``parse`` refuses (``ValueError``, ``OverflowError``).

    Texts that match the regular expression ``plain`` are read by ``parse_plain`` (vectorized, and giving what ``parse``
    gives for them), the others by ``parse`` (Python) once per distinct text. Why: a block of text fields that Arrow's
    cast refuses as a whole (one bad field; a CSV's ``True``/``False`` labels; ids written ``" 12"``) was parsed field by
    field in Python, about a second per million fields of every such block, on every epoch; the fields that are not
    plain are few, or few distinct values (``True``/``False``).
    """
    n = len(texts)
    values: np.ndarray = np.zeros(n, dtype)
    wrong = np.zeros(n, bool)
    fast = np.asarray(pc.match_substring_regex(texts, plain).to_numpy(zero_copy_only=False), dtype=bool) if n else np.zeros(0, bool)
    if fast.any():
        values[fast] = parse_plain(texts.filter(pa.array(fast)))
    rest = np.flatnonzero(~fast)
    if len(rest):
        others = texts.take(pa.array(rest))
        distinct = pc.unique(others)
        index = np.asarray(pc.index_in(others, value_set=distinct).to_numpy(zero_copy_only=False), dtype=np.int64)
        parsed: np.ndarray = np.zeros(len(distinct), dtype)
        refused = np.zeros(len(distinct), bool)
        for i, text in enumerate(distinct.to_pylist()):
            try:
                parsed[i] = parse(text)
            except (ValueError, OverflowError):  # not a number, or one beyond the dtype
                refused[i] = True
        values[rest], wrong[rest] = parsed[index], refused[index]
    return values, wrong


PLAIN_HEX = r"^[0-9a-fA-F]{1,15}$"
"""Hex text :func:`parse_hex` reads vectorized: 1-15 digits (an int64 that is not negative)."""
PLAIN_INT = r"^[ \t]*-?[0-9]{1,18}[ \t]*$"
"""Decimal text :func:`parse_int` reads vectorized (Arrow's cast, spaces trimmed): at most 18 digits always fit int64."""


def _hex_value(text: str) -> int:
    v = int(text, 16)
    if not 0 < len(text) <= 15 or v < 0:
        raise ValueError(text)
    return v


def parse_hex(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Hexadecimal strings → int64 values and a mask of strings that are not 1-15 hex digits."""
    n = len(arr)
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, bool)
    offsets, data = _string_buffers(arr)
    lengths = np.diff(offsets)
    width = int(lengths.max())
    if width == int(lengths.min()) and 0 < width <= 15:
        # Fixed width (Criteo: 8 digits): one table lookup and a shift-add per digit position.
        digits = _HEX[data[offsets[0] : offsets[-1]].reshape(n, width)]
        wrong = (digits < 0).any(axis=1)
        values = np.zeros(n, dtype=np.int64)
        for k in range(width):
            values = (values << 4) | np.maximum(digits[:, k], 0)
        return values, wrong
    # widths differ: plain digits padded to 15 with leading zeros are fixed width; the rest as Python reads them
    return parse_texts(arr, PLAIN_HEX, lambda plain: parse_hex(pc.utf8_lpad(plain, width=15, padding="0"))[0], _hex_value, np.int64)


def parse_int(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Decimal integer strings → int64 and a mask of strings that are not integers."""
    cast = cast_or_none(arr, pa.int64())
    if cast is not None:
        return np.asarray(cast.to_numpy(zero_copy_only=False), dtype=np.int64), np.zeros(len(arr), bool)
    return parse_texts(arr, PLAIN_INT, lambda plain: np.asarray(pc.ascii_trim(plain, " \t").cast(pa.int64()).to_numpy(
        zero_copy_only=False), dtype=np.int64), int, np.int64)


_FNV_OFFSET, _FNV_PRIME = np.uint64(0xCBF29CE484222325), np.uint64(0x100000001B3)


def fnv1a64(arr: pa.Array) -> np.ndarray:
    """Stable 64-bit FNV-1a hash of each string (identical across processes, runs and machines)."""
    offsets, data = _string_buffers(arr)
    lengths = np.diff(offsets)
    h = np.full(len(arr), _FNV_OFFSET, dtype=np.uint64)
    starts = offsets[:-1]
    for k in range(int(lengths.max()) if len(arr) else 0):
        live = lengths > k
        idx = np.flatnonzero(live)
        h[idx] = (h[idx] ^ data[starts[idx] + k].astype(np.uint64)) * _FNV_PRIME
    return h


def splitmix64(x: np.ndarray) -> np.ndarray:
    """Stable 64-bit mix of integers (splitmix64's finalizer)."""
    z = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def unsplitmix64(z: np.ndarray) -> np.ndarray:
    """The integers (uint64) whose :func:`splitmix64` is ``z``: the mix is a bijection of 64-bit words (xor-shifts and
    odd multipliers undone), so a vocabulary of integer keys knows the integers it holds."""
    x = z.astype(np.uint64)
    x = x ^ (x >> np.uint64(31)) ^ (x >> np.uint64(62))
    x = x * np.uint64(0x319642B2D24D8EC3)  # the inverse of 0x94D049BB133111EB modulo 2**64
    x = x ^ (x >> np.uint64(27)) ^ (x >> np.uint64(54))
    x = x * np.uint64(0x96DE1B173F119089)  # the inverse of 0xBF58476D1CE4E5B9
    x = x ^ (x >> np.uint64(30)) ^ (x >> np.uint64(60))
    return x - np.uint64(0x9E3779B97F4A7C15)

def raw_keys(flat: pa.Array) -> tuple[np.ndarray, np.ndarray | None]:
    """The 64-bit key of each raw value of a flat array without nulls, as a cross combines them: text by :func:`fnv1a64`,
    integers and booleans by :func:`splitmix64` of their value, floats of their bits (``-0.0`` as ``0.0``); and a mask
    of the values that are present (``False``: a float NaN, which counts as missing), or ``None`` for a type without keys."""
    if is_text(flat.type):
        return fnv1a64(flat), np.ones(len(flat), bool)
    if pa.types.is_unsigned_integer(flat.type) and flat.type.bit_width == 64:
        return splitmix64(np.asarray(flat.to_numpy(zero_copy_only=False), dtype=np.uint64)), np.ones(len(flat), bool)
    if pa.types.is_integer(flat.type) or pa.types.is_boolean(flat.type):
        values = np.asarray(flat.cast(pa.int64()).to_numpy(zero_copy_only=False), dtype=np.int64)
        return splitmix64(values.view(np.uint64)), np.ones(len(flat), bool)
    if pa.types.is_floating(flat.type):
        numbers = np.asarray(flat.cast(pa.float64()).to_numpy(zero_copy_only=False), dtype=np.float64) + 0.0
        return splitmix64(numbers.view(np.uint64)), ~np.isnan(numbers)
    return np.zeros(len(flat), np.uint64), None


def cross_keys(parts: list[np.ndarray]) -> np.ndarray:
    """The key of each row's combination of the 64-bit keys ``parts`` (one array per crossed column, in order): each part
    mixed into the running key by :func:`splitmix64`, seeded with the number of parts (``(a, b)`` and ``(b, a)`` differ)."""
    key = np.full(len(parts[0]), len(parts), dtype=np.uint64)
    for part in parts:
        key = splitmix64(key ^ part)
    return key

def value_keys(flat: pa.Array, hex_digits: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """The 64-bit key of each value of a flat array without nulls, and a mask of values that cannot be keyed
    (``None`` when all can): text is hashed as text (a ``hex`` column's text parsed first), integers by their 64 bits."""
    text = is_text(flat.type)
    if hex_digits:
        if not text:
            return np.zeros(len(flat), np.uint64), np.ones(len(flat), bool)
        values, wrong = parse_hex(flat)
        return splitmix64(values.view(np.uint64)), wrong
    if text:
        return fnv1a64(flat), None
    if pa.types.is_integer(flat.type):
        return splitmix64(np.asarray(flat.to_numpy(zero_copy_only=False), dtype=np.int64).view(np.uint64)), None
    return np.zeros(len(flat), np.uint64), np.ones(len(flat), bool)
