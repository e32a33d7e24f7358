"""Full-corpus evaluation of a two-tower model: every eval query ranked against the data's whole item catalogue.

In-batch recall says how well a query's item beats a few hundred batch neighbours; serving retrieves from the whole
catalogue. With a catalogue (``data.item_table()``) and a task whose eval lists catalogue metrics (``recall@k``,
``ndcg@k``, ``mrr``, ``coverage@k``: :func:`~recsys_runner.metrics.tasks.catalogue_metric_names`), one evaluation:

1. builds the item index: the item tower over the whole table, in chunks of ``model.corpus_chunk_rows`` rows
   (:meth:`ItemTable.rows`); rank ``r`` embeds chunks ``r, r + W, …``. The sharded model's forward is a collective
   (its embedding lookups are all-to-alls), so every rank runs the same number of forwards: a rank out of chunks
   embeds one row of chunk 0 and drops it. The ranks' vectors are then all-gathered: every rank holds ``[N, O]``;
2. scores each of its eval queries (the user tower on its eval batches) against all of it, chunk by chunk, exactly
   (:func:`~recsys_runner.metrics.corpus.corpus_ranks`: memory ``B × (chunk + k)``, never ``B × N``); a rank done with
   its batches runs the user tower on a stand-in, counted nowhere, while another scores its last ones
   (:func:`~recsys_runner.data.base.in_step`), so every eval query counts once on any number of ranks;
3. sums the metrics' states over ranks, so the values equal one process's over all queries.

Between two chunks (of the index built, of the items a query batch is scored against, of the items mined) and two
query batches the pass calls ``stop``, the loop's pending-signal check with one rank, which abandons the eval by
raising: a signal is honoured within one chunk's work, not after the whole pass (with several ranks no ``stop`` is
given: every rank must finish the collectives).

A query's target is its row's item id (the table's ``id_feature``); one missing from the catalogue counts as a miss.

**Which items are ranked.** Those ``predict`` may recommend, no others (:func:`~recsys_runner.train.candidates.catalogue_candidates`, which predict's
top-k calls too): rows encoded by ``python -m recsys_runner.data sequences`` name an id mapping, and a catalogue item
whose id lies past the mapping's values (one of the table's OOV rows) has no raw id to be named by, so neither predict
nor this eval ranks it, and an eval row whose item is one of them is a miss. The index is built over the whole catalogue
all the same (mined negatives are lists of catalogue rows); the queries are scored against the candidates' rows of it.

With ``model.eval_negatives`` ``n`` step 2 ranks each query's target against ``n`` catalogue rows drawn for it instead
(:func:`sampled_ranks`: uniform over the rows it has not seen, a hash of its target and seen set, so the same on any
number of ranks and in any batch); the index is built and gathered all the same.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner.data.base import DataModule, in_step, placeholder
from recsys_runner.data.catalogue.items import ItemTable
from recsys_runner.data.catalogue.negatives import MinedNegatives
from recsys_runner.data.sequences.mapping import candidate_items
from recsys_runner.distributed.env import DistEnv
from recsys_runner.errors import ConfigError
from recsys_runner.metrics.corpus import corpus_k, corpus_ranks
from recsys_runner.metrics.registry import MetricsConfig, metric_entry
from recsys_runner.metrics.retrieval import Ranked, target_ranks
from recsys_runner.metrics.state import Metric
from recsys_runner.metrics.tasks import catalogue_metric_names, eval_key
from recsys_runner.models.dssm import first_ids
from recsys_runner.models.ranking_eval import distinct_seen, sampled_negatives
from recsys_runner.progress import Progress
from recsys_runner.tasks import Task
from recsys_runner.train.candidates import Candidates, catalogue_candidates, check_eval_items, eval_mapped_files
from recsys_runner.train.catalogue_rows import RowOf, seen_rows

__all__ = ["CorpusEval", "Rewrite", "TwoTower", "check_eval_negatives",
           "item_index", "mine", "inner_with", "sampled_ranks", "seen_features", "two_tower_of", "use_ranking_protocol"]

log = logging.getLogger(__name__)


Rewrite = Callable[[int, Batch], Batch]  # what the model reads of a rank's n-th eval batch (see Evaluator.evaluate)


class TwoTower(Protocol):
    """What the corpus pass needs of a model: its towers apart (:class:`~recsys_runner.models.dssm.DSSM` has them)."""

    corpus_chunk_rows: int
    corpus_index: str
    eval_negatives: int

    def tower(self, name: str, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor: ...


def two_tower_of(model: nn.Module) -> TwoTower | None:
    """The two-tower model inside ``model`` (DistributedModelParallel, DDP, the TrainWrapper), or ``None``."""
    return cast("TwoTower | None", inner_with(model, "tower", "corpus_chunk_rows"))


def inner_with(model: nn.Module, *attributes: str) -> Any:
    """The module inside ``model`` (DistributedModelParallel, DDP, the TrainWrapper) that has every one of
    ``attributes``, or ``None``."""
    inner: Any = model
    for _ in range(4):
        if all(hasattr(inner, a) for a in attributes):
            return inner
        inner = getattr(inner, "module", None) or getattr(inner, "model", None)
        if inner is None:
            return None
    return None


def use_ranking_protocol(model: nn.Module, data: DataModule, spec: MetricsConfig, two_tower: bool) -> None:
    """Tell a next-item model (one with an ``exclude_seen`` switch: :class:`~recsys_runner.models.sasrec.SASRec`) whether
    its eval scores exclude each row's history (``metrics.exclude_seen``), and which items it ranks: the candidate
    items of the eval rows (:func:`~recsys_runner.data.sequences.mapping.candidate_items`, what predict and the served
    model recommend from: never the table's OOV rows); ``two_tower``: the corpus pass excludes them itself
    (:func:`seen_features`). An in-batch retrieval model (:class:`~recsys_runner.models.dssm.InBatchRetrieval`) is told
    to leave each query's accidental hits out of its eval scores, which ``inbatch_recall@k`` ranks.

    Raises:
        ConfigError: ``metrics.exclude_seen`` on a model that is neither (no history to exclude); the eval files'
            id mapping does not fit the model's item table, or leaves fewer candidates than ``model.eval_negatives``.
    """
    retrieval = inner_with(model, "in_batch_ranking")
    if retrieval is not None:
        retrieval.in_batch_ranking = True
    inner = inner_with(model, "exclude_seen")
    if inner is not None:
        inner.exclude_seen = spec.exclude_seen
        if hasattr(inner, "use_candidates"):
            table = {f.name: f for f in data.features.sparse}[inner.item_feature].table_name
            inner.use_candidates(candidate_items(eval_mapped_files(data), table, inner.num_items).count)
        return
    if spec.exclude_seen and not two_tower:
        raise ConfigError("metrics.exclude_seen=true ranks each row's true item among the items its user has not interacted with, "
                          "but this model's eval has no full-table ranking over histories: it applies to next-item models "
                          "(model=sasrec) and to a two-tower model's full-corpus metrics (model=dssm with an item catalogue and "
                          "recall@<k>/ndcg@<k>/mrr in model.eval_metrics). Fix: metrics.exclude_seen=false, or one of those")


def seen_features(model: TwoTower, data: DataModule, table: ItemTable, required: bool = True) -> list[str]:
    """The sparse features of a query row that hold the items its user has seen, for ``metrics.exclude_seen`` and
    ``model.eval_negatives``: the user tower's features reading the item id's table (a history of item ids) and
    ``data.items.seen``.

    Raises:
        ConfigError: neither exists and ``required`` (``metrics.exclude_seen``; the message names both fixes). Without
            ``required`` (sampled negatives alone) the answer is then ``[]``: only the query's own item is left out.
    """
    sparse = {f.name: f for f in data.features.sparse}
    item_table = sparse[table.id_feature].table_name if table.id_feature in sparse else None
    user = getattr(model, "tower_features", {}).get("user", [])
    found = [n for n in user if n in sparse and n != table.id_feature and sparse[n].table_name == item_table]
    if table.seen_feature is not None and table.seen_feature not in found:
        found.append(table.seen_feature)
    if not found and required:
        raise ConfigError(f"metrics.exclude_seen=true excludes each query's earlier items from the full-corpus metrics, but the "
                          f"model reads no history of items (no model.user_features entry shares the table of "
                          f"{table.id_feature!r}) and the data names no seen column. Fix: data.items.seen=<a list column of "
                          f"each row's earlier item ids, sharing {table.id_feature!r}'s table>, or a history feature in "
                          f"model.user_features, or metrics.exclude_seen=false")
    return found


def item_index(model: TwoTower, table: ItemTable, keys: list[str], dense_names: tuple[str, ...], chunk_rows: int,
               env: DistEnv, stop: Callable[[], None] | None = None) -> torch.Tensor:
    """The item tower's vectors of every table row, ``[N, O]`` float32 on ``env.device``, the same on every rank.

    Rank ``r`` of ``W`` embeds chunks ``r, r + W, …`` of ``chunk_rows`` rows; every rank runs
    ``ceil(chunks / W)`` forwards (the sharded forward is a collective), then the vectors are all-gathered.
    ``stop`` is called after each chunk (see the module docstring).
    """
    n, world = len(table), env.world_size
    chunks = [np.arange(s, min(s + chunk_rows, n)) for s in range(0, n, chunk_rows)]
    rounds = math.ceil(len(chunks) / world)
    mine: list[torch.Tensor] = []
    for r in range(rounds):
        i = r * world + env.rank
        dense, sparse = table.rows(chunks[i] if i < len(chunks) else chunks[0][:1], keys, dense_names)
        vectors = model.tower("item", dense.to(env.device), sparse.to(env.device)).float()
        if i < len(chunks):
            mine.append(vectors)
        if stop is not None:
            stop()
    if world == 1:
        return torch.cat(mine)
    width = mine[0].shape[1] if mine else int(vectors.shape[1])
    padded = torch.zeros(rounds * chunk_rows, width, device=env.device)
    for r, v in enumerate(mine):
        padded[r * chunk_rows: r * chunk_rows + v.shape[0]] = v
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    return torch.cat([parts[i % world][(i // world) * chunk_rows:][: len(c)] for i, c in enumerate(chunks)])


@dataclass
class CorpusEval:
    """The catalogue metrics of each task, computed over ``table`` (see the module's docstring).

    Attributes:
        table: the item catalogue (the item index is built over all of it).
        candidates: the catalogue items the queries are ranked among (:func:`~recsys_runner.train.candidates.catalogue_candidates`).
        tasks: the model's tasks with their catalogue metric names (``[(task, [recall@10, mrr, …])]``).
        spec: the metrics config (what builds each metric).
        chunk_rows: items scored, and embedded, at once (``model.corpus_chunk_rows``).
        k: the largest ``k`` asked for (each query's top ``k`` is kept for ``coverage@k``).
        index: ``exact``, or ``faiss``: the metrics of an HNSW search's top ``k`` (``model.index``).
        seen: the query rows' sparse features whose item ids score ``-inf`` except the target (``metrics.exclude_seen``:
            :func:`seen_features`), or are never drawn as negatives (``negatives``); empty: nothing excluded.
        negatives: ``model.eval_negatives``: each query's target ranked against this many sampled unseen catalogue rows
            (:func:`sampled_ranks`); ``0``: against the whole catalogue.
    """

    table: ItemTable
    candidates: Candidates
    tasks: list[tuple[Task, list[str]]]
    spec: MetricsConfig
    chunk_rows: int
    k: int
    index: str = "exact"
    seen: list[str] = field(default_factory=list)
    negatives: int = 0
    kept: list[torch.Tensor] | None = field(default=None, repr=False)  # inside index_kept: the first pass's item index

    @contextlib.contextmanager
    def index_kept(self) -> Iterator[None]:
        """Within the block, the item index is built by the first pass and reused by the next (the permutation importance's
        passes over unchanged weights: the index reads the catalogue and the item tower alone); mining runs once."""
        self.kept = []
        try:
            yield
        finally:
            self.kept = None

    @classmethod
    def for_run(cls, model: nn.Module, data: DataModule, tasks: tuple[Task, ...], spec: MetricsConfig,
                say: bool = True) -> CorpusEval | None:
        """The corpus pass of a run, or ``None`` when no task lists a catalogue metric; ``say``: log the catalogue items
        it cannot rank (:func:`~recsys_runner.train.candidates.catalogue_candidates`; rank 0).

        Raises:
            ConfigError: a catalogue metric is listed but the data has no item catalogue or the model no towers, or
                a ``k`` is not below the items each query ranks among (:func:`~recsys_runner.metrics.corpus.corpus_k`);
                ``model.eval_negatives`` without a catalogue metric, with ``coverage@<k>``, or more than a query has
                unseen items (:func:`check_eval_negatives`).
            DataError: an eval row's item could be ranked but the catalogue lacks it
                (:func:`~recsys_runner.train.candidates.check_eval_items`).
        """
        wanted = [(t, names) for t in tasks if (names := catalogue_metric_names(spec, t))]
        use_ranking_protocol(model, data, spec, two_tower=bool(wanted))
        if not wanted:
            if _miner(data) is not None:
                raise ConfigError("data.negatives.mined_ratio mines hard negatives from the item index each full-corpus "
                                  "evaluation builds, but no eval metric ranks against the catalogue, so none is built. Fix: "
                                  "add one, e.g. model.eval_metrics=[recall@50], or data.negatives.mined_ratio=0")
            if (towers := two_tower_of(model)) is not None and towers.eval_negatives:
                raise ConfigError(f"model.eval_negatives={towers.eval_negatives} ranks each query's item against sampled catalogue "
                                  f"items in the full-corpus metrics, but no eval metric ranks against the catalogue. Fix: "
                                  f"model.eval_metrics=[recall@10,ndcg@10,mrr] (with an item catalogue), or model.eval_negatives=0")
            return None
        listed = [n for _, names in wanted for n in names]
        table_of = getattr(data, "item_table", None)
        table = table_of() if table_of is not None else None
        key = "model.eval_metrics" if any(t.eval_metrics is not None for t, _ in wanted) else "metrics.eval"
        if table is None:
            raise ConfigError(f"{key} lists {listed}, which rank each query's item among the whole item catalogue, but the data "
                              f"has none. Fix: give the data its items (data.items=<file>, or data=synthetic_retrieval), or list "
                              f"only in-batch metrics, e.g. {key}=[inbatch_recall@10,inbatch_recall@50]")
        towers = two_tower_of(model)
        if towers is None:
            raise ConfigError(f"{key} lists {listed}, full-corpus metrics of a two-tower model; this model has no towers. "
                              f"Fix: model=dssm, or remove them")
        candidates = catalogue_candidates(table, data, eval_mapped_files(data), say)
        check_eval_items(candidates, data, say)
        num_items = len(candidates.table)
        seen = seen_features(towers, data, table) if spec.exclude_seen else []
        if seen and towers.corpus_index == "faiss":
            raise ConfigError("metrics.exclude_seen=true masks each query's seen items in the exact ranking; model.index=faiss "
                              "ranks an HNSW search's top k, which it does not mask. Fix: model.index=exact, or metrics.exclude_seen=false")
        negatives = towers.eval_negatives
        if negatives:
            if covered := [n for n in listed if n.startswith("coverage@")]:
                raise ConfigError(f"{key} lists {covered}, which counts catalogue items in the top k of the whole catalogue; "
                                  f"model.eval_negatives={negatives} ranks each query's item against {negatives} sampled items "
                                  f"instead. Fix: remove {covered[0]}, or model.eval_negatives=0")
            seen = seen or seen_features(towers, data, table, required=False)
            most_of = getattr(data, "eval_seen_most", None)  # file data measure their eval rows when built
            most = most_of(seen, candidates.table) if most_of is not None and seen else None  # the items ranked, not the whole table
            check_eval_negatives(negatives, num_items, most or 0, seen)
        among, more = ((f"model.eval_negatives={negatives} sampled catalogue items and its own", "model.eval_negatives={k}")
                       if negatives else ("the item catalogue's items", "a larger catalogue (data.items)"))
        k = corpus_k(listed, negatives + 1 if negatives else num_items, key, among, more)
        return cls(table, candidates, wanted, spec, towers.corpus_chunk_rows, k, towers.corpus_index, seen, negatives)

    def evaluate(self, model: nn.Module, data: DataModule, env: DistEnv, batches: Iterable[Batch],
                 progress: Progress | None = None, stop: Callable[[], None] | None = None,
                 rewrite: Rewrite | None = None) -> dict[str, float]:
        """Each task's catalogue metrics over ``batches`` (this rank's eval batches), combined over all ranks; ``stop``
        is called between chunks and between query batches (see the module docstring). With ``rewrite`` the user tower
        reads ``rewrite(n, batch)`` of the ``n``-th batch; its target and seen items stay the batch's own."""
        towers = two_tower_of(model)
        assert towers is not None, "CorpusEval.for_run checked the model's towers"
        features = data.features
        reused = bool(self.kept)
        whole = self.kept[0] if self.kept else item_index(towers, self.table, features.kjt_keys, features.dense_names, self.chunk_rows, env, stop)
        if self.kept is not None:
            self.kept[:] = [whole]
        picked = self.candidates.rows
        index = whole if picked is None else whole[torch.as_tensor(picked, device=whole.device)]
        num_items = len(self.candidates.table)
        rows = RowOf(self.candidates.table, env.device)
        ann = hnsw_index(index) if self.index == "faiss" else None
        metrics = [(task, {name: _metric(name, self.spec, env.device) for name in names}) for task, names in self.tasks]
        last: Batch | None = None
        for n, own in enumerate(in_step(batches)):
            batch = own.to(env.device, non_blocking=True) if own is not None else \
                last if last is not None else placeholder(features).to(env.device)
            last = batch
            read = rewrite(n, own).to(env.device, non_blocking=True) if rewrite is not None and own is not None else batch
            queries = towers.tower("user", read.dense_features, read.sparse_features).float()  # a collective: every rank
            if own is None:  # a stand-in while another rank scores its last queries: none of its rows count
                for _, by_name in metrics:
                    for metric in by_name.values():
                        metric.update(Ranked(queries.new_zeros(0, dtype=torch.float64), queries.new_zeros(0, self.k, dtype=torch.long),
                                             num_items))
                continue
            targets = rows(first_ids(batch.sparse_features, self.table.id_feature))
            seen = seen_rows(batch.sparse_features, self.seen, rows) if self.seen else None
            if self.negatives:
                ranked = sampled_ranks(queries, index, targets, seen, self.negatives, self.k, self.chunk_rows, self.seen, stop)
            else:
                ranks, top = corpus_ranks(queries, index, targets, self.k, self.chunk_rows, between=stop, seen=seen)
                ranked = Ranked(ranks, top, num_items) if ann is None else searched(ann, queries, targets, top, num_items)
            for _, by_name in metrics:
                for metric in by_name.values():
                    metric.update(ranked)
            if progress is not None:
                progress.update(1)
            if stop is not None:
                stop()
        miner = _miner(data)
        if miner is not None and not reused:  # the index refresh: the next training batches draw hard negatives from it (catalogue rows)
            mine(miner, whole, self.chunk_rows, env, stop)
        return {eval_key(task, name): float(m.compute()) for task, by_name in metrics for name, m in by_name.items()}


def mine(miner: MinedNegatives, index: torch.Tensor, chunk_rows: int, env: DistEnv, stop: Callable[[], None] | None = None) -> None:
    """Refresh ``miner``'s lists from the item index ``[N, O]`` (the same on every rank): rank ``r`` of ``W`` mines the
    items of chunks ``r, r + W, …`` (``chunk_rows`` each), the ranks' lists are all-gathered, every rank stores all of
    them: each rank's share of the ``N² · O`` work is ``1/W``, and every rank's data pipeline reads the same lists.
    ``stop`` is called after each chunk; the lists are stored only once all are mined, so an abandoned refresh leaves
    the previous ones whole."""
    n, world = index.shape[0], env.world_size
    if world == 1:
        lists = []
        for start in range(0, n, chunk_rows):
            lists.append(miner.mine(index, start, min(chunk_rows, n - start), chunk_rows))
            if stop is not None:
                stop()
        miner.store(torch.cat(lists))
        return
    chunks = [(s, min(chunk_rows, n - s)) for s in range(0, n, chunk_rows)]
    rounds = math.ceil(len(chunks) / world)
    local = torch.full((rounds * chunk_rows, miner.top_k), -1, dtype=torch.long, device=index.device)
    for r in range(rounds):
        if (i := r * world + env.rank) < len(chunks):
            local[r * chunk_rows: r * chunk_rows + chunks[i][1]] = miner.mine(index, *chunks[i], chunk_rows)
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local)
    miner.store(torch.cat([parts[i % world][(i // world) * chunk_rows:][:count] for i, (_, count) in enumerate(chunks)]).cpu())


def _miner(data: DataModule) -> MinedNegatives | None:
    """The data's mined hard-negative lists (``data.negatives.mined_ratio``), or ``None``."""
    miner_of = getattr(data, "negative_miner", None)
    return miner_of() if miner_of is not None else None


def _metric(name: str, spec: MetricsConfig, device: torch.device) -> Metric:
    """Metric ``name`` built from ``spec`` on ``device``."""
    return metric_entry(name).factory(spec).to(device)


def check_eval_negatives(n: int, num_items: int, most_seen: int, seen: list[str]) -> None:
    """Raise :class:`ConfigError` unless a query that has seen ``most_seen`` catalogue items besides its own (in features
    ``seen``) leaves ``n`` to draw from: ``num_items - 1 - most_seen``. When the run is built, ``most_seen`` is what the
    data measured of its eval rows (file data with ``data.items``), else 0; each eval batch is checked exactly again
    before its draw (:func:`sampled_ranks`)."""
    free = max(num_items - 1 - most_seen, 0)
    if n <= free:
        return
    had = f" and an eval query has seen {most_seen} of them besides its own item ({', '.join(seen)})" if most_seen else ""
    raise ConfigError(f"model.eval_negatives={n} ranks each eval query's item against {n} catalogue items it has not seen, but "
                      f"the catalogue has {num_items} items{had}, leaving {free} to draw from. Fix: model.eval_negatives<={free}, "
                      f"or model.eval_negatives=0 to rank against the whole catalogue")


def sampled_ranks(queries: torch.Tensor, index: torch.Tensor, targets: torch.Tensor, seen: torch.Tensor | None, n: int, k: int,
                  chunk_rows: int, seen_names: list[str], between: Callable[[], None] | None = None) -> Ranked:
    """Each query's target ranked against ``n`` sampled catalogue rows (``model.eval_negatives``) as :class:`Ranked`.

    The rows are :func:`~recsys_runner.models.ranking_eval.sampled_negatives` of the query's target row ``targets [Q]``
    and its seen set (``seen [Q, L]`` catalogue rows, ``-1`` padding, from features ``seen_names``, through
    :func:`~recsys_runner.models.ranking_eval.distinct_seen`; ``None``: nothing seen): uniform over the ``N`` rows of
    ``index [N, O]`` less those, without replacement, a function of the query's content and a fixed seed only. Scores
    ``<query, item>`` of the target and its negatives come from one product per query, so ties count exactly; the rank
    counts as :func:`~recsys_runner.metrics.retrieval.target_ranks` does (``inf`` for a target not in the catalogue).
    Queries go ``max(1, chunk_rows // (1 + n))`` at a time (one index chunk's worth of gathered vectors); ``between`` is
    called after each block. ``top`` holds each query's best ``min(k, 1 + n)`` candidate rows.

    Raises:
        ConfigError: some query has fewer than ``n`` unseen items (:func:`check_eval_negatives`).
    """
    num_items, target = index.shape[0], targets.long().view(-1, 1)
    unseen = distinct_seen(seen if seen is not None else target, targets)
    counts = (unseen != target).sum(dim=1)
    check_eval_negatives(n, num_items, int(counts.max()) if counts.numel() else 0, seen_names)
    items = torch.cat([target.clamp_min(0), sampled_negatives(unseen, targets, num_items, n)], dim=1)
    block = max(1, chunk_rows // (1 + n))
    scores = []
    for start in range(0, queries.shape[0], block):
        end = start + block
        mine = queries[start:end]  # [q, O], or a multi-interest user's [q, I, O]: an item scores by its best interest
        products = torch.bmm(index[items[start:end]], mine.unsqueeze(2) if mine.dim() == 2 else mine.transpose(1, 2))
        scores.append(products.amax(dim=2))
        if between is not None:
            between()
    score = torch.cat(scores) if scores else torch.zeros((0, 1 + n), dtype=queries.dtype, device=queries.device)
    ranks = target_ranks(score, torch.zeros_like(targets))
    ranks = torch.where(targets >= 0, ranks, torch.full_like(ranks, math.inf))
    top = items.gather(1, score.topk(min(k, 1 + n), dim=1).indices)
    return Ranked(ranks, top, num_items)


def hnsw_index(vectors: torch.Tensor) -> Any:
    """A FAISS HNSW graph (inner product, 32 links a node) over the item vectors ``[N, O]``, searched with ``efSearch``
    set per query to ``max(64, 2k)``: how a server would search them."""
    import faiss  # optional (model.index=faiss checks that it is installed)

    graph = faiss.IndexHNSWFlat(int(vectors.shape[1]), 32, faiss.METRIC_INNER_PRODUCT)
    graph.add(np.ascontiguousarray(vectors.cpu().numpy(), dtype=np.float32))
    return graph


def searched(graph: Any, queries: torch.Tensor, targets: torch.Tensor, exact_top: torch.Tensor, num_items: int) -> Ranked:
    """The queries' top ``k`` from the HNSW ``graph`` as :class:`Ranked` rows: a target's rank is its place in the list
    (``inf`` when the search misses it, so ``mrr`` is cut at ``k``), ``exact_top`` kept for ``ann_recall@k``."""
    k = exact_top.shape[1]
    graph.hnsw.efSearch = max(64, 2 * k)
    _, found = graph.search(np.ascontiguousarray(queries.cpu().numpy(), dtype=np.float32), k)
    top = torch.from_numpy(found).to(device=queries.device, dtype=torch.long)
    hit = top == targets.view(-1, 1)
    place = hit.float().argmax(dim=1).double()
    ranks = torch.where(hit.any(dim=1) & (targets >= 0), place, torch.full_like(place, math.inf))
    return Ranked(ranks, top, num_items, exact_top=exact_top)
