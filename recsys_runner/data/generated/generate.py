"""Criteo-format files with learnable labels, for tests, benchmarks and trying the runner out.

Public CTR datasets may not be redistributed, so nothing here downloads: :func:`criteo_rows`
draws rows with the real format's quirks (empty fields, negative counts, 8-digit hex
categoricals) whose click probability depends on the features, so a model trained on them beats
AUC 0.5. Writers produce the raw TSV layout and the Parquet layout ``convert`` writes (also the benchmarks'
file, with ``learnable=False``), and :func:`write_funnel_parquet` a two-label (click, conversion) Parquet file
for multi-task models.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from recsys_runner.data.files.criteo_config import CRITEO_COLUMNS, CRITEO_NUM_DENSE, CRITEO_NUM_SPARSE, criteo_schema
from recsys_runner.data.schema import Schema
from recsys_runner.data.schema_files import SCHEMA_METADATA_KEY, schema_json
from recsys_runner.errors import require


def criteo_rows(num_rows: int, *, seed: int = 0, cardinality: int = 500, missing: float = 0.05) -> dict[str, list]:
    """Raw Criteo columns as Python lists: ``label`` 0/1, ``int_*`` ints or None, ``cat_*`` hex or None."""
    rng = np.random.default_rng(seed)
    world = np.random.default_rng(12345)  # the same hidden effects for every seed: train and eval agree
    effects = world.normal(0, 0.5, size=(CRITEO_NUM_SPARSE, cardinality))
    weights = world.normal(0, 0.4, size=CRITEO_NUM_DENSE)
    codes = world.integers(0, 2**32, size=(CRITEO_NUM_SPARSE, cardinality), dtype=np.uint64)
    ids = np.minimum((cardinality * rng.random((num_rows, CRITEO_NUM_SPARSE)) ** 2).astype(np.int64), cardinality - 1)
    counts = rng.geometric(0.2, size=(num_rows, CRITEO_NUM_DENSE)) - 3  # values from -2 upwards, as in Criteo
    score = effects[np.arange(CRITEO_NUM_SPARSE), ids].sum(1) + np.log1p(np.maximum(counts, 0)) @ weights - 1.0
    labels = (rng.random(num_rows) < 1 / (1 + np.exp(-score))).astype(np.int64)
    out: dict[str, list] = {"label": labels.tolist()}
    for j in range(CRITEO_NUM_DENSE):
        col = counts[:, j].tolist()
        for i in np.flatnonzero(rng.random(num_rows) < missing):
            col[i] = None
        out[f"int_{j}"] = col
    for j in range(CRITEO_NUM_SPARSE):
        hexes = [f"{int(c):08x}" for c in codes[j]]
        col = [hexes[i] for i in ids[:, j]]
        for i in np.flatnonzero(rng.random(num_rows) < missing):
            col[i] = None
        out[f"cat_{j}"] = col
    return out


def write_criteo_tsv(path: str, num_rows: int, *, seed: int = 0, cardinality: int = 500) -> None:
    """Raw Criteo TSV: no header, tab-separated, empty fields for missing values."""
    cols = criteo_rows(num_rows, seed=seed, cardinality=cardinality)
    with open(path, "w") as f:
        for i in range(num_rows):
            f.write("\t".join("" if cols[c][i] is None else str(cols[c][i]) for c in CRITEO_COLUMNS) + "\n")


def converted_criteo_schema(num_embeddings: int) -> Schema:
    """The schema ``convert`` stores with Criteo columns: dense already log1p'd, ids already in ``[0, num_embeddings)``."""
    schema = criteo_schema([num_embeddings] * CRITEO_NUM_SPARSE)
    for d in schema.dense:
        d.transform = "none"
    for s in schema.sparse:
        s.encoding, s.hex = "id", False
    return schema


def _converted_criteo(cols: dict[str, list], num_embeddings: int) -> dict[str, pa.Array]:
    """Criteo columns as ``convert`` writes them: log1p'd float dense, int64 ids."""
    data: dict[str, pa.Array] = {"label": pa.array(cols["label"], pa.int8())}
    for j in range(CRITEO_NUM_DENSE):
        raw = np.array([0 if v is None else v for v in cols[f"int_{j}"]], dtype=np.float64)
        data[f"int_{j}"] = pa.array(np.log1p(np.maximum(raw, 0)).astype(np.float32))
    for j in range(CRITEO_NUM_SPARSE):
        data[f"cat_{j}"] = pa.array([None if v is None else int(v, 16) % num_embeddings for v in cols[f"cat_{j}"]], pa.int64())
    return data


