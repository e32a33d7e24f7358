"""The served top-k model: a user's history of raw item ids in (a pandas DataFrame), its best items out — MLflow's pyfunc loader.

``export`` writes, for a next-item model trained on ``python -m recsys_runner.data sequences`` output
(:mod:`recsys_runner.serving.topk`), an MLflow model whose ``code/`` holds a copy of this module (``recsys_topk_<hash>.py``)
with the copies the pointwise model carries (the key hashes, the row encoder, the vocabulary lookup,
:data:`~recsys_runner.data.encoding.served.SHIPPED`, which says why each name ends in the hash of the whole set), and whose
``data/`` holds

* ``model.pt2``: the ``torch.export`` program of the model's query (and ``model_aoti.pt2``, its AOTInductor package, with
  ``export.compile=true``), ``(values [G, V], lengths [B], times [V]) →
  queries [B, O]`` (:class:`~recsys_runner.serving.program.HistoryServing`): the state after the history, normalized
  when the model scores cosines, over its temperature;
* ``items.npy``: the item vectors ``[N, O]`` (float32) of the ``N`` items that may be recommended — the mapping's
  items, never its OOV rows — normalized likewise: ``queries @ items.T`` are the model's scores;
* ``vocab/<table>.txt``: the id mapping of each history column's table (line ``i``: id ``i``'s raw value), as the
  mapping folder holds it; ``serving.json``: the history columns, their tables, the times column, ``max_len``, the
  OOV rows, ``k`` and the defaults of the request's parameters.

MLflow calls :func:`_load_pyfunc` on ``data/``; :meth:`TopKModel.predict` then, for each request row,

1. reads the history columns (a list of raw ids per row, oldest event first; the times column too when the model
   reads times): ids sent as numbers for a table of text ids are keyed as their text, text for an integer table parsed;
2. cuts the history to the ``max_len`` events training read (the most recent, or the first with ``truncate: oldest``);
3. maps each raw id to its id as ``data sequences --vocab`` maps a new log's ids: a known value its own id, an unknown
   one the OOV row ``size + key mod oov_buckets`` (counted in the row's ``unknown_ids``);
4. runs the query program and ranks every item exactly by ``query · item``, in chunks, the history's items left out
   unless the request says ``exclude_seen: false`` — what ``predict``'s top-k does (:mod:`recsys_runner.scoring_topk`);
5. returns ``top_items`` (the raw ids, best first), ``top_scores`` (float32 scores) and ``unknown_ids``.

Parameters (MLflow's ``params``): ``k`` (1 to the number of items; default ``export.top_k``) and ``exclude_seen``
(default true). A request the model cannot read (a missing column, an id that is not one, a ``k`` out of range)
raises MLflow's ``BAD_REQUEST`` error (HTTP 400 from ``mlflow models serve``) naming it.

Standalone like :mod:`recsys_runner.data.encoding.served`: torch, NumPy, pandas, PyArrow (and MLflow) only.
"""

from __future__ import annotations

import importlib
import json
import os
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

if TYPE_CHECKING or __package__:
    from recsys_runner.data.encoding import keys as _keys
    from recsys_runner.data.encoding import served_program as _program
    from recsys_runner.data.encoding import served_request as _request
    from recsys_runner.data.encoding.vocabulary import Vocabulary
    from recsys_runner.metrics import top_k as _top_k
else:  # inside the MLflow model: the copies in its code/ directory, never an installed recsys_runner
    _CODE = __name__.removeprefix("recsys_topk")  # "_<hash>": this copy's code set (served.SHIPPED says why)
    _keys = importlib.import_module(f"recsys_keys{_CODE}")
    _program = importlib.import_module(f"recsys_served_program{_CODE}")
    _request = importlib.import_module(f"recsys_served_request{_CODE}")
    Vocabulary = importlib.import_module(f"recsys_vocabulary{_CODE}").Vocabulary
    _top_k = importlib.import_module(f"recsys_top_k{_CODE}")

