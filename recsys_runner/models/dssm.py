"""DSSM (Huang et al., 2013, "Learning Deep Structured Semantic Models for Web Search using
Clickthrough Data", https://dl.acm.org/doi/10.1145/2505515.2505665): a two-tower retrieval model.

The paper's two towers over letter-trigram word hashing, with tanh layers, cosine scores and a softmax over four
sampled negatives, in today's form: embedding-table features, ReLU MLP towers, cosine (or dot) scores over a
temperature, and the in-batch softmax with logQ correction of Yi et al. 2019 (YouTube's two-tower) below.

The features are split into a user (query) group and an item (candidate) group, from config. Each
tower embeds its group, runs an MLP and outputs an (optionally L2-normalized) vector; the score of a
(user, item) pair is their dot product divided by a temperature. Training uses the in-batch softmax
(Yi et al. 2019): every row is a positive (user, item) pair, and the other rows' items in the batch
are its negatives, plus the batch's last ``K`` rows when the data samples catalogue items into it
(``features.sampled_items``: item features only, candidates but no queries); with ``remove_accidental_hits`` less the
rows of the query's own item (:func:`without_accidental_hits`). With ``logq_correction``
each candidate's training logit loses ``log p_c``, its streaming-estimated probability of being a
candidate (:class:`~recsys_runner.models.frequency.FrequencyEstimator`), whatever put it there. Eval
computes ``inbatch_recall@k`` over the in-batch candidates (uncorrected scores, as served) and, when
the data has an item catalogue, the full-corpus metrics (``train/corpus.py``) with :meth:`DSSM.tower`. What does not
depend on the towers (the task, temperature, sampled rows, logQ, the corpus evaluation's settings) is
:class:`InBatchRetrieval`, which MIND's multi-interest towers (``models/mind.py``) share.

Shape legend: ``B`` batch, ``K`` sampled rows of a training batch, ``Q = B - K`` queries, ``D``
embedding dim, ``O`` tower output width, ``N`` catalogue items.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner.errors import ConfigError, require
from recsys_runner.features import DataNeeds, FeatureSpec, check_embedding_dim
from recsys_runner.models.common import MLP, ModelConfig, SparseArch, check_eval_metrics, check_layer_sizes, warn_unread
from recsys_runner.models.frequency import FrequencyEstimator, TableFrequency
from recsys_runner.tasks import InBatchSoftmaxTask

LOGQ_SOURCES = ("stream", "item_table")
"""``model.logq_source`` options: the streaming estimate of each candidate's frequency, or the item catalogue's counts."""
INDEXES = ("exact", "faiss")
"""``model.index`` options: the full-corpus evaluation's exact chunked scoring, or FAISS's approximate HNSW search."""


@dataclass(kw_only=True)
class DSSMConfig(ModelConfig):
    """Schema of ``conf/model/dssm.yaml``."""

    _target_: str = "recsys_runner.models.dssm.DSSM"
    embedding_dim: int = 16
    """Width ``D`` of every embedding table whose feature sets no ``embedding_dim`` of its own in ``data.sparse``
    (this model accepts mixed per-feature widths)."""
    user_features: list[str] = field(default_factory=lambda: ["cat_0"])
    """The user (query) tower's features: sparse or dense feature names of the data."""
    item_features: list[str] = field(default_factory=lambda: ["cat_1"])
    """The item (candidate) tower's features; none may also be a user feature."""
    tower_layer_sizes: list[int] = field(default_factory=lambda: [64, 32])
    """Layers of both towers; the last is the output width ``O`` of the user and item vectors."""
    temperature: float = 0.05
    """Scores are ``<u, v> / temperature``; small values sharpen the in-batch softmax."""
    normalize: bool = True
    """L2-normalize both tower outputs (cosine similarity)."""
    eval_metrics: list[str] = field(default_factory=lambda: ["inbatch_recall@1", "inbatch_recall@10", "inbatch_recall@50"])
    """Retrieval metrics, logged as ``eval/<name>`` (``metrics.eval`` does not apply): ``inbatch_recall@<k>`` over
    the batch's candidates, and over the data's whole item catalogue (``data.item_table()``; refused without one)
    ``recall@<k>``, ``ndcg@<k>``, ``mrr``, ``coverage@<k>`` (docs/retrieval.md, "Full-corpus evaluation")."""
    logq_correction: bool = True
    """Subtract ``log p_c`` (each candidate's streaming-estimated probability of being a step's candidate) from its
    training logit (Yi et al. 2019), so that popular items are not over-penalized as in-batch negatives; reads the
    first sparse feature of ``item_features`` as the item id."""
    remove_accidental_hits: bool = False
    """``true``: leave out of a query's training softmax every other candidate row of its own item (another row of the
    batch with that item, or a sampled negative that drew it), as TensorFlow's ``sampled_softmax_loss`` does
    (:func:`without_accidental_hits`). ``false``: they stay, as the sampled softmax the logQ correction derives from
    has them (its candidates estimate the softmax's sum over all items, the positive's own term included).
    ``inbatch_recall@k`` leaves them out either way (docs/retrieval.md, "Accidental hits")."""
    logq_source: str = "stream"
    """Where ``p_c`` comes from: ``stream`` (estimated from the candidates of the steps so far, every candidate row
    counted: in-batch and ``data.negatives`` alike) or ``item_table`` (the catalogue's popularity, ``data.item_table()``:
    exact from the first step; in-batch candidates only, so not with ``data.negatives``)."""
    logq_buckets: int | None = None
    """Hash buckets of the frequency estimator; ``null``: the item id feature's ``num_embeddings`` (one per id)."""
    logq_alpha: float = 0.01
    """Rate of the estimator's moving average of each item's gap between sightings (the paper's ``α``)."""
    corpus_chunk_rows: int = 8192
    """Full-corpus evaluation scores this many catalogue items at once (and builds the item index in chunks of it):
    memory is an eval batch's ``B × (corpus_chunk_rows + k)`` scores, not ``B × N``."""
    index: str = "exact"
    """Full-corpus evaluation's index: ``exact`` (chunked matmul) or ``faiss`` (an HNSW graph, as a server would search:
    the ranking metrics are those of its top ``k``, and ``ann_recall@<k>`` says how much of the exact top ``k`` it
    returns; needs ``pip install faiss-cpu``)."""
    eval_negatives: int = 0
    """``0``: the full-corpus metrics rank each eval query's item against the whole catalogue. ``N > 0``: against ``N``
    catalogue items drawn uniformly, without replacement, from those the query has not seen (its user-tower history
    features that read the item table, ``data.items.seen``, and its own item), with a fixed seed: the same negatives for
    every model and run on the same data and catalogue (the sampled protocol of docs/metrics.md, "Protocols"; SASRec's
    paper has ``N = 100``). ``inbatch_recall@<k>`` is unaffected; not with ``coverage@<k>`` or ``index: faiss``."""

    def __post_init__(self) -> None:
        check_embedding_dim("model.embedding_dim", self.embedding_dim)
        require(len(self.user_features) > 0, "model.user_features is empty; list the user tower's features, e.g. [user_id]")
        require(len(self.item_features) > 0, "model.item_features is empty; list the item tower's features, e.g. [item_id]")
        both = sorted(set(self.user_features) & set(self.item_features))
        require(not both, f"features {both} are in both model.user_features and model.item_features; each belongs to one tower")
        check_layer_sizes("tower_layer_sizes", self.tower_layer_sizes)
        require(self.temperature > 0, f"model.temperature must be positive, got {self.temperature}. Fix: e.g. model.temperature=0.05")
        require(self.logq_buckets is None or self.logq_buckets > 0, f"model.logq_buckets must be positive or null, got {self.logq_buckets}")
        require(self.logq_source in LOGQ_SOURCES, f"model.logq_source={self.logq_source!r} must be one of {list(LOGQ_SOURCES)}")
        require(0 < self.logq_alpha <= 1, f"model.logq_alpha must lie in (0, 1], got {self.logq_alpha}. Fix: model.logq_alpha=0.01")
        require(self.index in INDEXES, f"model.index={self.index!r} must be one of {list(INDEXES)}, e.g. model.index=exact")
        require(self.index != "faiss" or importlib.util.find_spec("faiss") is not None,
                "model.index=faiss needs the faiss package, which is not installed. Fix: pip install faiss-cpu, or model.index=exact")
        require(self.corpus_chunk_rows > 0, f"model.corpus_chunk_rows must be positive, got {self.corpus_chunk_rows}. Fix: "
                f"model.corpus_chunk_rows=8192")
        warn_unread(self, ["logq_source", "logq_buckets", "logq_alpha"], self.logq_correction, "model.logq_correction=true")
        self._check_eval_negatives()

    def _check_eval_negatives(self) -> None:
        """``eval_negatives`` against the metrics and index it changes (the catalogue's size is checked once the data exists:
        :meth:`recsys_runner.train.corpus.CorpusEval.for_run`)."""
        n = self.eval_negatives
        require(n >= 0, f"model.eval_negatives must be >= 0 (0: rank against the whole catalogue), got {n}. Fix: model.eval_negatives=0, "
                f"or e.g. 100")
        check_eval_metrics(self.eval_metrics, n, "catalogue items", "inbatch_recall@10,recall@10")
        if not n:
            return
        require(any(not m.startswith("inbatch_") for m in self.eval_metrics),
                f"model.eval_negatives={n} ranks each query's item against {n} sampled catalogue items in the full-corpus "
                f"metrics, but model.eval_metrics={list(self.eval_metrics)} lists only in-batch ones, which it does not change. "
                f"Fix: add recall@<k>, ndcg@<k> or mrr (e.g. model.eval_metrics=[recall@10,ndcg@10,mrr]), or model.eval_negatives=0")
        require(self.index == "exact", f"model.eval_negatives={n} ranks each query's item against {n} sampled items; model.index="
                f"{self.index} ranks an approximate search's top k of the whole catalogue instead. Fix: model.index=exact, or "
                f"model.eval_negatives=0")

    def data_needs(self) -> DataNeeds:
        """(user, item) pairs over the two towers' features: generated data (``data=synthetic``) links them."""
        return DataNeeds(user_features=tuple(self.user_features), item_features=tuple(self.item_features))