def _random_converted_criteo(num_rows: int, num_embeddings: int, seed: int) -> dict[str, pa.Array]:
    """Converted Criteo columns drawn at random, vectorized (seconds for 1M rows): 25% positive labels independent of
    the features, log1p'd geometric counts, ids skewed over the whole ``[0, num_embeddings)`` with ~5% nulls."""
    rng = np.random.default_rng(seed)
    cols: dict[str, pa.Array] = {"label": pa.array((rng.random(num_rows) < 0.25).astype(np.int8))}
    for j in range(CRITEO_NUM_DENSE):
        cols[f"int_{j}"] = pa.array(np.log1p(rng.geometric(0.1, num_rows)).astype(np.float32))
    for j in range(CRITEO_NUM_SPARSE):
        ids = (num_embeddings * rng.random(num_rows) ** 3).astype(np.int64)
        cols[f"cat_{j}"] = pa.array(ids, mask=rng.random(num_rows) < 0.05)
    return cols


def _write_converted(path: str, columns: dict[str, pa.Array], schema: Schema, row_group_rows: int) -> None:
    """Model-ready columns with their schema stored in the file's metadata, as ``convert`` writes them."""
    table = pa.table(columns).replace_schema_metadata({SCHEMA_METADATA_KEY: schema_json(schema)})
    pq.write_table(table, path, row_group_size=row_group_rows)


def write_criteo_parquet(path: str, num_rows: int, *, seed: int = 0, cardinality: int = 500, num_embeddings: int = 1000,
                         row_group_rows: int = 65_536, learnable: bool = True) -> None:
    """Criteo rows as ``convert`` writes them: label, log1p'd dense floats, int64 ids (~5% null), the schema stored.

    ``learnable``: the rows of :func:`criteo_rows` (``cardinality`` hex values per column, a click that depends on
    the features), for training. ``False``: rows drawn at random, vectorized (``cardinality`` unused; ids over the
    whole table), the same columns and schema for a reader or throughput benchmark (``make bench``), where writing
    a large file fast matters and AUC does not.
    """
    if learnable:
        columns = _converted_criteo(criteo_rows(num_rows, seed=seed, cardinality=cardinality), num_embeddings)
    else:
        columns = _random_converted_criteo(num_rows, num_embeddings, seed)
    _write_converted(path, columns, converted_criteo_schema(num_embeddings), row_group_rows)


def write_funnel_parquet(path: str, num_rows: int, *, seed: int = 0, cardinality: int = 500, num_embeddings: int = 1000,
                         row_group_rows: int = 65_536, labels: dict[str, str] | None = None) -> None:
    """Criteo-shaped rows with two learnable labels, as ``convert`` writes them with ``labels``.

    ``labels`` maps two task names to two columns (default ``{ctr: click, cvr: conversion}``): the first
    is the Criteo click; the second a conversion drawn from hidden per-id effects of its own, and
    only ever positive on a clicked row (a CTR/CVR funnel, as with ``data=synthetic_multitask``).
    The stored schema carries the mapping, so ``data=parquet data.path=<file>`` needs no column list.
    """
    labels = dict(labels or {"ctr": "click", "cvr": "conversion"})
    require(len(labels) == 2, f"write_funnel_parquet writes two labels (click, conversion), got labels={labels}")
    click_column, conversion_column = labels.values()
    data = _converted_criteo(criteo_rows(num_rows, seed=seed, cardinality=cardinality), num_embeddings)
    world = np.random.default_rng(54321)  # the conversion's hidden effects: the same for every seed
    effects = world.normal(0, 0.8, size=(CRITEO_NUM_SPARSE, num_embeddings))
    score = np.full(num_rows, 0.5)
    for j in range(CRITEO_NUM_SPARSE):
        ids = data[f"cat_{j}"]
        present = np.asarray(ids.is_valid().to_numpy(zero_copy_only=False))
        score += np.where(present, effects[j, np.asarray(ids.fill_null(0).to_numpy(zero_copy_only=False))], 0.0)
    click = np.asarray(data.pop("label").to_numpy(zero_copy_only=False), dtype=np.int8)
    converted = np.random.default_rng([seed, 1]).random(num_rows) < 1 / (1 + np.exp(-score))
    columns = {click_column: pa.array(click), conversion_column: pa.array((click * converted).astype(np.int8)), **data}
    schema = converted_criteo_schema(num_embeddings)
    schema.label, schema.labels = None, labels
    _write_converted(path, columns, schema, row_group_rows)


def write_criteo_csv(path: str, num_rows: int, *, seed: int = 0, cardinality: int = 500, delimiter: str = ",") -> None:
    """Criteo columns as CSV with a header line (``label,int_0,…,cat_25``), empty fields for missing values."""
    cols = criteo_rows(num_rows, seed=seed, cardinality=cardinality)
    with open(path, "w") as f:
        f.write(delimiter.join(CRITEO_COLUMNS) + "\n")
        for i in range(num_rows):
            f.write(delimiter.join("" if cols[c][i] is None else str(cols[c][i]) for c in CRITEO_COLUMNS) + "\n")