SPEC_FILE = "serving.json"
VECTORS_FILE = "items.npy"
VOCAB_DIR = "vocab"
LOADER_MODULE = "recsys_topk"
"""The stem of this module's name in the MLflow model's ``code/`` (its ``loader_module``: ``recsys_topk_<hash>``)."""
TOP_K_MODULE = "recsys_top_k"
"""The stem of the name in ``code/`` of :mod:`recsys_runner.metrics.top_k` (the tie-break predict's top-k uses too)."""
TOP_ITEMS, TOP_SCORES, UNKNOWN_IDS = "top_items", "top_scores", "unknown_ids"
CHUNK_ROWS = 8192
"""Items scored at once (memory: request rows × (chunk + k) scores)."""


class TopKModel:
    """The loaded model: :meth:`predict` answers each row of raw histories with its top ``k`` items (module docstring)."""

    def __init__(self, directory: str) -> None:
        import torch

        with open(os.path.join(directory, SPEC_FILE)) as f:
            self.spec: dict[str, Any] = json.load(f)
        history = self.spec["history"]
        self.columns: list[dict[str, Any]] = history["columns"]
        """Per history feature (the program's ``values`` rows, in order): its request column, its table, whether the
        table's raw ids are integers."""
        self.item_column: str = history["item_column"]
        self.times: str | None = history["times"]
        self.reads_times: bool = bool(history["reads_times"])
        self.timed_program: bool = bool(history["timed_program"])
        self.max_len, self.truncate = int(history["max_len"]), history["truncate"]
        self.oov_buckets = int(history["oov_buckets"])
        tables = {c["table"]: c["integers"] for c in self.columns}
        self.values = {table: _read_values(os.path.join(directory, VOCAB_DIR, f"{table}.txt"), integers) for table, integers in tables.items()}
        """Each table's raw values in id order (``values[i]``: id ``i``)."""
        self.vocabularies = {table: mapping_vocabulary(values, self.oov_buckets) for table, values in self.values.items()}
        self.item_names = self.values[self.spec["items"]["table"]]
        self.index = torch.from_numpy(np.load(os.path.join(directory, VECTORS_FILE)))
        self.num_items = int(self.index.shape[0])
        self.default_k, self.default_exclude_seen = int(self.spec["k"]), bool(self.spec["exclude_seen"])
        self.program = _program.load_program(directory)  # model.pt2, or its AOTInductor package when export compiled it
        self.error = _program.error_class()
        self._torch = torch
        self.threads = _program.serving_threads(torch)

    @property
    def request_columns(self) -> list[str]:
        """The columns a request must have: the history columns, and the times when the model reads them."""
        return [c["column"] for c in self.columns] + ([self.times] if self.reads_times and self.times else [])

    def predict(self, model_input: Any, params: dict[str, Any] | None = None) -> Any:
        """``top_items``, ``top_scores`` and ``unknown_ids`` for each row of ``model_input`` (a pandas DataFrame)."""
        import pandas as pd

        torch = self._torch
        k, exclude_seen = self.parameters(params)
        frame = model_input if isinstance(model_input, pd.DataFrame) else pd.DataFrame(model_input)
        if len(frame) == 0:  # the program's batch is at least one row: no rows, no lists (still only with every column)
            self.check_columns(frame)
            return pd.DataFrame({TOP_ITEMS: [], TOP_SCORES: [], UNKNOWN_IDS: np.zeros(0, np.int64)}, index=frame.index)
        inputs, seen, unknown = self.encode(frame)
        with torch.inference_mode():
            queries = self.program(*inputs).float()
            rows, scores, keep = top_k(queries, self.index, k, seen if exclude_seen else None)
        items, lists = [], []
        for r in range(rows.shape[0]):
            kept = keep[r].numpy()
            items.append(self.item_names[rows[r].numpy()[kept]].tolist())
            lists.append(scores[r].numpy()[kept].astype(np.float32).tolist())
        # the request's index, so that ``frame.assign(top_items=model.predict(frame)[...])`` lines up row by row whatever
        # the index (a sorted, sampled or filtered frame): pandas aligns on it, and a fresh 0..n-1 would misplace every row
        return pd.DataFrame({TOP_ITEMS: items, TOP_SCORES: lists, UNKNOWN_IDS: unknown}, index=frame.index)

    def parameters(self, params: dict[str, Any] | None) -> tuple[int, bool]:
        """The request's ``k`` and ``exclude_seen`` (the model's defaults where it gives none).

        Raises:
            RequestError (MLflow's ``BAD_REQUEST``): ``k`` is not a whole number from 1 to the number of items, or
                ``exclude_seen`` is not true or false.
        """
        params = dict(params or {})
        unknown = sorted(set(params) - {"k", "exclude_seen"})
        if unknown:
            raise self.error(f"unknown parameter(s) {unknown}: the model takes k (1 to {self.num_items}) and exclude_seen (true or false)")
        k = params.get("k", self.default_k)
        if isinstance(k, str) and k.strip().lstrip("-").isdigit():
            k = int(k)
        if isinstance(k, (float, np.floating)) and float(k).is_integer():
            k = int(k)
        if isinstance(k, (bool, np.bool_)) or not isinstance(k, (int, np.integer)) or not 1 <= int(k) <= self.num_items:
            raise self.error(f"k={k!r}: the number of items to return must be a whole number from 1 to {self.num_items} (the items "
                             f"the model may recommend). Fix: send params {{\"k\": 10}}, or leave k out for {self.default_k}")
        exclude = params.get("exclude_seen", self.default_exclude_seen)
        if isinstance(exclude, str) and exclude.lower() in ("true", "false"):
            exclude = exclude.lower() == "true"
        if not isinstance(exclude, (bool, np.bool_)):
            raise self.error(f"exclude_seen={exclude!r} must be true or false")
        return int(k), bool(exclude)

    def check_columns(self, frame: Any) -> None:
        """Raises RequestError (MLflow's ``BAD_REQUEST``) naming the request columns ``frame`` lacks."""
        missing = [c for c in self.request_columns if c not in frame.columns]
        if missing:
            raise self.error(f"the request has no column {missing[0]!r}{f' (nor {missing[1:]})' if missing[1:] else ''}; the model reads "
                             f"the columns {self.request_columns}: each row's history, oldest event first. Fix: send every one of them "
                             f"(extra columns are ignored)")

    def encode(self, frame: Any) -> tuple[tuple[Any, ...], Any, list[int]]:
        """The program's inputs for the rows of ``frame``, each row's history items (item ids, ``-1`` padding: what is
        left out with ``exclude_seen``) and its number of unknown raw ids.

        Raises:
            RequestError (MLflow's ``BAD_REQUEST``): a column is missing, a cell is not a list of ids (or times), or a
                row's columns hold different numbers of events.
        """
        torch = self._torch
        self.check_columns(frame)
        n = len(frame)
        lengths: np.ndarray | None = None
        ids = []
        for column in self.columns:
            name, table = column["column"], column["table"]
            flat, counts = self._lists(frame[name], name, text=not column["integers"])
            lengths = self._same_lengths(lengths, counts, name)
            keys, wrong = _keys.value_keys(flat, False)
            if wrong is not None and wrong.any():
                raise self.error(f"column {name!r} holds a value that is not an id")
            ids.append(self.vocabularies[table].lookup(keys))
        times = None
        if self.times is not None and self.times in frame.columns:
            times, counts = self._lists(frame[self.times], self.times, text=False)
            lengths = self._same_lengths(lengths, counts, self.times)
        assert lengths is not None, "a history group has at least one feature"
        kept, kept_lengths = _window(lengths, self.max_len, self.truncate)
        unknown = np.zeros(n, np.int64)  # the ids the model reads that the mapping does not hold (each read an OOV row)
        for column, looked_up in zip(self.columns, ids, strict=True):
            outside = looked_up[kept] >= len(self.values[column["table"]])
            unknown += np.bincount(np.repeat(np.arange(n), kept_lengths)[outside], minlength=n)
        values = torch.from_numpy(np.stack([v[kept] for v in ids]).astype(np.int64)) if n else torch.zeros(len(ids), 0, dtype=torch.int64)
        lengths_t = torch.from_numpy(kept_lengths.astype(np.int64))
        inputs: tuple[Any, ...] = (values, lengths_t)
        if self.timed_program:  # a model that does not read times is given zeros in their place
            ts = np.asarray(times.to_numpy(zero_copy_only=False), np.int64)[kept] if times is not None and self.reads_times else \
                np.zeros(int(kept_lengths.sum()), np.int64)
            inputs = (*inputs, torch.from_numpy(ts))
        item = next(j for j, c in enumerate(self.columns) if c["column"] == self.item_column)
        seen = _padded(values[item].numpy(), kept_lengths)
        return inputs, torch.from_numpy(seen), unknown.tolist()

    def _lists(self, series: Any, name: str, text: bool) -> tuple[pa.Array, np.ndarray]:
        """A request column of lists as its values, flat (integers, or text when ``text``), and each row's count (a missing
        cell: an empty history)."""
        cells = [[] if cell is None or (isinstance(cell, float) and np.isnan(cell)) else
                 (list(cell) if isinstance(cell, (list, tuple, np.ndarray)) else cell) for cell in series.tolist()]
        bad = next((i for i, cell in enumerate(cells) if not isinstance(cell, list)), None)
        if bad is not None:
            raise self.error(f"request row {bad}, column {name!r}: {cells[bad]!r} is not a list; the model reads a list per row in it "
                             f"(oldest event first). Fix: send a list (e.g. [3, 7, 9]) for each row")
        try:
            arr = pa.array(cells, from_pandas=True)
        except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
            raise self.error(f"column {name!r} cannot be read as lists of ids ({str(e).splitlines()[0]}). Fix: send one kind of id "
                             f"(numbers or text) per column") from None
        if pa.types.is_null(arr.type):
            arr = pa.array(cells, pa.list_(pa.string() if text else pa.int64()))
        counts = np.asarray(arr.value_lengths().fill_null(0).to_numpy(zero_copy_only=False), np.int64)
        flat = arr.flatten()
        if flat.null_count:
            row = int(np.searchsorted(np.cumsum(counts), int(np.argmax(~np.asarray(flat.is_valid().to_numpy(zero_copy_only=False)))),
                                      side="right"))
            raise self.error(f"request row {row}, column {name!r}: a missing id in the list. Fix: leave it out")
        if pa.types.is_null(flat.type):
            flat = flat.cast(pa.string() if text else pa.int64())
        if pa.types.is_boolean(flat.type):  # cast, True would silently be the id 1 (or the text "true")
            raise self.error(f"request row {int(np.argmax(counts > 0))}, column {name!r} holds booleans, but the model's "
                             f"{'times' if name == self.times else 'ids'} in it are {'text' if text else 'integers'}: read as such, "
                             f"True would silently be {'the text' if text else 'the id'} {'true' if text else 1}. "
                             f"Fix: send {'the ids as text' if text else 'integers'} in {name!r}")
        if text and not _keys.is_text(flat.type):
            flat = _request.integral(flat)
            if not pa.types.is_integer(flat.type):
                raise self.error(f"column {name!r} holds {flat.type} values, but the model's ids in it are text. Fix: send the ids as text")
            return flat.cast(pa.string()), counts
        if not text:
            try:
                flat = _request.integral(flat).cast(pa.int64())
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                raise self.error(f"column {name!r} cannot be read as int64 ({str(e).splitlines()[0]}): the model's "
                                 f"{'times' if name == self.times else 'ids'} in it are integers. Fix: send integers") from None
        return flat, counts

    def _same_lengths(self, lengths: np.ndarray | None, counts: np.ndarray, name: str) -> np.ndarray:
        if lengths is not None and not np.array_equal(lengths, counts):
            row = int(np.argmax(lengths != counts))
            raise self.error(f"request row {row}: column {name!r} holds {int(counts[row])} values for {int(lengths[row])} events "
                             f"(column {self.columns[0]['column']!r}). Fix: one value per event in every history column")
        return counts


