"""The item catalogue of file data (``data.items``), and what the file data modules share to serve it and sampled negatives.

An items file (Parquet, or delimited text), or a folder of part files (:class:`ItemParts`, read by
:mod:`recsys_runner.data.files.item_parts`), has one row per item: the item id column and the item tower's other columns,
named as in the training files. Each is encoded by the training data's own :class:`~recsys_runner.data.encoding.rows.Encoder`
for the same-named ``data.sparse`` / ``data.dense`` column, so the table's ids are the ids of the training rows (the same
vocabulary, hash or modulo). Built once when the data module is built, so that a missing column or a duplicate item stops
the run before its first step, naming the file and the column; an eval row whose item the table lacks stops it when a run
with full-corpus metrics is built (:meth:`Catalogue.eval_items_past`, checked against the items that eval ranks).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from recsys_runner.data.catalogue.items import ItemTable
from recsys_runner.data.catalogue.negatives import MinedNegatives, NegativeSampler, NegativesConfig
from recsys_runner.data.encoding.histories import truncate
from recsys_runner.data.encoding.rows import Encoder, Location
from recsys_runner.data.schema import Schema
from recsys_runner.errors import DataError, require
from recsys_runner.features import FeatureSpec

__all__ = ["Catalogue", "ItemParts", "ItemsConfig", "item_columns", "read_item_table"]

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class ItemsConfig:
    """``data.items``: the item catalogue file of a two-tower model (docs/retrieval.md, *The item catalogue*)."""

    path: str | None = None
    """One file, ``.parquet`` or delimited text (read as the training files are: ``data.delimiter``, ``data.null_values``,
    ``data.on_bad_rows``; beside Parquet training files ``,``, empty fields null; a header line as ``header`` says), or a
    folder, glob or object-store prefix of part files of one of those formats (as Spark writes a table; parts without rows
    are skipped): one row per item. ``null``: no item table."""
    header: bool | None = None
    """Whether the first line of each delimited-text items file names its columns. ``null``: as the training files'
    (``data.header``, as read; ``true`` beside Parquet training files), and an items file whose first line says otherwise
    (a header line where those have none, data where they have one) is refused at start-up, naming this key. ``false``:
    every line is an item, its columns named by ``column_names``. Parquet items files are not affected."""
    column_names: list[str] | None = None
    """Names of all the columns of a delimited-text items file, in file order: for one without a header line, or, with
    one, names that replace the header's. ``null``: the header line's names; without a header line, ``data.column_names``
    (the catalogue laid out as the training files)."""
    id: str | None = None
    """The item id column: a ``data.sparse`` column of the training data (the id of each table row, distinct)."""
    features: list[str] = field(default_factory=list)
    """The item's other columns (``data.sparse`` or ``data.dense`` columns of the training data, e.g. ``[cate_id, brand]``)."""
    popularity: str | None = None
    """A count column of the file (how often each item was seen); ``null``: the item id's counts in a sample of the
    training files (``count_rows`` rows), uniform when that finds none of the items."""
    count_rows: int = 1_000_000
    """Training rows read to count item popularity when ``popularity`` is null."""
    seen: str | None = None
    """A list column of the training data (a multi-hot ``data.sparse`` column sharing the item id's table) holding each
    row's earlier item ids: with ``metrics.exclude_seen`` the full-corpus metrics rank a query's item among the items
    not in it (besides the user tower's item-history features). ``null``: none."""

    def __post_init__(self) -> None:
        require(self.path is None or bool(self.id),
                f"data.items.path={self.path!r} needs data.items.id: the item id column, a data.sparse column, e.g. data.items.id=item_id")
        # without a file nothing reads these: an id or features set while the path is forgotten would leave the run with
        # no catalogue, silently
        described = [f"data.items.{key}" for key, value in (("id", self.id), ("features", self.features),
                     ("popularity", self.popularity), ("seen", self.seen), ("column_names", self.column_names),
                     ("header", self.header)) if value not in (None, [])]
        require(self.path is not None or not described,
                f"{', '.join(described)} describe(s) the item catalogue file, but data.items.path is null (no catalogue), so "
                f"it would do nothing. Fix: data.items.path=<items file>, or drop {', '.join(described)}")
        require(self.count_rows > 0, f"data.items.count_rows must be positive, got {self.count_rows}")
        require(self.column_names is None or len(set(self.column_names)) == len(self.column_names),
                f"data.items.column_names={self.column_names} names a column twice. Fix: one distinct name per column of the "
                f"items file, in file order")

    def check(self, schema: Schema) -> None:
        """Raise :class:`ConfigError` unless the id is a sparse column and every feature a sparse or dense column of ``schema``."""
        sparse, dense = [c.name for c in schema.sparse], [c.name for c in schema.dense]
        require(self.id in sparse, f"data.items.id={self.id!r} is not a data.sparse column of the training data ({', '.join(sparse)}). "
                f"Fix: data.items.id=<the item id column>")
        require(self.seen is None or self.seen in sparse, f"data.items.seen={self.seen!r} is not a data.sparse column of the "
                f"training data ({', '.join(sparse)}). Fix: data.items.seen=<a list column of each row's earlier item ids>, or null")
        tables = {c.name: (c.table or f"t_{c.name}") for c in schema.sparse}
        require(self.seen is None or tables.get(self.seen) == tables.get(self.id or ""),
                f"data.items.seen={self.seen!r} reads table {tables.get(self.seen or '')!r}, but the item id {self.id!r} reads "
                f"{tables.get(self.id or '')!r}: its ids must be item ids. Fix: give both the same table (data.sparse entries "
                f"with table: item)")
        unknown = [f for f in self.features if f not in sparse and f not in dense]
        require(not unknown, f"data.items.features has {unknown}, which are not data.sparse / data.dense columns of the training data "
                f"({', '.join([*sparse, *dense])}). Fix: list the item columns by their training names")