def check_group(features: FeatureSpec, key: str, names: list[str]) -> None:
    """Raise :class:`ConfigError` listing the valid names when ``names`` has one the data lacks."""
    valid = [*features.sparse_names, *features.dense_names]
    unknown = [n for n in names if n not in valid]
    if unknown:
        raise ConfigError(f"{key} has {unknown}, which the data does not have. Valid feature names: {', '.join(valid)}")


class Tower(nn.Module):
    """One side of the two towers: its features' embeddings and dense columns → a vector.

    ``(embedded [B, ΣD_f], dense [B, N]) → [B, O]``: the tower's columns of both (``sparse_columns``
    from :meth:`SparseArch.columns`, ``dense_index``), through an MLP (ReLU between layers, none after
    the last), L2-normalized when ``normalize``.
    """

    def __init__(self, sparse_columns: list[int], dense_index: list[int], layer_sizes: list[int],
                 normalize: bool, device: torch.device | None = None) -> None:
        super().__init__()
        self.sparse_columns, self.dense_index, self.normalize = sparse_columns, dense_index, normalize
        in_features = len(sparse_columns) + len(dense_index)
        self.hidden = MLP(in_features, layer_sizes[:-1], device=device) if len(layer_sizes) > 1 else nn.Identity()
        self.out = nn.Linear(layer_sizes[-2] if len(layer_sizes) > 1 else in_features, layer_sizes[-1], device=device)

    def forward(self, embedded: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        x = torch.cat([embedded[:, self.sparse_columns], dense[:, self.dense_index]], dim=1)
        v = self.out(self.hidden(x))
        return F.normalize(v, dim=1) if self.normalize else v


class InBatchRetrieval(nn.Module):
    """What every two-tower retrieval model shares, whatever its towers: its one
    :class:`~recsys_runner.tasks.InBatchSoftmaxTask`, the temperature, the ``K`` sampled item rows at the end of a training
    batch, the logQ correction of the candidates' training logits, and the attributes the full-corpus evaluation and the
    export read (``corpus_chunk_rows``, ``corpus_index``, ``eval_negatives``, ``tower_features``; a subclass adds
    ``tower``). :class:`DSSM` and :class:`~recsys_runner.models.mind.MIND` build their towers on it.

    Args:
        config: the retrieval keys of :class:`DSSMConfig` (temperature, metrics, logQ, corpus evaluation).
        features: the data's schema (``sampled_items``, the item id feature's size).
        dense_device: device of the frequency estimator's buffers.
    """

    def __init__(self, config: DSSMConfig, *, features: FeatureSpec, dense_device: torch.device | None = None) -> None:
        super().__init__()
        check_group(features, "model.user_features", list(config.user_features))
        check_group(features, "model.item_features", list(config.item_features))
        self.tasks = (InBatchSoftmaxTask(eval_metrics=tuple(config.eval_metrics) if config.eval_metrics else None),)
        self.temperature = config.temperature
        self.tower_features = {"user": list(config.user_features), "item": list(config.item_features)}
        """Each tower's features (data columns, sparse or dense), by tower name: what :meth:`tower` reads."""
        self.sampled_items = int(getattr(features, "sampled_items", 0))
        """``K``: the last rows of a training batch that are sampled catalogue items (candidates, not queries)."""
        self.corpus_chunk_rows, self.corpus_index = config.corpus_chunk_rows, config.index
        self.eval_negatives = config.eval_negatives
        """Sampled negatives per query of the full-corpus metrics (``0``: the whole catalogue)."""
        self.item_id = next((n for n in features.sparse_names if n in config.item_features), None)
        """The item tower's id feature (its first sparse feature): what the frequency estimator counts and what tells a
        query's accidental hits."""
        self.remove_accidental_hits = config.remove_accidental_hits
        self.in_batch_ranking = False
        """Whether eval scores leave each query's accidental hits out, for ``inbatch_recall@k``: set by the evaluation that
        reads them (:func:`recsys_runner.train.corpus.use_ranking_protocol`); an exported or served model scores every
        pair."""
        self.logq = _estimator(config, features, self.item_id, dense_device)

    def use_catalogue(self, ids: torch.Tensor | None, popularity: torch.Tensor | None) -> None:
        """The data's item catalogue (item ids ``[N]``, popularity ``[N]``; ``None``: the data has none), given once the model
        is built: ``logq_source: item_table`` takes ``p_c`` from it.

        Raises:
            ConfigError: ``logq_source: item_table`` without a catalogue, or with sampled negatives.
        """
        if not isinstance(self.logq, TableFrequency):
            return
        if ids is None or popularity is None:
            raise ConfigError("model.logq_source=item_table reads each item's popularity from the data's item catalogue, and "
                              "the data has none. Fix: data.items=<items file> (or data=synthetic_retrieval), or "
                              "model.logq_source=stream")
        if self.sampled_items:
            raise ConfigError(f"model.logq_source=item_table gives the probability of an in-batch candidate, but the batches also "
                              f"carry {self.sampled_items} sampled negatives (data.negatives) drawn otherwise. Fix: "
                              f"model.logq_source=stream (it counts every candidate), or data.negatives.num_negatives=0")
        self.logq.load(ids, popularity)

    def num_queries(self, rows: int) -> int:
        """The rows of a batch of ``rows`` that are queries: all in eval, all but the ``K`` sampled item rows in training."""
        return rows - (self.sampled_items if self.training else 0)

    def corrected(self, scores: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        """The in-batch scores ``[Q, B]`` the softmax (training) and ``inbatch_recall@k`` (eval) read: each query's
        accidental hits at ``-inf`` (:func:`without_accidental_hits`; in training with ``remove_accidental_hits``, in eval
        with :attr:`in_batch_ranking`), and in training each candidate's ``log p_c`` subtracted (``logq_correction``).
        Without an item id feature there is nothing to tell items apart by."""
        hits = self.remove_accidental_hits if self.training else self.in_batch_ranking
        logq = self.training and self.logq is not None
        if self.item_id is None or not (hits or logq):
            return scores
        ids = first_ids(sparse, self.item_id)
        if hits:
            scores = without_accidental_hits(scores, ids)
        return scores - self.logq(ids).to(scores.dtype) if logq and self.logq is not None else scores


class DSSM(InBatchRetrieval):
    """Two towers; ``(dense [B, n], sparse KJT) → scores [Q, B]``, ``scores[q, c] = <user_q, item_c> / τ`` (in
    training ``- log p_c`` with ``logq_correction``; ``Q = B`` in eval mode, ``B - K`` in training with ``K`` sampled
    item rows).

    Row ``q``'s positive is candidate ``q`` (the diagonal); its ``tasks`` is one
    :class:`~recsys_runner.tasks.InBatchSoftmaxTask`, so the TrainWrapper applies the in-batch softmax loss
    and eval computes ``inbatch_recall@k`` (and the corpus metrics, through :meth:`tower`).

    Args:
        config: its hyperparameters (:class:`DSSMConfig`: ``embedding_dim`` ``D``, the towers' feature names
            ``user_features`` / ``item_features`` (sparse or dense), ``tower_layer_sizes`` ending in ``O``,
            ``temperature``, ``normalize``, ``eval_metrics``).
        features: the data's feature schema; the groups are checked against it.
        dense_device: device of the dense parameters (embeddings start on ``meta``).

    Example::

        >>> from recsys_runner.configurable import make
        >>> from recsys_runner.data.generated.synthetic_config import SyntheticDataConfig
        >>> from recsys_runner.models.common import materialize
        >>> from recsys_runner.models.dssm import DSSM, DSSMConfig
        >>> data = make(SyntheticDataConfig, batch_size=8, num_dense=3, num_sparse=4, num_embeddings=50).build()
        >>> batch = next(iter(data.train_batches(epoch=0, rank=0, world_size=1)))
        >>> model = materialize(DSSM(DSSMConfig(embedding_dim=8, user_features=["cat_0", "int_0"], item_features=["cat_1"],
        ...                                     tower_layer_sizes=[16, 8]), features=data.features))
        >>> [v.shape for v in model.user_item(batch.dense_features, batch.sparse_features)]   # each tower's vectors
        [torch.Size([8, 8]), torch.Size([8, 8])]
        >>> model(batch.dense_features, batch.sparse_features).shape   # every user against every item of the batch
        torch.Size([8, 8])
    """

    same_embedding_width: ClassVar[str | None] = None
    """None: each tower concatenates its features' embeddings, so each feature may have its own width."""

    def __init__(self, config: DSSMConfig, *, features: FeatureSpec, dense_device: torch.device | None = None) -> None:
        super().__init__(config, features=features, dense_device=dense_device)
        self.sparse_arch = SparseArch(features, config.embedding_dim, type(self))

        def tower(names: list[str]) -> Tower:
            sparse = self.sparse_arch.columns([n for n in names if n in features.sparse_names])
            dense = [features.dense_names.index(n) for n in names if n in features.dense_names]
            return Tower(sparse, dense, list(config.tower_layer_sizes), config.normalize, device=dense_device)

        self.user_tower, self.item_tower = tower(list(config.user_features)), tower(list(config.item_features))

    def tower(self, name: str, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        """Tower ``name``'s (``user`` or ``item``) vectors ``[B, O]``; it reads only its own features of the batch.

        Serving uses the towers apart: user vectors at request time, item vectors computed once into an index
        (``python -m recsys_runner.export`` writes each as its own program)."""
        return getattr(self, f"{name}_tower")(self.sparse_arch(sparse), dense)

    def user_item(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The user and item vectors: ``([B, O], [B, O])`` (e.g. to export the item index)."""
        embedded = self.sparse_arch(sparse)
        return self.user_tower(embedded, dense), self.item_tower(embedded, dense)

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        embedded = self.sparse_arch(sparse)
        queries = self.num_queries(embedded.shape[0])
        # the user tower over the queries only: the sampled rows have no user side
        user = self.user_tower(embedded[:queries], dense[:queries])
        item = self.item_tower(embedded, dense)
        return self.corrected(user @ item.t() / self.temperature, sparse)


def _estimator(config: DSSMConfig, features: FeatureSpec, item_id: str | None,
               device: torch.device | None) -> FrequencyEstimator | TableFrequency | None:
    """The logQ correction's frequency estimator, or ``None`` without ``logq_correction``.

    Raises:
        ConfigError: the correction is on but the item tower has no sparse (id) feature to count.
    """
    if not config.logq_correction:
        return None
    if item_id is None:
        raise ConfigError(f"model.logq_correction counts item ids, but model.item_features={list(config.item_features)} has no "
                          f"sparse feature. Fix: add the item id feature to model.item_features, or model.logq_correction=false")
    size = next(f.num_embeddings for f in features.sparse if f.name == item_id)
    if config.logq_source == "item_table":
        return TableFrequency(config.logq_buckets or size, device=device)
    return FrequencyEstimator(config.logq_buckets or size, config.logq_alpha, device=device)


def first_ids(sparse: KeyedJaggedTensor, key: str) -> torch.Tensor:
    """Each row's first id of feature ``key``, ``[B]`` (``-1`` for a row without one): a row's item id."""
    jagged = sparse[key]
    values, lengths = jagged.values(), jagged.lengths()
    starts = jagged.offsets()[:-1].clamp_max(max(values.numel() - 1, 0))
    first = values[starts] if values.numel() else torch.zeros_like(lengths, dtype=values.dtype)
    return torch.where(lengths > 0, first, torch.full_like(first, -1))


torch.fx.wrap("first_ids")  # a call in traced graphs (TorchRec's sparse-dist pipeline traces forward): it branches on sizes


def without_accidental_hits(scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``scores [Q, C]`` with each query's accidental hits at ``-inf``: the candidates ``c != q`` whose item id ``ids[c]``
    (``ids [C]``, ``-1``: none) is query ``q``'s own ``ids[q]`` — another row of the batch with the same item, or a
    sampled row that drew it. Such a candidate ties with the positive: ``inbatch_recall@k``, which counts the
    candidates scoring at least as high as the positive, must not count it (eval scores always go through here), and
    the training softmax leaves it out with ``remove_accidental_hits`` (TensorFlow's ``remove_accidental_hits``).
    Popular items repeat in most batches (generated Zipf pairs, batches of 512: 60 % of the rows share their item with
    another row, ~2.8 copies each). SASRec's sampled softmax takes each distinct item of the batch once instead."""
    q = scores.shape[0]
    own = ids[:q].view(-1, 1)
    same = (ids.view(1, -1) == own) & (own >= 0)
    same &= torch.arange(q, device=ids.device).view(-1, 1) != torch.arange(ids.shape[0], device=ids.device).view(1, -1)
    return scores.masked_fill(same, float("-inf"))


torch.fx.wrap("without_accidental_hits")  # as first_ids: its sizes come from the batch


def tower_scores(user: torch.Tensor, item: torch.Tensor) -> torch.Tensor:
    """Every (query, candidate) pair's ``<user, item>``: ``user [Q, O]``, ``item [C, O]`` → ``[Q, C]``. A multi-interest user
    ``[Q, K, O]`` (:class:`~recsys_runner.models.mind.MIND`) scores a candidate by its best interest, ``max_k <user_k, item>``:
    how serving retrieves with K vectors (each searches the index, the results merged by score)."""
    if user.dim() == 3:
        return (user @ item.t().unsqueeze(0)).amax(dim=1)
    return user @ item.t()