def top_k(queries: Any, index: Any, k: int, seen: Any | None) -> tuple[Any, Any, Any]:
    """``queries [B, O]``' top ``k`` rows of ``index [N, O]`` by ``queries @ index.T``, exactly, in chunks of
    :data:`CHUNK_ROWS`, each row's ``seen [B, L]`` rows (``-1`` padding) left out: ``(rows [B, k], scores [B, k],
    keep [B, k])``, ``keep`` false where a row had fewer than ``k`` unseen items; exactly tied items by their row, lowest
    first, whatever the chunk (:mod:`recsys_runner.metrics.top_k`, as ``predict``). Scores as ``predict`` computes them
    (``(query * item).sum()`` of the chosen rows)."""
    import torch

    b = queries.shape[0]
    best_scores = torch.full((b, 0), float("-inf"), dtype=queries.dtype)
    best_rows = torch.zeros((b, 0), dtype=torch.long)
    for start in range(0, index.shape[0], CHUNK_ROWS):
        scores = queries @ index[start:start + CHUNK_ROWS].t()
        if seen is not None and seen.shape[1]:
            width = scores.shape[1]
            local = seen - start
            inside = (local >= 0) & (local < width)
            # a seen row outside this chunk (or padding) marks a spare last column, never an item's
            mask = torch.zeros((b, width + 1), dtype=torch.bool).scatter_(1, torch.where(inside, local, width), True)
            scores = scores.masked_fill(mask[:, :width], float("-inf"))
        chunk_scores, at = _top_k.chunk_top_k(scores, k)
        best_scores, best_rows = _top_k.merge_top_k(best_scores, best_rows, chunk_scores, at + start, k)
    best_scores, best_rows = _top_k.in_order(best_scores, best_rows)
    keep = torch.isfinite(best_scores)
    scores = (queries.unsqueeze(1) * index[best_rows]).sum(dim=2)
    return best_rows, scores, keep


