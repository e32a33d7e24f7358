"""Generated user histories whose labels and next items depend on the history: the default data of sequence models.

A hidden world is drawn once from ``seed`` (:mod:`~recsys_runner.data.generated.synthetic_history_world`): ``num_items`` items, each in one of ``num_categories`` categories,
with Zipf popularity; every item has a *successor* in its own category (what people tend to watch next); every
user prefers ``interests`` categories (2). A row is one user's history (``hist_item_id``, ``hist_category`` and, with
``timestamps``, ``hist_ts``), then a candidate item (``item_id``, ``category``) and a click label:

* each event follows the previous one's successor with probability ``follow``, else it is a fresh pick (a
  popular item of one of the user's categories, or of any category);
* the *true next item* is drawn by the same rule from the newest event;
* the candidate is the true next item with probability ``1 - negatives`` (always for a next-item model), else a
  popular item of any category;
* the click's score adds the share of the history in the candidate's category, whether the candidate is the
  successor of the newest event, the item's own appeal and a little of two dense columns;
* with ``data.tasks=[ctr, cvr, …]`` (or a multi-task model's tasks) one label per task, as ``data=synthetic`` draws them
  (:mod:`recsys_runner.data.generated.synthetic_labels`): the click above, then each later task a conversion of a
  clicked row whose own score reads the history too (``HistoryConversion``: the same two signals and whether the
  candidate is already in the history, with weights of its own), drawn after every other column, so a batch's click
  and ids are those of its one-label batch.

So a model that reads the history (DIN, BST) beats the same model without it, and a next-item model (SASRec)
that learns successors beats the popularity ranking. History lengths are long-tailed (a Zipf law over
``1 … max_len`` with exponent ``length_skew``, plus ``empty_fraction`` empty histories).

As with ``data=synthetic``, every batch is a pure function of ``(seed, split, batch index)``; nothing is written.

With ``data.batch_tokens`` a batch holds as many rows as fit that many history tokens (a row costs its length + 1,
:mod:`recsys_runner.data.sequences.tokens`) instead of ``batch_size`` rows: batch ``i`` draws its rows' lengths from its own
seeded stream and keeps the first :func:`~recsys_runner.data.sequences.tokens.token_slices` cut of them, so it is still a pure
function of ``(seed, split, i)``. An epoch then has a fixed number of batches, ``num_train_rows // rows_per_batch``
(the *expected* rows of a token batch, :meth:`SyntheticSequencesConfig.rows_per_batch`), dealt to the ranks as
before: every rank gets the same count, whatever rows each batch turns out to hold.

``data.group_by_length`` (with ``batch_tokens``) batches rows of similar length together, for models that pad each
batch to its longest row (DIN, BST): then a batch of mixed lengths costs ``rows × longest`` padded slots, far more
than its tokens, and only length-sorted batches make memory follow the budget. Batches ``i`` of one *pool* of
:data:`POOL_BATCHES` consecutive indices share the pool's lengths, drawn from the pool's own stream, sorted and cut so
that each batch's padded size, rows × (longest + 1), fits the budget (:func:`~recsys_runner.data.sequences.tokens.padded_slices`);
batch ``i`` takes one of the cuts (the pool's cuts are dealt in a seeded random order, and any cut beyond
:data:`POOL_BATCHES` is dropped at a random position, so no length is favoured). Its rows' other columns come from
its own stream, so it is still a pure function of ``(seed, split, i)``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
from torchrec.datasets.utils import Batch

from recsys_runner.data.base import DataModule, batch_kjt
from recsys_runner.data.catalogue.items import ItemTable
from recsys_runner.data.generated.synthetic_history_world import HistoryRows, HistoryWorld
from recsys_runner.data.generated.synthetic_items import generated_item_table
from recsys_runner.data.generated.synthetic_labels import SyntheticLabelsConfig
from recsys_runner.data.sequences.tokens import check_budget, padded_slices, row_tokens, token_slices
from recsys_runner.errors import require
from recsys_runner.features import TRUNCATIONS, DataNeeds, FeatureSpec, SequenceGroup, SparseFeature

_TRAIN, _EVAL = 0, 1
DEFAULT_NUM_STEPS = 1000
"""Optimizer steps of a run on this data when neither ``train.num_steps`` nor ``train.num_epochs`` is set."""
POOL_BATCHES = 16
"""``group_by_length``: consecutive batch indices whose rows are sorted by length together (the batch order is then
shuffled by the epoch's permutation, so a run does not see all short rows together)."""
HISTORY = "hist"
"""The name of the one sequence group (``data.sequences`` key of file data)."""


@dataclass(kw_only=True)
class SyntheticSequencesConfig(SyntheticLabelsConfig):
    """Schema of ``conf/data/synthetic_sequences.yaml``; its label fields (``tasks``, ``label_kinds`` …) are ``data=synthetic``'s
    (:class:`~recsys_runner.data.generated.synthetic_labels.SyntheticLabelsConfig`), the later tasks scored from the history."""

    _target_: str = "recsys_runner.data.generated.synthetic_sequences.SyntheticSequences"
    batch_size: int = 512
    """Rows per batch per rank. Ignored when ``data.batch_tokens`` is set: batches are then cut by history tokens and
    the module's ``batch_size`` (what the sharding planner costs with) is the expected rows of one such batch."""
    batch_tokens: int | None = None
    """Batches of as many rows as fit this many history tokens per rank (a row costs its history length + 1) instead
    of ``batch_size`` rows: steps of even cost on long-tailed lengths. At least ``max_len + 1`` (one longest row).
    An epoch is ``num_train_rows // rows_per_batch`` batches per rank group, the same count on every rank.
    ``null``: ``batch_size`` rows."""
    num_train_rows: int = 524_288
    """Rows in one training epoch (all ranks together)."""
    num_eval_rows: int = 32_768
    """Rows in the evaluation split (all ranks together), generated in whole batches: the same batches on any number of
    ranks."""
    num_users: int = 50_000
    num_items: int = 20_000
    num_categories: int = 100
    interests: int = 2
    """Categories each user prefers (fresh picks come from one of them with 0.8): users of several interests, whose
    history spans them, for a multi-interest retrieval model (``model=mind``) against a single vector."""
    num_dense: int = 2
    """Dense columns ``int_0 …`` (a little signal each)."""
    candidates_per_user: int = 1
    """Rows in a row with the same user and history, each its own candidate and label: a user's impressions grouped, as a
    ranking log holds them (``model=hstu_rank`` scores such rows in one sequence, the history once). ``1``: every row
    its own user. Not with ``batch_tokens``."""
    max_len: int = 50
    """The longest history a row has; lengths follow a Zipf law over ``1 … max_len``."""
    length_skew: float = 1.2
    """Exponent ``a`` of the length distribution ``P(L = k) ∝ k^-a``: larger means more short histories."""
    empty_fraction: float = 0.05
    """Rows with no history at all (a new user)."""
    follow: float = 0.6
    """Probability that an event is the previous event's successor rather than a fresh pick."""
    negatives: float | None = None
    """Fraction of rows whose candidate is a random popular item instead of the true next item. ``null``: 0.5, or
    0 for a next-item or two-tower model (every row's candidate is then the item that came next: a positive pair)."""
    timestamps: bool = True
    """Carry each event's time (``hist_ts``, seconds, ascending) for time-aware models."""
    truncate: str = "recent"
    """Kept in the schema for models and docs: generated histories never exceed ``max_len``."""
    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("num_users", "num_items", "num_categories", "max_len", "interests"):
            require(getattr(self, key) > 0, f"data.{key} must be positive, got {getattr(self, key)}")
        require(self.num_items >= self.num_categories, f"data.num_items={self.num_items} must be at least data.num_categories="
                f"{self.num_categories} (every category holds items)")
        require(self.num_dense >= 0, f"data.num_dense must be >= 0, got {self.num_dense}")
        require(self.length_skew >= 0, f"data.length_skew must be >= 0, got {self.length_skew}")
        for key in ("empty_fraction", "follow"):
            require(0 <= getattr(self, key) <= 1, f"data.{key} must lie in [0, 1], got {getattr(self, key)}")
        require(self.negatives is None or 0 <= self.negatives < 1, f"data.negatives must lie in [0, 1) or be null, got {self.negatives}")
        require(self.truncate in TRUNCATIONS, f"data.truncate={self.truncate!r} must be one of {list(TRUNCATIONS)}")
        require(self.candidates_per_user >= 1, f"data.candidates_per_user must be >= 1, got {self.candidates_per_user}")
        require(self.candidates_per_user == 1 or self.batch_tokens is None,
                f"data.candidates_per_user={self.candidates_per_user} groups rows by user, which token batches "
                f"(data.batch_tokens={self.batch_tokens}) cut by their lengths. Fix: data.batch_tokens=null, or data.candidates_per_user=1")
        if self.batch_tokens is not None:
            check_budget(self.batch_tokens, self.max_len)
        rows = self.rows_per_batch()
        sized = f"data.batch_tokens={self.batch_tokens}: ~{rows} rows" if self.batch_tokens is not None else f"data.batch_size={rows}"
        require(self.num_train_rows >= rows and self.num_eval_rows >= rows,
                f"data.num_train_rows and data.num_eval_rows must each hold one batch ({sized})")

    def supports_batch_tokens(self) -> bool:
        """Every row has a history, so ``batch_tokens`` can size the batches."""
        return True

    def expected_row_tokens(self) -> float:
        """The mean cost of a row in tokens, ``1 + E[length]``, from the length law (plain Python: this runs on ``meta``)."""
        weights = [k ** -self.length_skew for k in range(1, self.max_len + 1)]
        mean_length = (1 - self.empty_fraction) * sum(k * w for k, w in enumerate(weights, 1)) / sum(weights)
        return 1.0 + mean_length

    def rows_per_batch(self) -> int:
        """``batch_size``, or with ``batch_tokens`` the expected rows of a token batch, ``batch_tokens // E[row cost]``:
        what the planner costs with and what sizes an epoch. Real batches hold about this many on average (a few %
        more in drawn order, since the row that overflows a budget tends to be a long one; grouped batches range from
        a few long rows to many short ones)."""
        if self.batch_tokens is None:
            return self.batch_size
        return max(1, int(self.batch_tokens // self.expected_row_tokens()))

    def default_num_steps(self) -> int:
        return DEFAULT_NUM_STEPS

    def for_model(self, needs: DataNeeds) -> SyntheticSequencesConfig:
        """The fields left ``null`` decided for the model: its tasks, their kinds and classes (as ``data=synthetic`` fills
        them: a multi-task model such as ``model=hstu_rank model.tasks=[ctr,cvr]`` gets one label per task), and
        ``negatives``: none for a next-item or two-tower model (every candidate is the true next item: a two-tower model's
        rows are the (user, item) pairs it learns to retrieve)."""
        changes = self.label_changes(needs)
        if self.negatives is None:
            changes["negatives"] = 0.0 if needs.next_item or needs.item_features else 0.5
        return replace(self, **changes) if changes else self


class SyntheticSequences(DataModule):
    """Histories, candidates and clicks generated on the fly; see the module docstring.

    Example::

        data = make(SyntheticSequencesConfig, batch_size=4, max_len=5).build()
        batch = next(iter(data.train_batches(epoch=0, rank=0, world_size=1)))
        batch.sparse_features["hist_item_id"].lengths()   # e.g. tensor([5, 1, 0, 2])
    """

    def __init__(self, config: SyntheticSequencesConfig) -> None:
        c = self.config = config.resolved()
        self.batch_size = c.rows_per_batch()
        self._negatives = 0.5 if c.negatives is None else c.negatives
        item, category = "item", "category"
        sparse = (
            SparseFeature("user_id", c.num_users),
            SparseFeature("item_id", c.num_items, pooling="mean", table=item),
            SparseFeature("category", c.num_categories, pooling="mean", table=category),
            SparseFeature("hist_item_id", c.num_items, pooling="mean", table=item),
            SparseFeature("hist_category", c.num_categories, pooling="mean", table=category),
        )
        group = SequenceGroup(HISTORY, ("hist_item_id", "hist_category"), c.max_len, c.truncate,
                              timestamps="hist_ts" if c.timestamps else None)
        self.features = FeatureSpec(tuple(f"int_{i}" for i in range(c.num_dense)), sparse, c.label_columns(), sequences=(group,),
                                    label_kinds=c.label_column_kinds())
        self._drawn: HistoryWorld | None = None
        self._catalogue: ItemTable | None = None

    @property
    def _world(self) -> HistoryWorld:
        """The hidden world, drawn at the first batch: planning (``recsys_runner.plan``, on ``meta``) never draws it."""
        if self._drawn is None:
            self._drawn = HistoryWorld.draw(self.config)
        return self._drawn

    def item_table(self) -> ItemTable:
        """The item catalogue (every item id with its category; popularity: the world's Zipf weights, what a pick "of any
        category" draws by), which a two-tower model's full-corpus evaluation ranks against (docs/retrieval.md)."""
        if self._catalogue is None:
            world = self._world
            self._catalogue = generated_item_table(["item_id", "category"], [world.category.numpy()], world.popularity.numpy())
        return self._catalogue

    def num_train_batches(self, world_size: int) -> int:
        return self.config.num_train_rows // self.batch_size // world_size

    def train_batches(self, epoch: int, rank: int, world_size: int) -> Iterator[Batch]:
        total = self.config.num_train_rows // self.batch_size
        order = torch.randperm(total, generator=torch.Generator().manual_seed(self.config.seed * 7919 + epoch))
        mine = order[rank::world_size][: self.num_train_batches(world_size)]
        return (self.batch(_TRAIN, int(i)) for i in mine)

    def eval_batches(self, rank: int, world_size: int) -> Iterator[Batch]:
        # every eval batch on some rank (the evaluator keeps a rank with one fewer in step): the same metrics on any world size
        return (self.batch(_EVAL, i) for i in range(rank, self.config.num_eval_rows // self.batch_size, world_size))

    def batch(self, split: int, index: int) -> Batch:
        """Batch ``index`` of ``split`` (0 train, 1 eval): a pure function of the seed."""
        g = torch.Generator().manual_seed(hash((self.config.seed, 104_729, split, index)) & 0x7FFF_FFFF_FFFF_FFFF)
        budget = self.config.batch_tokens
        lengths = None
        if budget is not None:
            lengths = self._grouped_lengths(budget, split, index) if self.config.group_by_length else self._token_lengths(budget, g)
        rows = self._world.rows(self.batch_size, self._negatives, g, lengths)
        return self.assemble(rows)

    def _token_lengths(self, budget: int, g: torch.Generator) -> torch.Tensor:
        """History lengths of one token batch: rows drawn from ``g`` until they overflow ``budget``, cut at the first
        row that does not fit (:func:`token_slices`), so the batch's tokens are ``<= budget``."""
        lengths = self._draw_lengths(budget + 1, g)
        start, stop = token_slices(row_tokens(lengths.numpy()), budget)[0]
        return lengths[start:stop]

    def _grouped_lengths(self, budget: int, split: int, index: int) -> torch.Tensor:
        """``group_by_length``: the lengths of batch ``index``, one padded cut of its pool's rows sorted by length."""
        pool, slot = divmod(index, POOL_BATCHES)  # the seed below hashes ints only: a str's hash differs per process
        g = torch.Generator().manual_seed(hash((self.config.seed, 15_485_863, split, pool)) & 0x7FFF_FFFF_FFFF_FFFF)
        lengths = self._draw_lengths(POOL_BATCHES * budget, g).sort().values
        cuts = padded_slices(row_tokens(lengths.numpy()), budget)  # at least POOL_BATCHES of them
        start, stop = cuts[int(torch.randperm(len(cuts), generator=g)[slot])]
        return lengths[start:stop]

    def _draw_lengths(self, tokens: int, g: torch.Generator) -> torch.Tensor:
        """History lengths drawn from ``g``: the fewest rows that cost at least ``tokens``."""
        chunk = max(16, int(2 * tokens / self.config.expected_row_tokens()))
        drawn: list[torch.Tensor] = []
        total = 0
        while total < tokens:  # almost always once: a chunk holds ~2x the tokens asked for
            lengths = torch.multinomial(self._world.length_probs, chunk, replacement=True, generator=g)
            drawn.append(lengths)
            total += int(lengths.sum()) + chunk
        lengths = torch.cat(drawn)
        enough = int(torch.searchsorted(torch.cumsum(lengths + 1, 0), tokens)) + 1
        return lengths[:enough]

    def assemble(self, rows: HistoryRows) -> Batch:
        """The rows as a TorchRec batch: one ``KeyedJaggedTensor`` with the candidate's ids (one per row), the jagged
        histories and (with ``timestamps``) their event times, in :attr:`FeatureSpec.kjt_keys` order."""
        n = rows.user.shape[0]
        one = torch.ones(n, dtype=torch.int32)
        lengths = rows.lengths.int()
        values = [rows.user, rows.item, rows.category, rows.hist_items, rows.hist_categories]
        parts = [one, one, one, lengths, lengths]
        if self.config.timestamps:
            values.append(rows.hist_ts)
            parts.append(lengths)
        kjt = batch_kjt(self.features.kjt_keys, torch.cat(values), torch.cat(parts))
        return Batch(dense_features=rows.dense, sparse_features=kjt, labels=rows.labels)
