"""Histories in file data: list columns checked for equal lengths per group, truncated to ``max_len``, event times carried.

A ``data.sequences`` group names list columns (Parquet ``list<…>``; in CSV/TSV one field with the column's ``separator``
between events, oldest first) that describe the same events, so they have equal lengths in every row, and optionally
a timestamps column (int64 event times, same lengths). :class:`~recsys_runner.data.encoding.histories.HistoryEncoder`
runs after the :class:`~recsys_runner.data.encoding.rows.Encoder` has encoded every sparse column: it flags rows whose lists in one group
differ in length (bad rows), keeps the most recent ``max_len`` events of longer histories (or the oldest, ``truncate:
oldest``) and counts such rows, and appends the event times in :attr:`~recsys_runner.features.FeatureSpec.kjt_keys`
order. :func:`token_cuts` cuts a block of rows into ``data.batch_tokens`` batches.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from recsys_runner.data.encoding.histories import Jagged, not_a_list
from recsys_runner.data.encoding.keys import is_text
from recsys_runner.data.encoding.values import is_list
from recsys_runner.data.schema import Schema
from recsys_runner.data.sequences.tokens import padded_slices, row_tokens, token_slices
from recsys_runner.errors import DataError


def check_list_columns(schema: Schema, arrow_schema: pa.Schema, path: str) -> None:
    """Every history and timestamps column of ``schema`` is a list column of the Parquet file ``path``.

    Raises:
        DataError: naming the file, the column, its type and the fix; before the first step.
    """
    for group in schema.sequences:
        for name in [*group.features, *([group.timestamps] if group.timestamps else [])]:
            if name in arrow_schema.names and not is_list(arrow_schema.field(name).type):
                raise not_a_list(path, name, group, arrow_schema.field(name).type, DataError)


def history_costs(schema: Schema, sparse: list[Jagged]) -> np.ndarray:
    """Each row's tokens (:func:`~recsys_runner.data.sequences.tokens.row_tokens`): the lengths of each group's first feature, summed."""
    index = {c.name: j for j, c in enumerate(schema.sparse)}
    lengths = sum(sparse[index[g.features[0]]][1].astype(np.int64) for g in schema.sequences)
    return row_tokens(np.asarray(lengths))


def token_cuts(costs: np.ndarray, budget: int, final: bool, padded: bool = False) -> tuple[list[tuple[int, int]], int]:
    """Batches of ``budget`` tokens over a block of rows with ``costs``, and how many rows they use; ``padded``: each
    batch's rows × its largest cost within the budget (:func:`~recsys_runner.data.sequences.tokens.padded_slices`, for rows
    sorted by cost).

    Until the ``final`` block the last (possibly under-full) slice is held back for the next rows.
    """
    slices = padded_slices(costs, budget) if padded else token_slices(costs, budget)
    if not final and slices:
        slices = slices[:-1]
    return slices, (slices[-1][1] if slices else 0)


def expected_rows(sample: pa.Table, schema: Schema, batch_tokens: int) -> int:
    """Rows a ``batch_tokens`` batch holds on average, from the history lengths of a sample of the training rows: the
    data module's ``batch_size`` (the sharding planner's cost model reads it)."""
    total = np.zeros(sample.num_rows, np.int64)
    for group in schema.sequences:
        name = group.features[0]
        arr = sample.column(name).combine_chunks()
        separator = next(c.separator for c in schema.sparse if c.name == name)
        if is_text(arr.type) and separator is not None:
            arr = pc.split_pattern(arr, separator)
        if is_list(arr.type):
            lengths = pc.fill_null(pc.list_value_length(arr), 0).to_numpy(zero_copy_only=False)
            total += np.minimum(np.asarray(lengths, np.int64), group.max_len)
    mean_cost = float(row_tokens(total).mean()) if len(total) else 1.0
    return max(1, int(batch_tokens / mean_cost))