def _window(lengths: np.ndarray, max_len: int, truncate: str) -> tuple[np.ndarray, np.ndarray]:
    """The positions (into the flat events) of each row's events that training reads — at most ``max_len``, the most
    recent (``truncate: recent``) or the first — and each row's kept count."""
    kept_lengths = np.minimum(lengths, max_len)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    if truncate == "recent":
        starts = starts + lengths - kept_lengths
    within = np.arange(int(kept_lengths.sum())) - np.repeat(np.cumsum(kept_lengths) - kept_lengths, kept_lengths)
    return np.repeat(starts, kept_lengths) + within, kept_lengths


def _padded(ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Flat ``ids`` of rows of ``lengths`` as ``[B, max(lengths, 1)]``, ``-1`` padding."""
    out = np.full((len(lengths), max(int(lengths.max(initial=0)), 1)), -1, np.int64)
    rows = np.repeat(np.arange(len(lengths)), lengths)
    within = np.arange(len(ids)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    out[rows, within] = ids
    return out


def _read_values(path: str, integers: bool) -> np.ndarray:
    """A vocab file's raw values in id order (int64 for integer ids, else object strings)."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return np.array([int(v) for v in lines], np.int64) if integers else np.array(lines, object)


def mapping_vocabulary(values: np.ndarray, oov_buckets: int) -> Any:
    """The lookup of a table's raw values (id ``i`` for ``values[i]``), keyed as the row encoder keys them; every other
    value reads row ``len(values) + key mod oov_buckets`` (``data sequences --vocab``'s encoding of a new log). A two-tower
    model's served towers read the mapping through it too (:func:`recsys_runner.serving.raw_ids.raw_id_document`)."""
    arr = pa.array(values, pa.int64()) if values.dtype == np.int64 else pa.array(values.tolist(), pa.string())
    keys, _ = _keys.value_keys(arr, False)
    order = np.argsort(keys, kind="stable")
    return Vocabulary(keys[order], np.arange(len(keys), dtype=np.int64)[order], len(keys), oov_buckets)


def _load_pyfunc(data_path: str) -> TopKModel:
    """MLflow's pyfunc ``loader_module`` entry: the model in ``data_path`` (the MLflow model's ``data/``), refused when this
    process imported a module of its ``code/``'s names from another model's files that differ (one of the two was edited
    after export: :func:`.served_program.check_own_code`)."""
    _program.check_own_code(data_path)
    return TopKModel(data_path)
