"""Column schema of tabular data: the column kinds and the schema they make, checked as a config is read.

A data config lists a ``label`` column (or, for multi-task models, ``labels``: task name → column,
each ``binary`` or ``regression`` by ``label_kinds``), ``dense`` columns (each with a missing-value fill and a
transform) and ``sparse`` columns (integer ids, hashed values or hexadecimal strings; single- or
multi-hot): :class:`DenseColumn`, :class:`SparseColumn`, together a :class:`Schema`. Its stored forms, a YAML schema
file and a Parquet file's metadata, are :mod:`recsys_runner.data.schema_files`'; :mod:`recsys_runner.data.encoding.rows`
turns rows into model inputs by it; its ``sequences`` (``data.sequences`` groups) are read, written back and checked by
:mod:`recsys_runner.data.schema_sequences`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from recsys_runner.data.collision import ManagedCollisionConfig, collision_config
from recsys_runner.data.schema_sequences import check_group
from recsys_runner.errors import require
from recsys_runner.features import POOLINGS, FeatureSpec, SequenceGroup, SparseFeature, check_embedding_dim

if TYPE_CHECKING:  # the schema holds the fitted vocabularies; encoding, which fits them, builds on the schema
    from recsys_runner.data.encoding.vocabulary import Vocabulary

DENSE_TRANSFORMS = ("none", "log1p")
DENSE_NORMALIZATIONS = ("none", "zscore")
SPARSE_ENCODINGS = ("id", "mod", "hash", "vocab", "raw", "bucketize")
LABEL_KINDS = ("binary", "regression", "multiclass")
"""How a label column is checked: ``binary`` (every value 0 or 1), ``regression`` (any finite float) or ``multiclass``
(a class index: an integer >= 0; the model's task checks it is below its ``num_classes``)."""


@dataclass(kw_only=True)
class DenseColumn:
    """One float input column (an entry of ``data.dense``)."""

    name: str
    """Column name in the file (or in ``data.column_names`` for header-less CSV)."""
    transform: str = "none"
    """``none``, or ``log1p``: clamp negatives to 0, then ``log(1 + x)`` (the usual Criteo count transform)."""
    fill: float = 0.0
    """Value used where the field is missing (null / empty / the CSV missing-value token)."""
    clip: list[float] | None = None
    """``[lo, hi]``: values clamped into this range after ``fill``, before ``transform`` and ``normalize``; ``null``: none."""
    normalize: str = "none"
    """``none``, or ``zscore``: ``(x - mean) / std`` after ``fill``, ``clip`` and ``transform``."""
    mean: float | None = None
    """``normalize: zscore``: the mean subtracted. ``null``: fitted on a sample of the training files (after ``fill``,
    ``clip`` and ``transform``) when training starts, then stored with the model (``encoders.json``)."""
    std: float | None = None
    """``normalize: zscore``: the standard deviation divided by (``> 0``). ``null``: fitted like ``mean`` (a constant
    column's ``0`` is stored as ``1``, with a note in the log)."""

    def __post_init__(self) -> None:
        key = f"data.dense[{self.name}]"
        require(self.transform in DENSE_TRANSFORMS, f"{key}.transform={self.transform!r} must be one of {DENSE_TRANSFORMS}")
        require(math.isfinite(self.fill), f"{key}.fill must be a finite number, got {self.fill}")
        if self.clip is not None:
            bounds = list(self.clip)
            require(len(bounds) == 2 and all(_finite(b) for b in bounds) and float(bounds[0]) < float(bounds[1]),
                    f"{key}.clip={bounds} must be [lo, hi]: two finite numbers with lo < hi, e.g. {key}.clip=[0, 1000]")
            self.clip = [float(bounds[0]), float(bounds[1])]
        require(self.normalize in DENSE_NORMALIZATIONS, f"{key}.normalize={self.normalize!r} must be one of {DENSE_NORMALIZATIONS}")
        require(self.normalize == "zscore" or (self.mean is None and self.std is None),
                f"{key}: mean={self.mean} / std={self.std} apply only with normalize=zscore. Fix: {key}.normalize=zscore, "
                f"or drop mean and std")
        require(self.mean is None or _finite(self.mean), f"{key}.mean must be a finite number or null, got {self.mean}")
        require(self.std is None or (_finite(self.std) and self.std > 0),
                f"{key}.std must be a positive finite number or null (fitted from the data), got {self.std}")
        self.mean = None if self.mean is None else float(self.mean)
        self.std = None if self.std is None else float(self.std)


def _finite(value: object) -> bool:
    """``value`` is a finite int or float (not a bool, not text)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(kw_only=True)
class SparseColumn:
    """One categorical input column (an entry of ``data.sparse``); it becomes one sparse feature."""

    name: str
    """Column name in the file; also the feature's name."""
    num_embeddings: int | None = None
    """Rows of the feature's embedding table: ids must lie in ``[0, num_embeddings)``. ``null``: sized from the
    data (``recsys_runner/data/encoding/fit.py``; the run logs the size it chose): a vocabulary of the values in a sample of
    the files plus ``oov_buckets`` rows, or, when the sample does not cover the column, its distinct values times
    ``data.infer.bucket_margin``, rounded up."""
    encoding: str | None = None
    """``id``: values are ids already (an id outside the table is a bad row); ``mod``: integer value
    modulo ``num_embeddings``; ``hash``: any value (string or integer) hashed into ``num_embeddings`` buckets;
    ``vocab``: each value of the sample of the training files gets a row of its own (the most frequent first, up to
    ``num_embeddings - oov_buckets``), every other value is hashed into the last ``oov_buckets`` rows, so ids unseen
    in training never share a row with seen ones (the vocabulary is fitted when training starts and stored with the model).
    ``raw``: the raw id (an integer in ``[0, managed_collision.input_hash_size)``, text hashed into it), mapped to a row
    by the model's managed-collision module; only with ``managed_collision``, whose encoding it is.
    ``bucketize``: a number becomes the id of its bucket between ``boundaries`` (set by ``boundaries`` / ``quantiles``).
    ``null``: ``id`` when ``num_embeddings`` is given; when the data sizes it, ``vocab`` if the sample covers the
    column (``data.infer.max_unseen_fraction``), else ``hash`` (``mod`` with ``hex``)."""
    oov_buckets: int | None = None
    """``encoding: vocab``: rows shared by values outside the vocabulary (``null``: ``data.infer.oov_buckets``)."""
    hex: bool = False
    """Values are hexadecimal strings (Criteo's categoricals), parsed to integers before ``encoding``."""
    separator: str | None = None
    """Multi-hot in CSV: the delimiter between values inside one field (e.g. ``"|"``). Parquet list
    columns are multi-hot without it. ``null``: one value per field."""
    pooling: str | None = None
    """How a multi-hot bag becomes one vector: ``sum`` or ``mean``. ``null``: ``mean`` for the features of a table that a
    history reads (``data.sequences``: a history and its candidate), ``sum`` for the others."""
    embedding_dim: int | None = None
    """Width of this feature's table; ``null`` takes ``model.embedding_dim`` (models whose arches combine embeddings
    pairwise, DeepFM and DLRM, need one width: their ``same_embedding_width``)."""
    table: str | None = None
    """Name of a table shared with other features; ``null`` gives the feature its own table."""
    managed_collision: ManagedCollisionConfig | None = None
    """Map raw ids to the table's ``num_embeddings`` slots with TorchRec's managed-collision module (admission and
    eviction) instead of hashing (``recsys_runner/data/collision.py``, docs/data.md); ``encoding`` is then ``raw``."""
    boundaries: list[float] | None = None
    """A numeric column bucketized into ids (``encoding: bucketize``, set by this): the id of ``x`` is the number of
    boundaries ``<= x`` (``searchsorted(boundaries, x, side='right')``), in ``[0, len(boundaries)]``; a missing value
    reads bucket ``0``. Strictly increasing finite numbers; ``num_embeddings`` defaults to ``len(boundaries) + 1``."""
    quantiles: int | None = None
    """``>= 2``: ``boundaries`` fitted as the ``quantiles``-quantiles of the column in a sample of the training files
    (repeats dropped) when training starts, then stored with the model; ``boundaries`` given: unused."""
    cross: list[str] | None = None
    """A crossed feature: the columns listed (two or more, each single-valued; they need not be features themselves)
    combined per row and hashed into ``num_embeddings`` rows (required; ``encoding: hash``). ``name`` is then the new
    feature's name, not a column of the files. A row missing any of the values gets an empty bag for the cross."""
    weighted: bool = False
    """The values are ``id:weight`` pairs (``"12:0.5|7:2"``, or a Parquet list of such strings): each id's embedding is
    scaled by its weight when the bag is pooled (a weighted sum; ``pooling: sum``)."""
    weights: str | None = None
    """A column of float weights parallel to this one (a Parquet list, or text split at this column's ``separator``):
    the ``i``-th weight scales the ``i``-th id when the bag is pooled; a row whose lists differ in length is a bad row."""
    vocab_file: str | None = None
    """A fixed vocabulary: a text file with one value per line, line ``i`` (from 1) becoming row ``i - 1``; every other value
    is hashed into ``oov_buckets`` rows after them (``encoding: vocab``, ``num_embeddings`` = lines + ``oov_buckets``).
    Read once, when training starts, and stored with the model like a fitted vocabulary."""
    max_values: int | None = None
    """A multi-hot bag's cap: a row's values after its first ``max_values`` are dropped (their weights with them), such rows
    counted (``data/truncated_lists``) and warned of once, with the longest list seen. ``null``: every value is pooled, as
    long as the list is. A history (``data.sequences``) is cut by its group's ``max_len`` instead. Stored with the model,
    so evaluate, predict and the served model cut alike."""

    def __post_init__(self) -> None:
        key = f"data.sparse[{self.name}]"
        self.managed_collision = collision_config(self.managed_collision, ManagedCollisionConfig, f"{key}.managed_collision")
        if self.cross is not None:
            self._check_cross(key)
        if self.vocab_file is not None:
            self._check_vocab_file(key)
        if self.weighted or self.weights is not None:
            self._check_weights(key)
        if self.managed_collision is not None:
            self._check_managed(key)
        if self.boundaries is not None or self.quantiles is not None or self.encoding == "bucketize":
            self._check_buckets(key)
        if self.encoding is None and self.num_embeddings is not None:
            self.encoding = "id"  # unsized: decided when the data sizes it (vocab or hash)
        require(self.num_embeddings is None or self.num_embeddings > 0, f"{key}.num_embeddings must be positive, got {self.num_embeddings}")
        require(self.max_values is None or (isinstance(self.max_values, int) and self.max_values > 0),
                f"{key}.max_values={self.max_values!r} must be a positive integer (the values kept of a row's list), or null for no cap")
        require(self.max_values is None or self.cross is None, f"{key}.max_values={self.max_values} caps a list, but a cross has "
                f"one value per row. Fix: drop {key}.max_values")
        require(self.encoding is None or self.encoding in SPARSE_ENCODINGS,
                f"{key}.encoding={self.encoding!r} must be one of {SPARSE_ENCODINGS}")
        require(self.encoding != "raw" or self.managed_collision is not None, f"{key}.encoding=raw passes raw ids, which only a "
                f"managed-collision table maps to rows. Fix: add {key}.managed_collision={{}} (docs/data.md), or encoding=hash")
        require(self.oov_buckets is None or self.oov_buckets >= 1, f"{key}.oov_buckets must be at least 1, got {self.oov_buckets}")
        require(self.encoding != "vocab" or self.num_embeddings is None or self.oov_buckets is None
                or self.num_embeddings > self.oov_buckets,
                f"{key}: num_embeddings={self.num_embeddings} leaves no row for the vocabulary beside oov_buckets={self.oov_buckets}")
        require(self.pooling is None or self.pooling in POOLINGS, f"{key}.pooling={self.pooling!r} must be one of {sorted(POOLINGS)}")
        if self.embedding_dim is not None:
            check_embedding_dim(f"{key}.embedding_dim", self.embedding_dim)
        require(self.separator is None or len(self.separator) > 0, f"{key}.separator must be a non-empty string or null")
        require(not (self.hex and self.encoding == "hash"),
                f"{key}: hex=true parses values to integers, which encoding=hash does not need; use encoding=mod with hex=true, or hex=false")

    def _check_cross(self, key: str) -> None:
        """A cross: two or more distinct column names, hashed (``encoding: hash``) into a given ``num_embeddings``."""
        raw: Any = self.cross
        listed = not isinstance(raw, str | bytes | dict) and hasattr(raw, "__iter__")
        parts = list(raw) if listed else []
        require(listed and all(isinstance(p, str) and p for p in parts),
                f"{key}.cross={raw!r} must be a list of column names, e.g. {key}.cross=[user_id, item_category]")
        require(len(parts) >= 2, f"{key}.cross={parts} crosses fewer than 2 columns. Fix: list two or more columns, e.g. "
                f"{key}.cross=[user_id, item_category] (a single column is a plain data.sparse entry)")
        require(len(set(parts)) == len(parts), f"{key}.cross={parts} names a column twice. Fix: list each column once")
        require(self.name not in parts, f"{key}.cross={parts} includes the entry's own name; a cross's name is the new feature's. "
                f"Fix: give the entry another name, e.g. name: {'_x_'.join(parts)}")
        self.cross = parts
        require(self.encoding in (None, "hash"), f"{key}.encoding={self.encoding!r}: a cross is hashed (encoding=hash). Fix: drop "
                f"{key}.encoding (cross sets it)")
        require(self.separator is None, f"{key}: cross combines single values, but separator={self.separator!r} splits a field into "
                f"several. Fix: drop {key}.separator (the crossed columns must be single-valued)")
        others = {"hex": self.hex, "managed_collision": self.managed_collision is not None, "boundaries": self.boundaries is not None,
                  "quantiles": self.quantiles is not None, "vocab_file": self.vocab_file is not None, "weighted": self.weighted,
                  "weights": self.weights is not None}
        clash = [k for k, v in others.items() if v]
        require(not clash, f"{key}: cross hashes the raw values of its columns, which {clash} would change. Fix: drop "
                f"{', '.join(f'{key}.{k}' for k in clash)}")
        require(self.num_embeddings is not None, f"{key}.cross needs {key}.num_embeddings: the rows the combinations are hashed "
                f"into. Fix: set it, e.g. {key}.num_embeddings=100000 (about the number of distinct combinations, or more)")
        self.encoding = "hash"

    def _check_vocab_file(self, key: str) -> None:
        """A vocabulary from a file: ``encoding: vocab``, no other mapping of values to rows."""
        require(isinstance(self.vocab_file, str) and self.vocab_file != "",
                f"{key}.vocab_file={self.vocab_file!r} must be the path of a text file with one value per line")
        require(self.encoding in (None, "vocab"), f"{key}.encoding={self.encoding!r}: vocab_file gives each listed value a row "
                f"(encoding=vocab). Fix: drop {key}.encoding (vocab_file sets it), or drop {key}.vocab_file")
        clash = [k for k, v in {"managed_collision": self.managed_collision is not None, "boundaries": self.boundaries is not None,
                                "quantiles": self.quantiles is not None}.items() if v]
        require(not clash, f"{key}: vocab_file maps values to rows, which {clash} also do. Fix: drop {key}.vocab_file or "
                f"{', '.join(f'{key}.{k}' for k in clash)}")
        self.encoding = "vocab"

    def _check_weights(self, key: str) -> None:
        """A weighted feature: ``weighted`` (``id:weight`` values) or a ``weights`` column, pooled by a weighted sum."""
        require(not (self.weighted and self.weights is not None), f"{key}: weighted=true reads each id's weight from its "
                f"'id:weight' value and weights={self.weights!r} from another column; choose one. Fix: drop {key}.weighted or {key}.weights")
        if self.weights is not None:
            require(isinstance(self.weights, str) and self.weights not in ("", self.name),
                    f"{key}.weights={self.weights!r} must name another column: a list of floats parallel to {self.name!r}")
        require(self.pooling in (None, "sum"), f"{key}.pooling={self.pooling!r}: a weighted bag is pooled as the weighted sum of "
                f"its embeddings. Fix: {key}.pooling=sum (or leave it out)")
        require(self.managed_collision is None, f"{key}: weights do not apply to a managed-collision table here. Fix: drop "
                f"{key}.managed_collision, or the weights")
        require(self.boundaries is None and self.quantiles is None, f"{key}: boundaries/quantiles bucketize numbers, which "
                f"carry no weights. Fix: drop {key}.weighted / {key}.weights, or the boundaries/quantiles")

    @property
    def is_weighted(self) -> bool:
        """The feature's bags are pooled with per-id weights (``weighted`` or ``weights``)."""
        return self.weighted or self.weights is not None

    @property
    def input_columns(self) -> list[str]:
        """The columns of the files this entry reads: the crossed columns of a cross, else its own (and its ``weights``)."""
        if self.cross is not None:
            return list(self.cross)
        return [self.name, *([self.weights] if self.weights is not None else [])]

    def _check_buckets(self, key: str) -> None:
        """A bucketized column: ``boundaries`` strictly increasing (or ``quantiles`` to fit them), ``encoding: bucketize``,
        and ``num_embeddings`` (``len(boundaries) + 1`` unless set) holding every bucket."""
        require(self.encoding in (None, "bucketize"), f"{key}.encoding={self.encoding!r} does not read boundaries/quantiles, which "
                f"bucketize a numeric column. Fix: drop {key}.encoding (boundaries set encoding=bucketize), or drop the boundaries/quantiles")
        require(self.boundaries is not None or self.quantiles is not None, f"{key}.encoding=bucketize needs {key}.boundaries "
                f"(e.g. [0, 10, 100]) or {key}.quantiles (e.g. 10: fitted from the data)")
        require(not self.hex, f"{key}: hex=true parses ids, but bucketize reads numbers. Fix: {key}.hex=false")
        self.encoding = "bucketize"
        require(self.quantiles is None or (isinstance(self.quantiles, int) and self.quantiles >= 2),
                f"{key}.quantiles={self.quantiles!r} must be an integer >= 2 (the number of buckets fitted), e.g. {key}.quantiles=10")
        if self.boundaries is not None:
            bounds = list(self.boundaries)
            require(len(bounds) >= 1 and all(_finite(b) for b in bounds), f"{key}.boundaries={bounds} must be a non-empty list of "
                    f"finite numbers, e.g. [0, 10, 100]")
            floats = [float(b) for b in bounds]
            require(all(a < b for a, b in zip(floats, floats[1:], strict=False)),
                    f"{key}.boundaries={bounds} must be strictly increasing, e.g. [0, 10, 100]")
            self.boundaries = floats
            if self.num_embeddings is None:
                self.num_embeddings = len(floats) + 1
            require(self.num_embeddings >= len(floats) + 1, f"{key}.num_embeddings={self.num_embeddings} is below the "
                    f"{len(floats) + 1} buckets of {len(floats)} boundaries. Fix: drop {key}.num_embeddings (it defaults to "
                    f"len(boundaries) + 1)")
        elif self.num_embeddings is not None and self.quantiles is not None:
            require(self.num_embeddings >= self.quantiles, f"{key}.num_embeddings={self.num_embeddings} is below the up to "
                    f"{self.quantiles} buckets of quantiles={self.quantiles}. Fix: drop {key}.num_embeddings")

    def _check_managed(self, key: str) -> None:
        """A managed column is sized by its config (its slots) and encoded ``raw``: the model, not the data, maps ids to rows."""
        assert self.managed_collision is not None
        require(self.num_embeddings is not None, f"{key}.managed_collision needs {key}.num_embeddings: the number of slots "
                f"(rows) the managed-collision module maps raw ids to. Fix: set it, e.g. {key}.num_embeddings=100000")
        require(self.encoding in (None, "raw"), f"{key}.encoding={self.encoding!r} hashes ids in the data, but "
                f"managed_collision maps raw ids itself. Fix: {key}.encoding=raw (or leave it out)")
        self.encoding = "raw"
        self.managed_collision.check(f"{key}.managed_collision", self.num_embeddings)

    @property
    def size(self) -> int:
        """``num_embeddings`` once known (a :class:`Schema`'s columns are always sized)."""
        assert self.num_embeddings is not None, f"data.sparse[{self.name}] is not sized yet"
        return self.num_embeddings

    def feature(self, default_pooling: str = "sum") -> SparseFeature:
        """The sparse feature; ``default_pooling`` where ``pooling`` is ``null`` (``mean`` on tables histories read)."""
        managed = self.managed_collision.spec() if self.managed_collision is not None else None
        return SparseFeature(self.name, self.size, self.embedding_dim, self.pooling or default_pooling, self.table, managed,
                             weighted=self.is_weighted)

    @property
    def table_name(self) -> str:
        return self.table or f"t_{self.name}"


def check_labels(label: str | None, labels: dict[str, str] | None, label_kinds: dict[str, str] | None) -> None:
    """Exactly one of ``label`` / ``labels``; distinct label columns; ``label_kinds`` naming tasks of ``labels``.

    Raises:
        ConfigError: naming the key and the fix.
    """
    require(label is None or labels is None,
            f"data.label={label!r} and data.labels={labels} are both set; a file has one label column or a "
            f"mapping of task names to label columns. Fix: data.label=null (several labels) or data.labels=null (one label)")
    require(label is not None or labels is not None,
            "no label column: set data.label=<column> (one binary label) or data.labels='{ctr: click, cvr: conversion}' "
            "(task name -> column, one label per task of a multi-task model)")
    if labels is not None:
        require(len(labels) > 0, "data.labels is empty; give task name -> column, e.g. data.labels='{ctr: click, cvr: conversion}', "
                "or use data.label=<column> for one label")
        columns = list(labels.values())
        shared = sorted({c for c in columns if columns.count(c) > 1})
        require(not shared, f"data.labels={labels} reads column(s) {shared} for several tasks; give each task its own column")
    kinds = label_kinds or {}
    if kinds:
        require(labels is not None, f"data.label_kinds={kinds} needs data.labels (task name -> column); a single data.label is binary")
        unknown = sorted(set(kinds) - set(labels or {}))
        require(not unknown, f"data.label_kinds names task(s) {unknown} that are not in data.labels={labels}; "
                f"valid task names: {list(labels or {})}")
        wrong = {t: k for t, k in kinds.items() if k not in LABEL_KINDS}
        require(not wrong, f"data.label_kinds has {wrong}; each kind must be one of {LABEL_KINDS}")


@dataclass(kw_only=True)
class Schema:
    """Label(s), dense and sparse columns together.

    Exactly one of ``label`` (one binary label, ``labels [n]``) and ``labels`` (task name → column,
    ``labels [n, T]`` in the mapping's order) is set; ``label_kinds`` maps some of ``labels``' tasks
    to ``regression`` (any finite float), the others are ``binary`` (0 or 1).
    """

    label: str | None = None
    labels: dict[str, str] | None = None
    label_kinds: dict[str, str] | None = None
    label_threshold: float | None = None
    """A numeric ``label`` column made binary: ``1`` where the value is ``>=`` this (ratings → clicks), else ``0``."""
    dense: list[DenseColumn] = field(default_factory=list)
    sparse: list[SparseColumn] = field(default_factory=list)
    sequences: list[SequenceGroup] = field(default_factory=list)
    """Histories among ``sparse`` (``data.sequences``, :func:`~recsys_runner.data.schema_sequences.sequence_groups`): list
    columns of equal length per row."""
    vocabularies: dict[str, Vocabulary] = field(default_factory=dict, repr=False, compare=False)
    """The vocabulary of each ``encoding: vocab`` column, by column name, built from a sample of the training files
    (:func:`recsys_runner.data.encoding.fit.complete_schema`); runtime state, never written to a schema file."""

    def __post_init__(self) -> None:
        check_labels(self.label, self.labels, self.label_kinds)
        require(self.label_threshold is None or (self.labels is None and math.isfinite(self.label_threshold)),
                f"data.label_threshold={self.label_threshold} applies to one data.label (a finite number), not to data.labels")
        unsized = [c.name for c in self.sparse if c.num_embeddings is None]
        require(not unsized, f"data.sparse columns {unsized} have no num_embeddings; they are sized from the data when the data "
                f"module is built (recsys_runner/data/encoding/fit.py)")
        for group in self.sequences:
            check_group(group, self.sparse, [*self.label_columns, *(c.name for c in self.dense)])
        names = [*self.label_columns, *(c.name for c in self.dense), *(c.name for c in self.sparse), *self.timestamp_columns,
                 *(c.weights for c in self.sparse if c.weights is not None)]
        dupes = sorted({n for n in names if names.count(n) > 1})
        require(not dupes, f"columns {dupes} appear more than once among data.label(s), data.dense, data.sparse, the timestamps of "
                f"data.sequences and the weights columns of data.sparse; each column has one role")
        self._check_crosses_and_weights()
        require(len(self.sparse) > 0, "data.sparse lists no columns: the models need at least one sparse feature, "
                "e.g. data.sparse=[{name: item_id, num_embeddings: 100000}]")

    def _check_crosses_and_weights(self) -> None:
        """Crosses read no label or event-time column; weighted features are pooled bags, never a history's (unpooled) table."""
        excluded = {*self.label_columns, *self.timestamp_columns}
        for c in self.sparse:
            wrong = sorted(excluded & set(c.cross or ()))
            require(not wrong, f"data.sparse[{c.name}].cross={c.cross} reads {wrong}, a label or event-time column. Fix: cross "
                    f"input columns only")
        histories = {f for g in self.sequences for f in g.features}
        crossed = sorted(c.name for c in self.sparse if c.cross is not None and c.name in histories)
        require(not crossed, f"data.sparse {crossed} are crosses (one value per row) named as histories in data.sequences. Fix: "
                f"remove them from data.sequences")
        capped = sorted(c.name for c in self.sparse if c.max_values is not None and c.name in histories)
        require(not capped, f"data.sparse {capped} set max_values but are histories in data.sequences, whose group's max_len cuts "
                f"them (and every list of the group alike). Fix: drop max_values from them; set data.sequences.<group>.max_len")
        unpooled = self.sequence_tables
        weighted = [c.name for c in self.sparse if c.is_weighted and c.table_name in unpooled]
        require(not weighted, f"data.sparse {weighted} are weighted but read a table a history reads (data.sequences), whose "
                f"features are embedded one vector per event, where weights do not apply. Fix: give them a table of their own, "
                f"or drop weighted / weights")

    def _single_label(self) -> str:
        """The one label column (``labels`` unset): :func:`check_labels` made sure ``label`` is then set."""
        assert self.label is not None, "a Schema has data.label or data.labels"
        return self.label

    @property
    def label_columns(self) -> list[str]:
        """The label columns in ``Rows.labels`` column order (one for a single label)."""
        return list(self.labels.values()) if self.labels is not None else [self._single_label()]

    @property
    def label_tasks(self) -> list[str]:
        """Per label column: its task name (the column name itself for a single label)."""
        return list(self.labels) if self.labels is not None else [self._single_label()]

    def label_kind(self, task: str) -> str:
        return (self.label_kinds or {}).get(task, "binary")

    @property
    def timestamp_columns(self) -> list[str]:
        """The event-time columns of the sequence groups (int64 lists, carried in the batch, never embedded)."""
        return [g.timestamps for g in self.sequences if g.timestamps is not None]

    @property
    def columns(self) -> list[str]:
        """The columns read from the files: labels, dense, each sparse entry's :attr:`~SparseColumn.input_columns` (a
        cross's crossed columns, a weights column), the timestamps; each once, in that order."""
        sparse = [n for c in self.sparse for n in c.input_columns]
        return list(dict.fromkeys([*self.label_columns, *(c.name for c in self.dense), *sparse, *self.timestamp_columns]))

    @property
    def sequence_tables(self) -> set[str]:
        """The tables a history feature reads: their features pool with ``mean`` unless they set ``pooling``."""
        histories = {f for g in self.sequences for f in g.features}
        return {c.table_name for c in self.sparse if c.name in histories}

    def features(self) -> FeatureSpec:
        label: str | tuple[str, ...] = tuple(self.labels) if self.labels is not None else self._single_label()
        mean = self.sequence_tables
        sparse = tuple(c.feature("mean" if c.table_name in mean else "sum") for c in self.sparse)
        kinds = tuple(self.label_kind(t) for t in self.label_tasks) if self.labels is not None else ()
        spec = FeatureSpec(tuple(c.name for c in self.dense), sparse, label, sequences=tuple(self.sequences), label_kinds=kinds)
        spec.embedding_tables(1)  # tables shared by several features must agree: fail at build, not at shard time
        return spec
