"""Generated user histories whose labels and next items depend on the history: the default data of sequence models.

A hidden world is drawn once from ``seed``: ``num_items`` items, each in one of ``num_categories`` categories,
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
  clicked row whose own score reads the history too (:class:`_Conversion`: the same two signals and whether the
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
from recsys_runner.data.generated.synthetic_items import generated_item_table
from recsys_runner.data.generated.synthetic_labels import SyntheticLabelsConfig, TaskLabels
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
        self._drawn: _World | None = None
        self._catalogue: ItemTable | None = None

    @property
    def _world(self) -> _World:
        """The hidden world, drawn at the first batch: planning (``recsys_runner.plan``, on ``meta``) never draws it."""
        if self._drawn is None:
            self._drawn = _World.draw(self.config)
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

    def assemble(self, rows: _Rows) -> Batch:
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


@dataclass
class _Rows:
    """Generated rows: per-row ids ``[n]``, histories flat (oldest first per row) with ``lengths [n]``."""

    user: torch.Tensor
    item: torch.Tensor
    category: torch.Tensor
    hist_items: torch.Tensor
    hist_categories: torch.Tensor
    hist_ts: torch.Tensor
    lengths: torch.Tensor
    dense: torch.Tensor
    labels: torch.Tensor
    """``[n]``, the click; with ``data.tasks`` ``[n, T]`` (then ``conversion_truth``'s column)."""
    next_item: torch.Tensor
    """The true next item of each row (the candidate on positive rows)."""


@dataclass(frozen=True)
class _World:
    """The hidden ground truth the rows are drawn from."""

    category: torch.Tensor
    """``[num_items]``: each item's category."""
    successor: torch.Tensor
    """``[num_items]``: the item that tends to come next, in the same category."""
    by_category: torch.Tensor
    """Every item, grouped by category, each category's most popular first."""
    category_start: torch.Tensor
    """``[num_categories]``: where each category's items start in ``by_category``."""
    category_size: torch.Tensor
    """``[num_categories]``: how many items each category has."""
    popularity: torch.Tensor
    """``[num_items]`` draw weights (Zipf)."""
    appeal: torch.Tensor
    """``[num_items]``: each item's own effect on the click."""
    preferred: torch.Tensor
    """``[num_users, interests]``: each user's categories."""
    length_probs: torch.Tensor
    """``[max_len + 1]``: the distribution of history lengths."""
    dense_weights: torch.Tensor
    config: SyntheticSequencesConfig
    conversions: list[_Conversion]
    """The later tasks' worlds of ``data.tasks`` (none for one label)."""
    task_labels: TaskLabels
    """How the scores become labels: the click, then the funnel (``data=synthetic``'s code)."""

    @staticmethod
    def draw(c: SyntheticSequencesConfig) -> _World:
        g = torch.Generator().manual_seed(c.seed * 104_729 + 17)
        category = torch.randint(c.num_categories, (c.num_items,), generator=g)
        category[: c.num_categories] = torch.arange(c.num_categories)  # no category is empty
        popularity = 1.0 / torch.arange(1, c.num_items + 1, dtype=torch.float64)[torch.randperm(c.num_items, generator=g)]
        successor = torch.empty(c.num_items, dtype=torch.long)
        by_category = []
        for k in range(c.num_categories):
            members = torch.nonzero(category == k).squeeze(1)
            by_category.append(members[torch.argsort(popularity[members], descending=True)])
            successor[members] = members[torch.randperm(len(members), generator=g)]
        lengths = torch.arange(1, c.max_len + 1, dtype=torch.float64).pow(-c.length_skew)
        probs = torch.cat([torch.tensor([c.empty_fraction], dtype=torch.float64), (1 - c.empty_fraction) * lengths / lengths.sum()])
        sizes = torch.tensor([len(m) for m in by_category])
        return _World(category=category, successor=successor, by_category=torch.cat(by_category), category_size=sizes,
                      category_start=sizes.cumsum(0) - sizes, popularity=popularity,
                      appeal=torch.randn(c.num_items, generator=g) * 0.5,
                      preferred=torch.randint(c.num_categories, (c.num_users, c.interests), generator=g), length_probs=probs,
                      dense_weights=torch.randn(c.num_dense, generator=g) * 0.3, config=c,
                      conversions=[_Conversion.draw(c, t) for t in range(1, len(c.tasks or []))], task_labels=c.task_labels())

    def _fresh(self, users: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        """A fresh pick per user: with 0.8 a popular item of one of the user's categories, else a popular item of any."""
        n = users.shape[0]
        pick = self.preferred[users, torch.randint(self.config.interests, (n,), generator=g)]
        # A popular item of category `pick`: rank ~ Zipf within the category, by inverse CDF of u**3.
        sizes = self.category_size[pick]
        rank = (sizes.double() * torch.rand(n, generator=g, dtype=torch.float64).pow(3)).long().clamp_max(sizes - 1)
        own = self.by_category[self.category_start[pick] + rank]
        anywhere = torch.multinomial(self.popularity, n, replacement=True, generator=g) if n else pick
        return torch.where(torch.rand(n, generator=g) < 0.8, own, anywhere)

    def _step(self, previous: torch.Tensor, users: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        follow = torch.rand(users.shape[0], generator=g) < self.config.follow
        return torch.where(follow, self.successor[previous], self._fresh(users, g))

    def rows(self, n: int, negatives: float, g: torch.Generator, lengths: torch.Tensor | None = None) -> _Rows:
        """``n`` rows drawn from ``g``; with ``lengths`` (a token batch's, drawn first) as many rows as it has lengths."""
        c = self.config
        n = n if lengths is None else lengths.shape[0]
        users = torch.multinomial(torch.ones(c.num_users), n, replacement=True, generator=g)
        if lengths is None:
            lengths = torch.multinomial(self.length_probs, n, replacement=True, generator=g)
        longest = int(lengths.max()) if n else 0
        events = torch.zeros(n, longest + 1, dtype=torch.long)  # events[:, L] is the true next item
        current = self._fresh(users, g)
        for t in range(longest + 1):
            events[:, t] = current
            current = self._step(current, users, g)
        gaps = torch.empty(n, longest + 1).exponential_(generator=g).mul_(3600).long() + 1
        if c.candidates_per_user > 1:  # each group of rows takes its first row's user, history and times
            first = torch.div(torch.arange(n), c.candidates_per_user, rounding_mode="floor") * c.candidates_per_user
            users, lengths, events, gaps = users[first], lengths[first], events[first], gaps[first]
        # Row b's history is events[b, :L_b]; its next item events[b, L_b] (each step follows the one before).
        next_item = events[torch.arange(n), lengths]
        mask = torch.arange(longest + 1).unsqueeze(0) < lengths.unsqueeze(1)
        hist_items = events[mask]
        hist_ts = (1_700_000_000 + gaps.cumsum(1))[mask]
        negative = torch.rand(n, generator=g) < negatives
        item = torch.where(negative, torch.multinomial(self.popularity, n, replacement=True, generator=g) if n else next_item, next_item)
        dense = torch.randn(n, c.num_dense, generator=g)
        share, follows = self._signals(item, events, lengths, mask)
        score = self._score(item, share, follows, dense)
        # the later tasks' scores draw nothing from g: the click below is the same draw with and without them
        own = [conversion.score(item, share, follows, events, mask, dense) for conversion in self.conversions]
        if c.selection_bias:  # the click selects on what makes the row convert (the first conversion's own score)
            score = score + c.selection_bias * own[0]
        labels = torch.bernoulli(torch.sigmoid(score), generator=g)
        if c.tasks is not None:  # the funnel's labels, drawn after every other column: one label's rows are unchanged
            labels = torch.stack(self.task_labels.labels(labels, score, own, g), dim=1)
        return _Rows(user=users, item=item, category=self.category[item], hist_items=hist_items,
                     hist_categories=self.category[hist_items], hist_ts=hist_ts, lengths=lengths, dense=dense,
                     labels=labels, next_item=next_item)

    def _signals(self, item: torch.Tensor, events: torch.Tensor, lengths: torch.Tensor,
                 mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What the history says of the candidate, ``[n]`` each: the share of the history in its category, and whether it
        is the newest event's successor."""
        same = (self.category[events] == self.category[item].unsqueeze(1)) & mask
        share = same.sum(1).float() / lengths.clamp_min(1).float()
        newest = events[torch.arange(item.shape[0]), (lengths - 1).clamp_min(0)]
        follows = ((self.successor[newest] == item) & (lengths > 0)).float()
        return share, follows

    def _score(self, item: torch.Tensor, share: torch.Tensor, follows: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        """The click logit: history share of the candidate's category, the candidate being the newest event's successor,
        the item's appeal and the dense columns."""
        linear = dense @ self.dense_weights if dense.shape[1] else torch.zeros(item.shape[0])
        return -1.5 + 3.0 * share + 2.0 * follows + self.appeal[item] + linear


@dataclass(frozen=True)
class _Conversion:
    """A later task's hidden world: its own score reads the history as the click does (the share of the candidate's
    category, whether it is the newest event's successor) and one thing more, whether the candidate is already in the
    history (a repeat: what a user buys is often what they looked at), each with a weight of its own, and its own item
    appeal and dense weights. So the task is learnable from the history and is not the click again."""

    weights: torch.Tensor
    """``[3]``: the weights of (share, successor, repeat), each in 1-3: every task rises with what the history says of
    the candidate; ``data.conversion_conflict`` makes one that falls with the click."""
    appeal: torch.Tensor
    """``[num_items]``: each item's own effect on this task."""
    dense_weights: torch.Tensor
    bias: float
    """``data.conversion_bias``: the base rate given a click (0: about one in two)."""

    @staticmethod
    def draw(c: SyntheticSequencesConfig, task: int) -> _Conversion:
        """Task ``task``'s (1: the first after the click) world, from a stream of its own: the click's world and rows are
        the same with and without it."""
        g = torch.Generator().manual_seed(hash((c.seed, 7_919, task)) & 0x7FFF_FFFF_FFFF_FFFF)
        return _Conversion(weights=1.0 + 2.0 * torch.rand(3, generator=g), appeal=torch.randn(c.num_items, generator=g) * 0.5,
                           dense_weights=torch.randn(c.num_dense, generator=g) * 0.3, bias=c.conversion_bias)

    def score(self, item: torch.Tensor, share: torch.Tensor, follows: torch.Tensor, events: torch.Tensor, mask: torch.Tensor,
              dense: torch.Tensor) -> torch.Tensor:
        """The task's own logit ``[n]`` (each signal centred at 0.5, so ``bias`` sets the base rate)."""
        repeat = ((events == item.unsqueeze(1)) & mask).any(1).float()
        signals = torch.stack([share, follows, repeat], dim=1) - 0.5
        linear = dense @ self.dense_weights if dense.shape[1] else torch.zeros(item.shape[0])
        return self.bias + signals @ self.weights + self.appeal[item] + linear
