"""A request's columns as training read them, for the served model (:mod:`.served`): each column converted to Arrow and
cast to the type training read it as (``encoders.json``'s ``column_types``), the CSV reader's missing-value tokens read
as missing — steps 1 and 2 of :meth:`.served.ServedModel.predict` — and the row encoder as a request sees it (its bad rows
named as request rows, with the fix for a request: :class:`RequestRows`, :class:`RequestEncoder`).

Apart from the served model because what a pandas DataFrame of a request holds (MLflow's parsers, JSON numbers made
floats, pandas' ``"772.0"``) is a concern of its own, which the top-k model shares (:func:`integral`).

**Standalone on purpose**, like :mod:`.served`: NumPy, PyArrow, :mod:`.keys`, :mod:`.values` and :mod:`.rows` only; the
MLflow models ``export`` writes carry a copy of it (:data:`.served.SHIPPED`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

if TYPE_CHECKING or __package__:
    from . import keys as _keys
    from . import rows as _rows
    from . import values as _values
else:  # inside the MLflow model: the copies in its code/ directory, never an installed recsys_runner
    _CODE = __name__.removeprefix("recsys_served_request")  # "_<hash>": this copy's code set (served.SHIPPED says why)
    _keys = importlib.import_module(f"recsys_keys{_CODE}")
    _rows = importlib.import_module(f"recsys_rows{_CODE}")
    _values = importlib.import_module(f"recsys_values{_CODE}")

STACKED_ROWS = 4096
"""Requests of up to this many rows are converted to Arrow in one piece (:meth:`RequestColumns.text_columns`)."""
ABSENT_TEXTS = ("", "None", "nan")
"""Texts read as a missing value in a column training read as numbers (a Parquet model's ids, prices): no id reads as
them, and they are what a request holds for one — ``""`` in a CSV body or JSON text, ``"None"`` and ``"nan"`` what
MLflow's ``inputs`` form makes of a JSON ``null`` and ``NaN`` in a ``string`` column of the signature (and pandas'
``astype(str)`` of a missing number): as a NaN of a typed request column, which pandas holds for a missing value, they
take the column's fill (:meth:`RequestColumns.cast`)."""
EXACT_FLOAT = 2**53
"""Integers above this are not all held by a float64 (:meth:`RequestColumns._exact_ids`)."""
WHOLE_TEXT = r"^[+-]?[0-9]+\.0*$"
"""A whole number written with a decimal point (``"772.0"``): :func:`_whole_texts`."""


class RequestRows(_rows.Location):
    """Rows of a request, for the encoder's messages: ``request row <i>`` (0-based)."""

    def describe(self, i: int, column: str | None = None) -> str:
        return f"request row {int(self.file_rows[i])}"


class RequestEncoder(_rows.Encoder):
    """The row encoder training used, whose bad rows end with the fix for a request."""

    fix = "Fix the request"
    settings_fixes = False


