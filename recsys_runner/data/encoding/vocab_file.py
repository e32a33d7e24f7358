"""A ``vocab_file``: a vocabulary written by hand or by ``python -m recsys_runner.data sequences`` (its id mapping), one value
per line, read and checked as the encoder keys the column's values.

Apart from fitting (:mod:`recsys_runner.data.encoding.fit`, which gives a ``data.sparse[...].vocab_file`` its table) because
the file's format and its mistakes are their own concern, which the id mapping of a sequence log reads too
(:mod:`recsys_runner.data.sequences.mapping`)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from recsys_runner import stores
from recsys_runner.data.encoding.keys import parse_int, value_keys
from recsys_runner.data.encoding.vocabulary import Vocabulary
from recsys_runner.errors import ConfigError, require


def read_vocab_file(path: str, key: str, oov_buckets: int, integers: bool, hex_digits: bool = False) -> Vocabulary:
    """The vocabulary of the file ``path``: one value per line, line ``i`` (from 1) given row ``i - 1``, then ``oov_buckets``
    rows; each line keyed as the encoder keys the column's values (:func:`~recsys_runner.data.encoding.keys.value_keys`):
    as an integer when the training files hold ``integers``, else as text (exactly, ``\r`` of a Windows line end
    dropped); ``hex_digits``: parsed from hexadecimal text. ``key`` names the column's entry in messages.

    Raises:
        ConfigError: the file cannot be read, is empty, has an empty line, a line that is not an integer (``integers``) or
            hexadecimal (``hex_digits``), or repeats a value (naming the value and both lines).
    """
    where = f"{key}.vocab_file={path!r}"
    try:
        text = stores.read_bytes(path, ConfigError).decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file. Fix: point it at a text file with one value per line (a relative path is read "
                          f"from the directory the command runs in)") from None
    except OSError as e:
        raise ConfigError(f"{where} cannot be read ({e.strerror or e}). Fix: point it at a text file with one value per line") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where} is not UTF-8 text ({e.reason} at byte {e.start}). Fix: write one value per line as UTF-8") from None
    lines = [line.removesuffix("\r") for line in text.split("\n")]
    if lines and lines[-1] == "":
        lines.pop()  # the newline that ends the last line
    require(len(lines) > 0, f"{where} is empty. Fix: write one value per line (line i becomes row i - 1)")
    blank = next((i for i, line in enumerate(lines) if line == ""), None)
    require(blank is None, f"{where}: line {(blank or 0) + 1} is empty, and an empty field is a missing value, never an id. Fix: "
            f"remove the empty line (one value per line)")
    texts = pa.array(lines, pa.string())
    if integers:
        numbers, wrong = parse_int(texts)
        require(not wrong.any(), f"{where}: line {int(np.argmax(wrong)) + 1} ({lines[int(np.argmax(wrong))]!r}) is not an integer, "
                f"but the column holds integers in the training files, which key values by their number. Fix: write the ids as "
                f"decimal integers, one per line")
        keys, wrong_keys = value_keys(pa.array(numbers, pa.int64()), False)
    else:
        keys, wrong_keys = value_keys(texts, hex_digits)
    require(wrong_keys is None or not wrong_keys.any(), f"{where}: line {int(np.argmax(wrong_keys)) + 1 if wrong_keys is not None else 0} "
            f"is not a hexadecimal string (data.sparse hex=true). Fix: write hexadecimal ids, one per line")
    _, first_index, inverse = np.unique(keys, return_index=True, return_inverse=True)
    repeat = first_index[inverse] != np.arange(len(keys))
    if repeat.any():
        k = int(np.argmax(repeat))
        j = int(first_index[inverse[k]])
        same = "" if lines[j] == lines[k] else f" ({lines[j]!r}: the same {'integer' if integers else 'id'})"
        raise ConfigError(f"{where}: the value {lines[k]!r} on line {k + 1} repeats line {j + 1}{same}; each value gets one row. "
                          f"Fix: remove the repeated line(s)")
    order = np.argsort(keys, kind="stable")
    return Vocabulary(keys[order], np.arange(len(keys), dtype=np.int64)[order], len(keys), oov_buckets)