@dataclass(frozen=True)
class ItemParts:
    """The rows of ``data.items.path`` as read (:func:`~recsys_runner.data.files.item_parts.read_item_parts`): one file,
    or each part file with rows of the folder it names, in file order."""

    path: str
    """``data.items.path`` as given: a file, a folder, a glob or a URI."""
    files: tuple[str, ...]
    """The files read (parts without rows left out)."""
    starts: np.ndarray
    """``starts[p]``: the row of :attr:`table` that is the first row of ``files[p]``."""
    table: pa.Table
    """Every file's rows, the configured columns only."""
    file_rows: np.ndarray
    """``file_rows[i]``: the 0-based row in its file of :attr:`table`'s row ``i``."""
    line_offset: int | None
    """Delimited text: a row's line number is its file row + this (2 after a header line, else 1); ``None``: Parquet."""

    def where(self, row: int) -> str:
        """The file of :attr:`table`'s row ``row`` and its line (text) or row (Parquet) in it, for an error."""
        part = int(np.searchsorted(self.starts, row, side="right")) - 1
        return Location(self.files[part], "items", self.file_rows[row:row + 1], self.line_offset).describe(0)

    def files_of(self, rows: np.ndarray) -> str:
        """The files holding :attr:`table`'s ``rows``, for an error."""
        parts = np.unique(np.searchsorted(self.starts, rows, side="right") - 1)
        return ", ".join(self.files[int(p)] for p in parts)


def _raise_bad(parts: ItemParts, fix: str = "Fix the items file (data.items.path)") -> Callable[..., None]:
    """The encoder's ``bad`` callback for the items: the first bad value stops the run, naming file, row, column and ``fix``."""
    def bad(column: str, mask: np.ndarray, what: Callable[[int], str]) -> None:
        if mask.any():
            i = int(np.flatnonzero(mask)[0])
            raise DataError(f"bad item in {parts.where(i)}, column {column!r}: {what(i)}. {fix}")
    return bad


def mapping_fix(mapping: str) -> str:
    """The fix for an items file that does not encode beside rows written by ``data sequences`` (the id mapping in
    ``mapping``): most likely it holds the log's raw ids, which those rows have replaced by the mapping's table ids.

    Why not the encoder's own fix (raise ``num_embeddings``, or hash the ids): that would make the raw ids encode, each to
    a row that some other item trained, and the full-corpus metrics and ``predict``'s lists would rank a wrong catalogue
    without a word."""
    return (f"data.path's rows were written by python -m recsys_runner.data sequences, whose id mapping (in {mapping}) numbers "
            f"the log's raw ids: their columns hold table ids (id i is line i of the column's vocab/<table>.txt, {mapping}/vocab.json "
            f"names each), and so must the items file, whose raw ids would be refused or, where small enough, read as other items. "
            f"Fix: write the items file with the mapping's table ids (docs/retrieval.md, 'Items of data sequences rows')")