class RequestColumns:
    """The input columns a model reads, and how a request's columns become them (module docstring).

    Args:
        columns: the request columns the model reads (``serving.json``'s ``input_columns``).
        types: each column's Arrow type as training read it (``encoders.json``'s ``column_types``).
        dense_columns: the columns read as dense features.
        single_valued: the columns holding one value per row (dense columns, and id columns training split at no
            separator): a list sent in one is refused (:meth:`_one_value_per_row`), not read as a multi-hot bag.
        null_values: the CSV reader's missing-value tokens (``serving.json``'s ``null_values``).
        error: what a request that cannot be read raises (MLflow's ``BAD_REQUEST``: :func:`.served_program.error_class`).
    """

    def __init__(self, columns: list[str], types: dict[str, pa.DataType], dense_columns: set[str], single_valued: set[str],
                 null_values: list[str], error: type[Exception]) -> None:
        self.columns, self.types, self.dense_columns, self.error = columns, types, dense_columns, error
        self.single_valued = {name for name in single_valued if not _values.is_list(types.get(name, pa.string()))}
        self.null_values = pa.array(list(null_values), pa.string())
        self.absent_texts = pa.array(sorted({*self.null_values.to_pylist(), *ABSENT_TEXTS}), pa.string())
        """The texts read as missing in a column training read as numbers (:data:`ABSENT_TEXTS`, with the null tokens)."""
        self.all_text = all(pa.types.is_string(self.types.get(name, pa.string())) for name in self.columns)
        """Every input column is read as text (:meth:`text_columns`)."""

    def read(self, frame: Any) -> tuple[dict[str, pa.Array], bool]:
        """The request's columns as training read them, and whether they were converted in one piece (:meth:`text_columns`;
        a small request then may take :class:`.served_small.SmallRequests`).

        Raises:
            RequestError (MLflow's ``BAD_REQUEST`` when MLflow is installed): a column is missing or cannot be read.
        """
        self.check(frame)
        columns = self.text_columns(frame) if len(frame) <= STACKED_ROWS else None
        if columns is not None:
            return columns, True
        try:
            return {name: self.cast(name, self.arrow_column(name, frame[name])) for name in self.columns}, False
        except self.error:
            self._columns_as_one_row(frame)
            raise

    def _columns_as_one_row(self, frame: Any) -> None:
        """Raises RequestError (MLflow's ``BAD_REQUEST``) for a request that is one row holding a list in every column of
        one value per row: what MLflow makes of a dict of columns whose values are all lists of text
        (``{"user": ["u1", "u2"], ...}``, read as one row of list cells, not as two rows), which would otherwise be named as
        a list in the first such column only. Called only once a request failed, so a good request pays nothing."""
        single = [name for name in self.columns if name in self.single_valued]
        if len(frame) != 1 or not single or not all(isinstance(frame[name].iloc[0], (list, tuple, np.ndarray)) for name in single):
            return
        raise self.error(f"the request is one row holding a list in every column of one value per row ({single}): MLflow reads a "
                         f"dict of columns whose values are all lists of text ({{{single[0]!r}: [...], ...}}) as ONE row of lists, "
                         f"not as rows. Fix: send a DataFrame of one value per cell, pd.DataFrame(request), or a list of rows "
                         f"([{{column: value, ...}}, ...])")

    def check(self, frame: Any) -> None:
        """Raises RequestError (MLflow's ``BAD_REQUEST``) naming the input columns ``frame`` lacks."""
        if not frame.columns.is_unique:  # pandas hands over a frame, not a column, for a twice-named column
            twice = [c for c in self.columns if int((frame.columns == c).sum()) > 1]
            if twice:
                raise self.error(f"the request has {'the column' if len(twice) == 1 else 'the columns'} {', '.join(map(repr, twice))} "
                                 f"more than once: the model cannot tell which to read. Fix: send each column once")
        missing = [c for c in self.columns if c not in frame.columns]
        if missing:
            raise self.error(f"the request has no column {missing[0]!r}{f' (nor {missing[1:]})' if missing[1:] else ''}; "
                                 f"the model reads the columns {self.columns}. Fix: send every one of them (extra columns are ignored)")

    def arrow_column(self, name: str, series: Any) -> pa.Array:
        """Request column ``name`` as one Arrow array (:func:`_arrow_column`).

        Raises:
            RequestError (MLflow's ``BAD_REQUEST``): its values are of kinds no one Arrow type holds (text beside
                numbers, a list beside a single value), named with the column.
        """
        try:
            return _arrow_column(series)
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as e:
            raise self.error(f"column {name!r} cannot be read ({str(e).splitlines()[0]}): its rows hold values of different kinds "
                             f"(text beside numbers, or a list beside a single value). Fix: send one kind of value in it, as the "
                             f"signature says ({'a list per row' if _values.is_list(self.types.get(name, pa.string())) else 'one value per row'})") from None

    def text_columns(self, frame: Any) -> dict[str, pa.Array] | None:
        """The request's columns as :meth:`cast` makes them, converted to Arrow all at once: when every input column
        holds Python objects (what MLflow's CSV parser and the signature's ``string`` columns give), all of them are text
        or missing, and the model reads every one as text (a CSV-trained model). ``None`` otherwise (each column then goes
        its own way). Per column, a small request's conversion costs more than its values: one conversion and one
        null-token pass over every value instead of one per column (~3 ms less for a 39-column row)."""
        if not self.all_text:
            return None
        block = frame[self.columns] if list(frame.columns) != self.columns else frame
        if any(dtype.kind != "O" for dtype in block.dtypes):  # NumPy objects, or pandas strings
            return None
        n = len(block)
        try:
            values = pa.array(block.to_numpy(dtype=object).ravel(order="F"), from_pandas=True)  # column after column
        except (pa.ArrowInvalid, pa.ArrowTypeError):  # text beside numbers: each column converted and cast alone
            return None
        if pa.types.is_null(values.type):
            values = values.cast(pa.string())
        elif not pa.types.is_string(values.type):  # a number or a list somewhere: each column converted and cast alone
            return None
        if len(self.null_values) and values.null_count < len(values):
            tokens = pc.is_in(values, value_set=self.null_values)
            if pc.any(tokens).as_py():
                values = pc.if_else(tokens, pa.scalar(None, pa.string()), values)
        return {name: values.slice(j * n, n) for j, name in enumerate(self.columns)}

    def cast(self, name: str, arr: pa.Array) -> pa.Array:
        """A request column as training read it: ids sent as numbers become the text a CSV held, numbers sent as text are
        parsed, list elements cast likewise; dense columns stay numbers (the encoder reads both)."""
        target = self.types.get(name)
        if pa.types.is_dictionary(arr.type):  # a pandas category: its values, so that they are read as any others
            arr = arr.dictionary_decode()
        self._one_kind_of_value(name, arr, target)
        if _keys.is_text(arr.type):  # pandas' strings arrive as large_string
            if arr.type != pa.string():
                arr = arr.cast(pa.string())
            numbers = target is not None and (pa.types.is_integer(target) or pa.types.is_floating(target) or pa.types.is_boolean(target))
            absent = self.absent_texts if numbers else self.null_values
            if len(absent):  # the CSV reader's missing-value tokens ("" by default) are nulls; in a number column, ABSENT_TEXTS too
                tokens = pc.is_in(arr, value_set=absent)
                if pc.any(tokens).as_py():
                    arr = pc.if_else(tokens, pa.scalar(None, pa.string()), arr)
            if target is not None and pa.types.is_integer(target):
                arr = _whole_texts(arr)
        if _values.is_list(arr.type) and name in self.single_valued:
            self._one_value_per_row(name, arr)
        if target is None or pa.types.is_null(arr.type) or pa.types.is_null(target) or arr.type == target:
            return arr
        if name in self.dense_columns and pa.types.is_string(target):
            return arr if pa.types.is_integer(arr.type) or pa.types.is_floating(arr.type) else arr.cast(pa.string())
        if pa.types.is_string(target) and _values.is_list(arr.type):  # a multi-hot text column sent as a list
            target = pa.list_(pa.string())
        if _values.is_list(target) and not _values.is_list(arr.type):
            example = "['a', 'b']" if _keys.is_text(target.value_type) else "[3, 7, 9]"
            raise self.error(f"column {name!r} holds {arr.type} values, but the model reads a list per row in it ({target}). "
                                 f"Fix: send a list (e.g. {example}) for each row")
        if pa.types.is_floating(arr.type) and not pa.types.is_floating(target):  # ids sent as numbers, made floats
            self._exact_ids(name, arr)
            arr = integral(arr)
            if pa.types.is_floating(arr.type) and pa.types.is_integer(target):
                self._whole_ids(name, arr, target)
        try:
            return arr.cast(target)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
            raise self.error(f"column {name!r} cannot be read as {target} ({str(e).splitlines()[0]}): the model was trained "
                                 f"on {target} values in it. Fix: send {target} values") from None

    def _one_kind_of_value(self, name: str, arr: pa.Array, target: pa.DataType | None) -> None:
        """Raises RequestError (MLflow's ``BAD_REQUEST``) for values of column ``name`` (or of its lists) that name no value
        of the type training read: a boolean in a column training did not read as booleans — cast, ``True`` would
        silently be the id 1, the price 1.0 or the text ``"true"`` (which a file written by pandas holds as ``"True"``) —
        and values that are neither text, numbers nor lists (a dict, a date, bytes), which Arrow cannot cast, or casts to
        text training never held (a date's ``"2024-01-02 00:00:00"``)."""
        values = arr.type.value_type if _values.is_list(arr.type) else arr.type
        wanted = target.value_type if target is not None and _values.is_list(target) else target
        if pa.types.is_boolean(values):
            if wanted is not None and pa.types.is_boolean(wanted):
                return
        elif (_keys.is_text(values) or pa.types.is_integer(values) or pa.types.is_floating(values) or pa.types.is_decimal(values)
              or pa.types.is_null(values)):
            return
        flat = pc.list_flatten(arr) if _values.is_list(arr.type) else arr
        first = int(pc.index(pc.is_valid(flat), True).as_py())
        if first < 0:  # only missing values: read as missing, whatever their type
            return
        row = int(pc.list_parent_indices(arr)[first].as_py()) if _values.is_list(arr.type) else first
        value = flat[first].as_py()
        reads = self._reads(name, target)
        if pa.types.is_boolean(values):
            text = (wanted is None or _keys.is_text(wanted)) and name not in self.dense_columns  # a CSV's dense column: numbers
            becomes = f"the text {str(value).lower()!r}" if text else str(int(value))
            raise self.error(f"request row {row}, column {name!r} holds the boolean {value!r}, but the model reads {reads} in it: "
                             f"read as such, it would silently become {becomes}. Fix: send {reads} in {name!r}"
                             + (f", as the training files held it (e.g. the text {str(value)!r})" if text else ""))
        raise self.error(f"request row {row}, column {name!r} holds {value!r} ({values}), but the model reads {reads} in it. "
                         f"Fix: send {reads} in {name!r}")

    def _reads(self, name: str, target: pa.DataType | None) -> str:
        """What the model reads in column ``name``, in words, for a message."""
        if name in self.dense_columns:
            return "numbers (or their text)"
        if target is not None and _values.is_list(target):
            return f"a list of {self._reads(name, target.value_type).removesuffix(' (or their text)')} per row"
        if target is not None and pa.types.is_integer(target):
            return f"whole numbers ({target}) or their text"
        if target is not None and (pa.types.is_floating(target) or pa.types.is_boolean(target)):
            return f"{target} values"
        return "text"

    def _one_value_per_row(self, name: str, arr: pa.Array) -> None:
        """Raises RequestError (MLflow's ``BAD_REQUEST``) for a list sent in column ``name``, which training read one value
        per row in: the encoder would read a list in an id column as a multi-hot bag (two users pooled into one row
        training never saw: a silently wrong score), and Arrow cannot cast one in a dense column."""
        row = int(pc.index(pc.is_valid(arr), True).as_py())
        listed = sorted(set(self.columns) - self.single_valued)
        raise self.error(f"request row {row}, column {name!r} holds a list ({arr[row].as_py()!r}), but the model reads one value "
                         f"per row in it. Fix: send one value per row in {name!r}"
                         f"{f' (a list per row only in {listed})' if listed else ''}")

    def _whole_ids(self, name: str, arr: pa.Array, target: pa.DataType) -> None:
        """Raises RequestError (MLflow's ``BAD_REQUEST``) for a number that is not whole (``3.7``) in column ``name``,
        whose ids training read as integers, named with its row and value (Arrow's own refusal, ``Float value 3.700000 was
        truncated converting to int64``, names neither); never cut to the id 3."""
        finite = pc.fill_null(pc.is_finite(arr), True)
        whole = pc.and_(finite, pc.equal(pc.floor(arr), arr))
        row = int(pc.index(pc.fill_null(whole, True), False).as_py())
        if row < 0:
            return
        raise self.error(f"request row {row}, column {name!r} holds {arr[row].as_py()!r}, which is not a whole number, but the model "
                         f"reads {self._reads(name, target)} in it: no id is a fraction, and cut it would be another id. "
                         f"Fix: send the ids of {name!r} as whole numbers, or as their text")

    def _exact_ids(self, name: str, arr: pa.Array) -> None:
        """Raises RequestError (MLflow's ``BAD_REQUEST``) when ids of column ``name`` arrive as floats beyond
        :data:`EXACT_FLOAT` — where a float no longer holds every integer, so the id may already have lost its last digits
        (pandas parses a JSON request's integer column with a ``null`` in it as floats): keyed, it would silently read
        another id's row."""
        beyond = pc.greater(pc.abs(arr), EXACT_FLOAT)
        if pc.any(beyond).as_py():
            value = arr.filter(beyond)[0].as_py()
            raise self.error(f"column {name!r} holds the id {value:.0f} as a floating-point number, which holds integers exactly only up "
                             f"to 2**53: its last digits may be lost already (a JSON request's integers in a column that also holds a "
                             f"null are parsed as floats). Fix: send the ids as text (JSON strings), as the signature says")


