"""Top-k items per row: what ``python -m recsys_runner.predict`` writes for a next-item or two-tower model.

A pointwise model scores a row; a model whose task ranks candidates (``next_item``: every item of the table,
``retrieval``: a catalogue) answers a row with its ``predict.top_k`` best items instead: the columns ``top_items``
(a list of item ids, best first) and ``top_scores`` (their scores, float32). :func:`top_k_scorer` builds the callable
:func:`recsys_runner.scoring.score_files` calls on each batch (placeholder batches included, so that the sharded
lookups stay collectives every rank takes part in).

* **next-item** (:class:`NextItemModel`, ``model=sasrec``, ``model.block=hstu``): the state after the row's history
  against every item of the table, the model's own scores (``<state, item> / temperature``, cosine when it
  normalizes). The row's candidate column (``item_id``) is not read: the top-k answer "what comes after this
  history", so on held-out rows the candidate is what they are judged against.
* **two-tower** (:class:`~recsys_runner.train.corpus.TwoTower`, ``model=dssm``): the user tower's vector against the
  item index, the item tower over the data's catalogue (``data.items``), built once in chunks as the corpus eval
  builds it (:func:`~recsys_runner.train.corpus.item_index`); scores ``<u, v> / temperature``. The items ranked are
  :func:`~recsys_runner.train.candidates.catalogue_candidates`' (those past the id mapping left out, said in one log line),
  the corpus eval's own, so that its recall@k describes these lists.

Retrieval is exact and chunked, one sweep over the items (:func:`~recsys_runner.metrics.corpus.corpus_top_k`, the
corpus eval's first pass: memory ``B × (chunk + k)`` scores, never ``B × N``; the same top rows), or, for a two-tower
model with ``model.index=faiss``, the corpus eval's HNSW graph (:func:`~recsys_runner.train.corpus.hnsw_index`),
searched for ``k`` plus the row's seen items. Each batch goes through :class:`TopK`'s three steps: query vectors, the
retrieval, the Arrow columns.

**Seen items** (``predict.exclude_seen``, default true): the items the row's history holds are never recommended,
masked as the exclude-seen eval masks them (``corpus_top_k``'s ``seen``: one indexed write per chunk; for a two-tower
model the history features and ``data.items.seen`` that :func:`~recsys_runner.train.corpus.seen_features` names). A
row that has seen all but fewer than ``k`` items gets a shorter list (predict counts them: ``predict/short_lists``).

**Ids.** Rows written by ``python -m recsys_runner.data sequences`` name their id mapping
(:func:`~recsys_runner.data.sequences.mapping.mapping_folder`): the top items are then the raw ids of the log, and
the table's OOV rows (ids past the mapping's values) are never recommended. Input without a mapping gets the
table's ids, said in one log line. Which ids may be recommended is
:func:`~recsys_runner.data.sequences.mapping.candidate_items`, the set a next-item model's eval ranks too.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, cast

import numpy as np
import pyarrow as pa
import torch
import torch.nn.functional as F
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner.data.base import DataModule
from recsys_runner.data.catalogue.items import ItemTable
from recsys_runner.data.sequences.mapping import candidate_items, load_mapping
from recsys_runner.distributed.env import DistEnv
from recsys_runner.errors import ConfigError
from recsys_runner.features import SequenceGroup
from recsys_runner.metrics.corpus import corpus_top_k
from recsys_runner.models.sequence import History, SequenceEmbeddings
from recsys_runner.tasks import Task
from recsys_runner.train.candidates import catalogue_candidates
from recsys_runner.train.catalogue_rows import RowOf, seen_rows
from recsys_runner.train.corpus import (
    TwoTower,
    hnsw_index,
    inner_with,
    item_index,
    seen_features,
    two_tower_of,
)

__all__ = ["CHUNK_ROWS", "RANKING_KINDS", "TOP_ITEMS", "TOP_SCORES", "ItemNames", "NextItemModel", "TopK", "ranks_items",
           "top_k_scorer"]

log = logging.getLogger(__name__)

TOP_ITEMS, TOP_SCORES = "top_items", "top_scores"
"""The output columns of a ranking model, after the pass-through columns."""
RANKING_KINDS = ("next_item", "retrieval")
"""Task kinds whose rows are answered with a top-k rather than a score."""
CHUNK_ROWS = 8192
"""Items a next-item model's top-k scores at once (a two-tower model's ``model.corpus_chunk_rows`` instead)."""

Scorer = Callable[[Batch], dict[str, pa.Array]]
"""A batch (on the device) → its output columns, one value per row."""


class NextItemModel(Protocol):
    """What a next-item top-k needs of a model (:class:`~recsys_runner.models.sasrec.SASRec` has it)."""

    arch: Callable[[KeyedJaggedTensor], SequenceEmbeddings]
    group: SequenceGroup
    item_feature: str
    num_items: int
    normalize: bool
    temperature: float

    def encode(self, history: History) -> torch.Tensor: ...

    def item_table(self, sparse: KeyedJaggedTensor) -> torch.Tensor: ...


def ranks_items(tasks: tuple[Task, ...]) -> bool:
    """Whether the model's rows are answered with a top-k (its one task ranks candidates), not a score per task.

    Raises:
        ConfigError: a ranking task beside others (no model has that; predict could write neither).
    """
    ranking = [t for t in tasks if t.kind in RANKING_KINDS]
    if ranking and len(tasks) > 1:
        raise ConfigError(f"predict writes either scores or a top-k per row, but the model has a {ranking[0].kind} task beside "
                          f"others ({[t.kind for t in tasks]}). Fix: predict with a model of one ranking task")
    return bool(ranking)


@dataclass(frozen=True)
class ItemNames:
    """How an item id is written: ``values[id]`` its raw value (a ``sequences`` mapping), or the id itself (``values``
    ``None``); ``size``: the ids that may be recommended (the mapping's values, else the whole table)."""

    values: np.ndarray | None
    size: int

    def of(self, ids: np.ndarray) -> pa.Array:
        return pa.array(ids.astype(np.int64) if self.values is None else self.values[ids])


def item_names(files: list[str], table: str, num_rows: int, say: bool = True) -> ItemNames:
    """The names of ``table``'s ids (``num_rows`` rows) for the Parquet ``files`` predicted, and which may be recommended:
    :func:`~recsys_runner.data.sequences.mapping.candidate_items` (the mapping the files name, else the ids themselves;
    logged when ``say``).

    Raises:
        ConfigError: the files name different mappings, or the mapping has no such table or more values than rows.
    """
    candidates = candidate_items(files, table, num_rows)
    if candidates.folder is None:
        if say:
            log.info("predict: the input names no id mapping (not written by python -m recsys_runner.data sequences): top_items "
                     "are the %s table's ids", table)
        return ItemNames(None, num_rows)
    values = load_mapping(candidates.folder)[table][: candidates.count]
    if say:
        log.info("predict: top_items are the raw %s ids of the mapping in %s (its %d OOV rows never recommended)", table,
                 candidates.folder, num_rows - candidates.count)
    return ItemNames(values, candidates.count)


def top_k_scorer(model: nn.Module, tasks: tuple[Task, ...], data: DataModule, env: DistEnv, files: list[str], *, k: int,
                 exclude_seen: bool) -> TopK:
    """The batch → ``top_items``/``top_scores`` callable of ``model`` (a next-item or two-tower model), its catalogue
    checked against ``k`` (``predict.top_k``) before any row is scored; ``files``: the Parquet files predicted (their
    id mapping), empty for other formats.

    Raises:
        ConfigError: ``k`` exceeds the catalogue; ``exclude_seen`` on a two-tower model that reads no history; a
            two-tower model without a catalogue; a model whose task ranks but that has neither form.
    """
    sparse = {f.name: f for f in data.features.sparse}
    towers = two_tower_of(model)
    if towers is not None:
        table = data.item_table()
        if table is None:
            raise ConfigError("predict ranks a two-tower model's catalogue, but the data has none. Fix: data.items=<the catalogue "
                              "file> (the items the model may recommend)")
        names = item_names(files, sparse[table.id_feature].table_name, sparse[table.id_feature].num_embeddings, env.is_main)
        table = catalogue_candidates(table, data, files, env.is_main).table  # the items the corpus eval ranks too
        _check_k(k, len(table), "the item catalogue (data.items)")
        seen = _two_tower_seen(towers, data, table) if exclude_seen else []
        return _TwoTowerTopK(towers, table, data, env, names, k, seen, float(getattr(towers, "temperature", 1.0)))
    inner = _next_item_model(model)
    if inner is None:
        raise ConfigError(f"predict ranks items for a {tasks[0].kind} task, but found neither a next-item model (model=sasrec) "
                          f"nor a two-tower one (model=dssm) to rank them with")
    feature = sparse[inner.item_feature]
    names = item_names(files, feature.table_name, inner.num_items, env.is_main)
    _check_k(k, names.size, f"the item table ({feature.table_name})")
    return _NextItemTopK(inner, names, k, exclude_seen)


def _check_k(k: int, size: int, what: str) -> None:
    if k > size:
        raise ConfigError(f"predict.top_k={k}, but {what} holds {size} items that may be recommended. Fix: predict.top_k<={size}")


def _two_tower_seen(towers: TwoTower, data: DataModule, table: ItemTable) -> list[str]:
    """The query features holding a row's seen items (:func:`~recsys_runner.train.corpus.seen_features`), with
    predict's own fix when there are none."""
    try:
        return seen_features(towers, data, table)
    except ConfigError:
        raise ConfigError(f"predict.exclude_seen=true leaves each row's earlier items out of its top-k, but the model reads no "
                          f"history of items (no model.user_features entry shares the table of {table.id_feature!r}) and the "
                          f"data names no seen column (data.items.seen). Fix: predict.exclude_seen=false, or give the data a "
                          f"seen column") from None


def _next_item_model(model: nn.Module) -> NextItemModel | None:
    """The next-item model inside ``model`` (DistributedModelParallel, the TrainWrapper), or ``None``."""
    return cast("NextItemModel | None", inner_with(model, "item_table", "encode"))


class TopK(ABC):
    """A ranking model's scorer (what :func:`top_k_scorer` returns): a batch → its ``top_items``/``top_scores`` in three
    steps, apart so that they can be timed apart (``python -m recsys_runner.bench.topk``): :meth:`queries` (the model's
    query vectors and each row's seen items), :meth:`retrieve` (the scores against ``index`` and their top ``k``),
    :meth:`answer` (the Arrow columns)."""

    k: int
    chunk_rows: int
    """Items scored at once by the exact retrieval."""
    index: torch.Tensor | None
    """The item vectors ``[N, O]`` the queries are scored against; read at the first batch."""
    ids: np.ndarray
    """``ids[row]``: the table id of index row ``row``."""
    names: ItemNames

    def __call__(self, batch: Batch) -> dict[str, pa.Array]:
        queries, seen = self.queries(batch)
        return self.answer(*self.retrieve(queries, seen))

    @abstractmethod
    def queries(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(queries [B, O] float32, seen [B, L] index rows with -1 padding, or None)`` of ``batch``; reads ``index``
        first when it is not read yet."""

    def retrieve(self, queries: torch.Tensor, seen: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The exact top ``k`` of :func:`exact_top_k`: ``(rows, scores, keep)``."""
        assert self.index is not None, "queries() reads the index first"
        return exact_top_k(queries, self.index, self.k, self.chunk_rows, seen)

    def answer(self, rows: torch.Tensor, scores: torch.Tensor, keep: torch.Tensor) -> dict[str, pa.Array]:
        """The output columns (:func:`columns`)."""
        return columns(rows, scores, keep, self.ids, self.names)


class _NextItemTopK(TopK):
    """A next-item model's top ``k`` per row (module docstring); the item table read at the first batch (a collective
    of the sharded table), kept for the run."""

    def __init__(self, model: NextItemModel, names: ItemNames, k: int, exclude_seen: bool) -> None:
        self.model, self.names, self.k, self.exclude_seen = model, names, k, exclude_seen
        self.chunk_rows, self.ids = CHUNK_ROWS, np.arange(names.size)
        self.index = None

    def queries(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        m, sparse = self.model, batch.sparse_features
        history = m.arch(sparse).histories[m.group.name]
        user = m.encode(history)[torch.arange(history.lengths.shape[0], device=history.lengths.device), history.lengths].float()
        if self.index is None:
            table = m.item_table(sparse)[: self.names.size].float()
            self.index = F.normalize(table, dim=1) if m.normalize else table
        queries = (F.normalize(user, dim=1) if m.normalize else user) / m.temperature
        if not self.exclude_seen:
            return queries, None
        jagged = sparse[m.item_feature]
        width = max(int(jagged.lengths().max()) if jagged.lengths().numel() else 0, 1)
        return queries, jagged.to_padded_dense(desired_length=width, padding_value=-1).long()


class _TwoTowerTopK(TopK):
    """A two-tower model's top ``k`` per row (module docstring); the item index built at the first batch (every rank
    embeds its share of the catalogue, then all hold all of it), kept for the run."""

    def __init__(self, towers: TwoTower, table: ItemTable, data: DataModule, env: DistEnv, names: ItemNames, k: int,
                 seen: list[str], temperature: float) -> None:
        self.towers, self.table, self.data, self.env, self.names = towers, table, data, env, names
        self.k, self.seen, self.temperature = k, seen, temperature
        self.chunk_rows = towers.corpus_chunk_rows
        self.ids = np.asarray(table.ids, dtype=np.int64)
        self.index = None
        self._graph: Any = None
        self._rows = RowOf(table, env.device)

    def queries(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.index is None:
            features = self.data.features
            self.index = item_index(self.towers, self.table, features.kjt_keys, features.dense_names, self.chunk_rows, self.env)
            self._graph = hnsw_index(self.index) if self.towers.corpus_index == "faiss" else None
        queries = self.towers.tower("user", batch.dense_features, batch.sparse_features).float() / self.temperature
        return queries, seen_rows(batch.sparse_features, self.seen, self._rows) if self.seen else None

    def retrieve(self, queries: torch.Tensor, seen: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._graph is not None:
            return searched_top_k(self._graph, queries, self.k, seen)
        return super().retrieve(queries, seen)


def exact_top_k(queries: torch.Tensor, index: torch.Tensor, k: int, chunk_rows: int,
                seen: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``queries [B, O]``' top ``k`` rows of ``index [N, O]`` by ``queries @ index.T``, exactly, in one sweep over chunks
    of ``chunk_rows`` (:func:`~recsys_runner.metrics.corpus.corpus_top_k`), each row's ``seen [B, L]`` rows (``-1``
    padding) masked: ``(rows [B, k], scores [B, k], keep [B, k])``, ``keep`` false where a row had fewer than ``k``
    unseen items and the place holds a seen one (the sweep scored it ``-inf``).

    The scores written are ``<query, item>`` recomputed for the ``k`` rows found (``B × k × O``, next to nothing beside
    the sweep's ``B × N × O``), as predict has always written them; the sweep's own matmul scores may differ from them
    in the last bit."""
    swept, rows = corpus_top_k(queries, index, k, chunk_rows, seen=seen)
    found = index[rows]  # [B, k, O]; a multi-interest query [B, I, O] (MIND) scores each by its best interest
    scores = (found @ queries.transpose(1, 2)).amax(dim=2) if queries.dim() == 3 else (queries.unsqueeze(1) * found).sum(dim=2)
    keep = torch.ones_like(rows, dtype=torch.bool) if seen is None else ~torch.isneginf(swept)
    return rows, scores, keep


def searched_top_k(graph: Any, queries: torch.Tensor, k: int,
                   seen: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`exact_top_k` from the HNSW ``graph`` (``model.index=faiss``): the search asks for ``k`` plus the widest
    seen list of the batch, the seen rows are dropped, the first ``k`` others kept (scores: the graph's inner
    products with ``queries``)."""
    extra = int(seen.shape[1]) if seen is not None else 0
    graph.hnsw.efSearch = max(64, 2 * (k + extra))
    found_scores, found = graph.search(np.ascontiguousarray(queries.cpu().numpy(), dtype=np.float32), min(k + extra, graph.ntotal))
    rows = torch.from_numpy(found).long()
    scores = torch.from_numpy(found_scores).float()
    good = rows >= 0  # a short search pads with -1
    if seen is not None:
        good &= ~(rows.unsqueeze(2) == seen.cpu().unsqueeze(1)).any(dim=2)
    order = torch.argsort((~good).to(torch.int8), dim=1, stable=True)[:, :k]  # the good ones first, in search order
    return rows.gather(1, order).clamp_min(0), scores.gather(1, order), good.gather(1, order)


def columns(rows: torch.Tensor, scores: torch.Tensor, keep: torch.Tensor, ids: np.ndarray, names: ItemNames) -> dict[str, pa.Array]:
    """``top_items`` (each kept row's item id, named by ``names``; ``ids[row]`` the id of index row ``row``) and
    ``top_scores`` (float32) as list columns, one list per query, best first."""
    keep_np = keep.cpu().numpy()
    offsets = pa.array(np.concatenate([[0], np.cumsum(keep_np.sum(axis=1))]).astype(np.int32))
    flat_rows = rows.cpu().numpy()[keep_np]
    items = names.of(ids[flat_rows])
    values = pa.array(scores.float().cpu().numpy()[keep_np].astype(np.float32))
    return {TOP_ITEMS: pa.ListArray.from_arrays(offsets, items), TOP_SCORES: pa.ListArray.from_arrays(offsets, values)}