def _check_unique(parts: ItemParts, column: str) -> None:
    arr = parts.table.column(column)
    counts = pc.value_counts(arr)
    repeated = pc.filter(counts, pc.greater(counts.field("counts"), 1))
    if len(repeated):
        first = repeated[0].as_py()
        rows = np.flatnonzero(np.asarray(pc.equal(arr, first["values"]).to_numpy(zero_copy_only=False), dtype=bool))
        raise DataError(f"{parts.files_of(rows)} (data.items.path) has item {first['values']!r} of column {column!r} {first['counts']} "
                        f"times ({len(repeated)} ids repeat): the catalogue has each item once. Fix: deduplicate the "
                        f"{'file' if len(parts.files) == 1 else 'parts'} by {column!r}")


def item_columns(config: ItemsConfig, schema: Schema) -> list[str]:
    """The columns of the items file(s) that ``config`` reads (the id, the features, the popularity column), checked
    first against the training data's ``schema`` (a config mistake is said before any items file is opened).

    Raises:
        ConfigError: the id or a feature is not a column of the training data (:meth:`ItemsConfig.check`).
    """
    assert config.id is not None
    config.check(schema)
    return [config.id, *config.features, *([config.popularity] if config.popularity else [])]


def read_item_table(config: ItemsConfig, schema: Schema, parts: ItemParts,
                    train_sample: Callable[[int], pa.Table] | None = None, mapping: str | None = None) -> ItemTable:
    """The :class:`ItemTable` of ``parts`` (the rows of ``config.path``, its :func:`item_columns`), encoded with
    ``schema``'s columns; popularity from its column, else counted in ``train_sample(config.count_rows)`` (training rows),
    else uniform. ``mapping``: the ``data sequences`` output folder whose id mapping the training rows name, if any
    (a value that does not encode is then most likely a raw id: :func:`mapping_fix`).

    Raises:
        DataError: an item id repeats or is missing, a value does not encode (naming the file and its row).
    """
    assert config.path is not None and config.id is not None
    path, id_name, table = config.path, config.id, parts.table
    _check_unique(parts, id_name)
    encoder = Encoder(schema, error=DataError)
    if mapping is not None:
        encoder.settings_fixes = False  # its fix (a larger table, hashed ids) would make raw ids read other items' rows
    bad = _raise_bad(parts) if mapping is None else _raise_bad(parts, mapping_fix(mapping))
    whole = Location(path, "items", np.arange(0), parts.line_offset)  # text: numbers are parsed (dense, popularity)
    sparse_cols, dense_cols = {c.name: c for c in schema.sparse}, {c.name: c for c in schema.dense}
    ids, lengths = encoder._sparse(sparse_cols[id_name], table.column(id_name), whole, bad)
    bad(id_name, lengths != 1, lambda i: "the item id is missing, or a list (an item has one id)")
    features = {n: _capped(encoder, sparse_cols[n], encoder._sparse(sparse_cols[n], table.column(n), whole, bad))
                for n in [id_name, *config.features] if n in sparse_cols}
    if (line := encoder.capped_line()) is not None:
        log.info("%s (data.items.path): %s", path, line)
    dense_names = tuple(n for n in config.features if n in dense_cols)
    dense = np.stack([encoder._dense(dense_cols[n], table.column(n), whole, bad)
                      for n in dense_names], axis=1) if dense_names else np.zeros((table.num_rows, 0))
    items = ItemTable(id_name, ids, features, dense_names, dense.astype(np.float32), np.ones(table.num_rows), config.seen)
    items = _first_of_each_id(items, path)
    if config.popularity is not None:
        popularity = _popularity_column(table.column(config.popularity), parts, config.popularity, ids)
        return _with_popularity(items, popularity)
    return _with_popularity(items, _counted(items, encoder, sparse_cols[id_name], train_sample, config.count_rows))