def _arrow_column(series: Any) -> pa.Array:
    """A request column (a pandas Series) as one Arrow array, converted as ``pa.Table.from_pandas`` converts each column
    (``pa.array(..., from_pandas=True)``: NaN and None are nulls), without building a table and its pandas metadata first:
    per request that costs more than the conversion itself for a few rows. A column of a NumPy dtype is handed over as its
    array (what ``pa.array`` takes from the Series anyway); extension and categorical dtypes as the Series."""
    try:
        arr = pa.array(series.to_numpy() if isinstance(series.dtype, np.dtype) else series, from_pandas=True)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        if series.dtype != object:
            raise
        # MLflow's `inputs` form hands each list cell over as a NumPy array, an empty one as float64 beside text arrays,
        # which Arrow does not convert together: as Python lists they are one list type
        arr = pa.array([cell.tolist() if isinstance(cell, np.ndarray) else cell for cell in series], from_pandas=True)
    return arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr


def _whole_texts(arr: pa.Array) -> pa.Array:
    """Text ids of an integer column with the decimal point pandas writes for an integer column with gaps (``"772.0"``,
    in ``to_csv`` and ``astype(str)``) as the integer's text (``"772"``), exactly — a JSON ``772.0`` is read as 772 too
    (:func:`integral`); any other text is left for the cast to name."""
    whole = pc.match_substring_regex(arr, WHOLE_TEXT)
    if not pc.any(whole).as_py():
        return arr
    return pc.if_else(whole, pc.replace_substring_regex(arr, r"\.0*$", ""), arr)


def integral(arr: pa.Array) -> pa.Array:
    """Floats that are all whole numbers as int64 (pandas turns an id column with a missing value into floats)."""
    if pa.types.is_floating(arr.type):
        values = arr.drop_null().to_numpy(zero_copy_only=False)
        if np.all(np.isfinite(values)) and np.all(values == np.round(values)):
            return arr.cast(pa.int64())
    return arr