AVAZU_CATEGORICAL = ["C1", "banner_pos", "site_id", "site_domain", "site_category", "app_id", "app_domain", "app_category",
                     "device_id", "device_ip", "device_model", "device_type", "device_conn_type",
                     *(f"C{i}" for i in range(14, 22))]
AVAZU_COLUMNS = ["id", "click", "hour", *AVAZU_CATEGORICAL]
"""Avazu's CSV header: a row id, the click, the hour (``YYMMDDHH``) and 21 categoricals (hex strings or integer codes)."""
_AVAZU_HEX = {"site_id", "site_domain", "site_category", "app_id", "app_domain", "app_category", "device_id", "device_ip", "device_model"}


def write_avazu_csv(path: str, num_rows: int, *, seed: int = 0) -> None:
    """Rows in Avazu's layout (CSV with a header, :data:`AVAZU_COLUMNS`) whose click depends on the categoricals.

    ``id`` is a unique 20-digit number (beyond int64 for some rows, as in the real file), ``hour`` is
    ``YYMMDDHH``; hex columns are 8 hex digits, integer-coded ones (``C1``, ``banner_pos``, ``C14``…) small ints.
    """
    rng = np.random.default_rng(seed)
    world = np.random.default_rng(777)  # hidden effects shared by every seed
    cards = {c: (2000 if c == "device_ip" else 300 if c in _AVAZU_HEX else 8 if c in ("C1", "banner_pos", "device_type", "device_conn_type")
                 else 200) for c in AVAZU_CATEGORICAL}
    ids = {c: np.minimum((n * rng.random(num_rows) ** 2).astype(np.int64), n - 1) for c, n in cards.items()}
    effects = {c: world.normal(0, 0.6 if c in ("site_id", "app_id", "C14", "banner_pos", "device_model", "C17") else 0.1, size=n)
               for c, n in cards.items()}
    score = sum(effects[c][ids[c]] for c in AVAZU_CATEGORICAL) - 1.6
    click = (rng.random(num_rows) < 1 / (1 + np.exp(-score))).astype(np.int64)
    codes = {c: world.integers(0, 2**32, size=n) for c, n in cards.items()}
    row_ids = rng.integers(10**18, 10**19, size=num_rows, dtype=np.uint64) + np.uint64(10**18) * rng.integers(0, 9, size=num_rows).astype(np.uint64)
    with open(path, "w") as f:
        f.write(",".join(AVAZU_COLUMNS) + "\n")
        for i in range(num_rows):
            values = [str(int(row_ids[i])), str(int(click[i])), str(14102100 + i * 24 // max(num_rows, 1))]
            for c in AVAZU_CATEGORICAL:
                k = int(ids[c][i])
                values.append(f"{int(codes[c][k]):08x}" if c in _AVAZU_HEX else str(k * 7 + 1000 if c.startswith("C") and c != "C1" else k))
            f.write(",".join(values) + "\n")


def write_movielens_ratings(path: str, num_rows: int, *, seed: int = 0, num_users: int = 300, num_items: int = 500,
                            layout: str = "u.data") -> None:
    """MovieLens ratings whose rating (1-5) follows hidden user and item biases, so ``rating >= 4`` is learnable.

    ``layout="u.data"``: ml-100k's ``user item rating timestamp``, tab-separated, no header;
    ``layout="ratings.csv"``: ml-latest's ``userId,movieId,rating,timestamp`` with a header and half-star ratings.
    """
    require(layout in ("u.data", "ratings.csv"), f"layout={layout!r} must be u.data or ratings.csv")
    rng = np.random.default_rng(seed)
    world = np.random.default_rng(4242)
    user_bias, item_bias = world.normal(0, 0.8, num_users), world.normal(0, 0.8, num_items)
    users = np.minimum((num_users * rng.random(num_rows) ** 1.5).astype(np.int64), num_users - 1)
    items = np.minimum((num_items * rng.random(num_rows) ** 2).astype(np.int64), num_items - 1)
    raw = 3.5 + user_bias[users] + item_bias[items] + rng.normal(0, 0.7, num_rows)
    step = 0.5 if layout == "ratings.csv" else 1.0
    ratings = np.clip(np.round(raw / step) * step, 1, 5)
    times = 874_724_710 + rng.integers(0, 20_000_000, num_rows)
    with open(path, "w") as f:
        if layout == "ratings.csv":
            f.write("userId,movieId,rating,timestamp\n")
            f.writelines(f"{u + 1},{m + 1},{r:.1f},{t}\n" for u, m, r, t in zip(users, items, ratings, times, strict=True))
        else:
            f.writelines(f"{u + 1}\t{m + 1}\t{int(r)}\t{t}\n" for u, m, r, t in zip(users, items, ratings, times, strict=True))
