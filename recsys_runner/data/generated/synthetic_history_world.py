"""The hidden world of ``data=synthetic_sequences``: what each history, candidate and label depends on, drawn once from
the seed (:class:`HistoryWorld`), and the rows it draws (:class:`HistoryRows`).

Items in categories with Zipf popularity, each with a successor in its own category; users who prefer a few categories;
long-tailed history lengths. A row's click is scored from what its history says of the candidate, each later task's from
a world of its own that reads the history too (:class:`HistoryConversion`), and
:class:`~recsys_runner.data.generated.synthetic_labels.TaskLabels` turns the scores into the funnel's labels, as for
``data=synthetic``. :mod:`recsys_runner.data.generated.synthetic_sequences` cuts the rows into batches
(the module docstring there describes the rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from recsys_runner.data.generated.synthetic_labels import TaskLabels

if TYPE_CHECKING:
    from recsys_runner.data.generated.synthetic_sequences import SyntheticSequencesConfig


@dataclass
class HistoryRows:
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
class HistoryWorld:
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
    conversions: list[HistoryConversion]
    """The later tasks' worlds of ``data.tasks`` (none for one label)."""
    task_labels: TaskLabels
    """How the scores become labels: the click, then the funnel (``data=synthetic``'s code)."""

    @staticmethod
    def draw(c: SyntheticSequencesConfig) -> HistoryWorld:
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
        return HistoryWorld(category=category, successor=successor, by_category=torch.cat(by_category), category_size=sizes,
                      category_start=sizes.cumsum(0) - sizes, popularity=popularity,
                      appeal=torch.randn(c.num_items, generator=g) * 0.5,
                      preferred=torch.randint(c.num_categories, (c.num_users, c.interests), generator=g), length_probs=probs,
                      dense_weights=torch.randn(c.num_dense, generator=g) * 0.3, config=c,
                      conversions=[HistoryConversion.draw(c, t) for t in range(1, len(c.tasks or []))], task_labels=c.task_labels())

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

    def rows(self, n: int, negatives: float, g: torch.Generator, lengths: torch.Tensor | None = None) -> HistoryRows:
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
        return HistoryRows(user=users, item=item, category=self.category[item], hist_items=hist_items,
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
class HistoryConversion:
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
    def draw(c: SyntheticSequencesConfig, task: int) -> HistoryConversion:
        """Task ``task``'s (1: the first after the click) world, from a stream of its own: the click's world and rows are
        the same with and without it."""
        g = torch.Generator().manual_seed(hash((c.seed, 7_919, task)) & 0x7FFF_FFFF_FFFF_FFFF)
        return HistoryConversion(weights=1.0 + 2.0 * torch.rand(3, generator=g), appeal=torch.randn(c.num_items, generator=g) * 0.5,
                           dense_weights=torch.randn(c.num_dense, generator=g) * 0.3, bias=c.conversion_bias)

    def score(self, item: torch.Tensor, share: torch.Tensor, follows: torch.Tensor, events: torch.Tensor, mask: torch.Tensor,
              dense: torch.Tensor) -> torch.Tensor:
        """The task's own logit ``[n]`` (each signal centred at 0.5, so ``bias`` sets the base rate)."""
        repeat = ((events == item.unsqueeze(1)) & mask).any(1).float()
        signals = torch.stack([share, follows, repeat], dim=1) - 0.5
        linear = dense @ self.dense_weights if dense.shape[1] else torch.zeros(item.shape[0])
        return self.bias + signals @ self.weights + self.appeal[item] + linear