def _capped(encoder: Encoder, col: Any, bag: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """An item feature's (ids, lengths) cut to its column's ``max_values`` as the training rows' are (so the item tower
    sees the catalogue's items as it saw them in training), counted in ``encoder.capped``."""
    cap = getattr(col, "max_values", None)
    if cap is None:
        return bag
    ids, lengths, _ = encoder._capped(col.name, cap, *bag, None)
    return ids, lengths


def _first_of_each_id(items: ItemTable, path: str) -> ItemTable:
    """``items`` keeping the first row of each encoded id: distinct raw ids that a hash or a modulo maps to one embedding row
    are one item to the model (logged, so that a too small table is seen)."""
    _, first = np.unique(items.ids, return_index=True)
    if first.size == len(items):
        return items
    log.warning("%s (data.items.path): %d items share an embedding row with another (distinct ids that data.sparse[%s]'s encoding "
                "maps to one id); each such row is one catalogue item. Fix: a larger num_embeddings, or encoding=vocab",
                path, len(items) - first.size, items.id_feature)
    return items.take(np.sort(first))


def _popularity_column(arr: pa.ChunkedArray, parts: ItemParts, column: str, ids: np.ndarray) -> np.ndarray:
    values = np.asarray(pc.cast(arr, pa.float64(), safe=False).fill_null(0).to_numpy(zero_copy_only=False), dtype=np.float64)
    wrong = ~np.isfinite(values) | (values < 0)
    if wrong.any():
        i = int(np.flatnonzero(wrong)[0])
        raise DataError(f"{parts.where(i)} (data.items.path), column {column!r} (data.items.popularity): {values[i]} is not a "
                        f"count >= 0. Fix the file, or data.items.popularity=null to count the training data")
    _, first = np.unique(ids, return_index=True)  # the rows _first_of_each_id keeps, in order
    return values[np.sort(first)]


def _counted(items: ItemTable, encoder: Encoder, column: Any, train_sample: Callable[[int], pa.Table] | None,
             count_rows: int) -> np.ndarray:
    """Each item's count in a sample of the training rows; all ones (uniform) when there is no sample or it has no item."""
    if train_sample is None:
        return np.ones(len(items))
    sample = train_sample(count_rows)
    ids, _ = encoder._sparse(column, sample.column(column.name), Location("", "sample", np.arange(sample.num_rows)),
                             lambda *_: None)
    index, found = items.index_of(ids)
    counts = np.bincount(index[found], minlength=len(items)).astype(np.float64)
    if counts.sum() == 0:
        log.warning("no item of data.items.path occurs in %d sampled training rows: item popularity is uniform", sample.num_rows)
        return np.ones(len(items))
    return counts


def _with_popularity(items: ItemTable, popularity: np.ndarray) -> ItemTable:
    return ItemTable(items.id_feature, items.ids, items.features, items.dense_names, items.dense, popularity, items.seen_feature)


def _eval_tables(split: Any) -> Iterator[tuple[pa.Table, np.ndarray, Any, int | None]]:
    """``(table, file rows, unit, line offset)`` of each piece of ``split``'s rows (its ``units``, ``source`` and
    ``select``), every column read."""
    for unit in split.units:
        line_offset = split.source.line_offset(unit.path) if hasattr(split.source, "line_offset") else None
        for table, file_rows in split.source.read(unit):
            chosen = split.select(unit, file_rows)
            if chosen is not None:
                table, file_rows = table.take(pa.array(chosen)), file_rows[chosen]
            yield table, file_rows, unit, line_offset


def check_eval_items(items: ItemTable, schema: Schema, split: Any, items_path: str, num_ids: int) -> int:
    """Raise :class:`DataError` at the first eval row (of ``split``: its ``units``, ``source`` and ``select``) whose item id
    is below ``num_ids`` and not in ``items`` (the catalogue's rankable items): full-corpus evaluation could never rank its
    positive, and the catalogue could (a catalogue lacking an item is a wrong file). Returns how many eval rows' item ids
    are ``num_ids`` or more: rows of an id mapping's OOV rows (``data sequences``; an item unknown when it was written),
    which no catalogue item can be, so they count as misses rather than stop the run."""
    column = next(c for c in schema.sparse if c.name == items.id_feature)
    encoder = Encoder(schema, error=DataError)
    past = 0
    for table, file_rows, unit, line_offset in _eval_tables(split):
        ids, lengths = encoder._sparse(column, table.column(column.name), Location(unit.path, unit.part, file_rows), lambda *_: None)
        _, found = items.index_of(ids)
        unnamed = np.asarray(ids, dtype=np.int64) >= num_ids
        past += int(unnamed.sum())
        if not (found | unnamed).all():
            k = int(np.flatnonzero(~(found | unnamed))[0])
            row = int(np.repeat(np.arange(len(lengths)), lengths)[k])
            where = Location(unit.path, unit.part, file_rows, line_offset).describe(row)
            raise DataError(f"eval row {where}: its item {table.column(column.name)[row].as_py()!r} (column {column.name!r}) is "
                            f"not in the item table {items_path} (data.items.path), so full-corpus evaluation cannot rank it. "
                            f"Fix: add the item to {items_path}, or remove such rows from the eval data")
    return past


def most_seen(items: ItemTable, schema: Schema, split: Any, columns: list[str]) -> int | None:
    """The largest number of distinct catalogue items other than its own item that one eval row of ``split`` lists in the
    sparse ``columns`` together (histories truncated to their ``max_len`` as batches are): how many items sampled
    eval negatives (``model.eval_negatives``) must leave out of some query's draw. ``None`` when a column is not a
    ``data.sparse`` column of ``schema``."""
    sparse = {c.name: c for c in schema.sparse}
    if any(c not in sparse for c in columns):
        return None
    groups = {f: g for g in schema.sequences for f in g.features}
    encoder = Encoder(schema, error=DataError)
    n, most = len(items), 0
    for table, file_rows, unit, _ in _eval_tables(split):
        where = Location(unit.path, unit.part, file_rows)
        ids, lengths = encoder._sparse(sparse[items.id_feature], table.column(items.id_feature), where, lambda *_: None)
        rows, found = items.index_of(ids)
        own = np.full(table.num_rows, -1, np.int64)
        own[np.repeat(np.arange(table.num_rows), lengths)[found]] = rows[found]
        pairs = []
        for name in columns:
            values, counts = encoder._sparse(sparse[name], table.column(name), where, lambda *_: None)
            if name in groups:
                values, counts = truncate(values, counts, groups[name].max_len, groups[name].truncate)
            at, known = items.index_of(values)
            row = np.repeat(np.arange(table.num_rows), counts)
            keep = known & (at != own[row])
            pairs.append(row[keep] * n + at[keep])
        distinct = np.unique(np.concatenate(pairs)) if pairs else np.zeros(0, np.int64)
        most = max(most, int(np.bincount(distinct // max(n, 1), minlength=1).max()))
    return most


class Catalogue:
    """What a file data module mixes in to have an item table and sampled negatives (:class:`TabularData`): the table built
    from ``data.items`` when the module is built, :meth:`item_table`, and the sampler that a shard's stream appends the
    negatives of its training batches with (:meth:`NegativeSampler.extend_stream`, in :mod:`~recsys_runner.data.files.shard_stream`)."""

    config: Any
    schema: Schema
    features: FeatureSpec
    _eval: Any
    _item_catalogue: ItemTable | None = None
    _negative_sampler: NegativeSampler | None = None

    def open_catalogue(self, train_source: Any, parts: ItemParts | None, mapping: str | None = None) -> None:
        """Build the item table of ``parts`` (``data.items.path`` read; ``None`` without one) and the negative sampler
        (the module's schema, splits and features exist by now); ``mapping``: the id mapping the training rows name."""
        items: ItemsConfig = self.config.items
        negatives: NegativesConfig = self.config.negatives
        if items.path is not None:
            assert parts is not None, "data.items.path is read by the file data module"
            self._item_catalogue = read_item_table(items, self.schema, parts, train_source.sample, mapping)
        negatives.check(self._item_catalogue, self.features, "the data has no item table. Fix: data.items.path=<items file> and "
                                                    "data.items.id=<item id column> (docs/retrieval.md)")
        if negatives.enabled and self._item_catalogue is not None:
            self._negative_sampler = NegativeSampler(negatives, self._item_catalogue, self.features, int(self.config.seed))
            self.features = self._negative_sampler.features(self.features)

    def item_table(self) -> ItemTable | None:
        return self._item_catalogue
    def negative_miner(self) -> MinedNegatives | None:
        """The lists hard negatives are mined into at each full-corpus eval (``data.negatives.mined_ratio``), or ``None``."""
        return self._negative_sampler.mined if self._negative_sampler is not None else None

    def eval_items_past(self, candidates: ItemTable, num_ids: int) -> int:
        """:func:`check_eval_items` of the eval rows against ``candidates``, the catalogue items the full-corpus eval ranks
        (ids below ``num_ids``): one pass over the eval data, asked for when a run with full-corpus metrics is built.

        Raises:
            DataError: an eval row's item could be ranked but the catalogue lacks it.
        """
        assert self.config.items.path is not None, "candidates come from the item table"
        return check_eval_items(candidates, self.schema, self._eval, self.config.items.path, num_ids)

    def eval_seen_most(self, columns: list[str], candidates: ItemTable) -> int | None:
        """:func:`most_seen` of the eval rows over ``columns`` among ``candidates``, the catalogue items the full-corpus eval
        ranks (one pass over the eval data, asked for when a run is built with ``model.eval_negatives``), or ``None`` for a
        column that is not a plain column."""
        return most_seen(candidates, self.schema, self._eval, columns)


