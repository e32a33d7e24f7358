"""What each part's rows hold that a model has not trained on: users without a training row, and with ``--vocab`` the
users and items the earlier mapping has not seen (``python -m recsys_runner.data sequences`` says both).

Users are told apart by their raw id (the log's codes), never by the id a row holds: with ``--vocab`` every user the
earlier mapping has not seen reads one of its few OOV rows, so counting ids (or rows) would take many new users for one,
and a new user without a training row for a trained one when another new user's rows share its OOV row. Items are
unseen when their id is an OOV row (past the mapping's values), as the candidate or anywhere in the row's history.
Vectorized: one prefix sum of the unseen items in sorted order gives every row's history count. May import
``numpy`` only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Spans:
    """A part's rows as sorted positions of the log's events: each row's candidate and its history ``[begin, end)``."""

    rows: np.ndarray
    begin: np.ndarray
    end: np.ndarray


@dataclass(frozen=True)
class PartCoverage:
    """One part's rows against the training rows and the earlier mapping (``--vocab``; without it the mapping is the
    log's own, which has seen everything)."""

    rows: int
    untrained_rows: int
    """Rows of users (raw ids) without a row in ``train``: 0 for ``train`` itself."""
    new_users: int
    """Distinct raw user ids of the part that the mapping has not seen (cold-start users)."""
    new_user_rows: int
    """Their rows."""
    unseen_item_rows: int
    """Rows whose candidate or a history event is an item the mapping has not seen (an OOV row)."""
    new_user_unseen_item_rows: int
    """Of :attr:`unseen_item_rows`, those of cold-start users."""

    @property
    def known_item_rows(self) -> int:
        """Rows whose items (candidate and history) the mapping has all seen."""
        return self.rows - self.unseen_item_rows


def part_coverage(user: np.ndarray, new_user: np.ndarray, new_item: np.ndarray, parts: dict[str, Spans]) -> dict[str, PartCoverage]:
    """Per part, :class:`PartCoverage`. ``user`` (raw user codes), ``new_user`` and ``new_item`` (whether the event's user
    / item reads an OOV row) are per sorted event; ``parts`` must hold ``train``."""
    unseen_before = np.concatenate([[0], np.cumsum(new_item, dtype=np.int64)])
    trained = np.unique(user[parts["train"].rows])
    out = {}
    for name, s in parts.items():
        users = user[s.rows]
        untrained = 0 if name == "train" else int((~np.isin(users, trained)).sum())
        cold = new_user[s.rows]
        unseen = new_item[s.rows] | (unseen_before[s.end] - unseen_before[s.begin] > 0)
        out[name] = PartCoverage(len(s.rows), untrained, len(np.unique(users[cold])), int(cold.sum()), int(unseen.sum()),
                                 int((unseen & cold).sum()))
    return out


def vocab_line(folder: str, part: str, c: PartCoverage) -> str:
    """``sequences --vocab``'s line for one part: its cold-start users and rows, and its rows split by their items."""
    return (f"--vocab {folder}, {part} ({c.rows} rows): {c.new_user_rows} rows of {c.new_users} user(s) its mapping has not seen "
            f"(cold-start users, by raw user id); {c.known_item_rows} rows hold only items it has seen, {c.unseen_item_rows} an item "
            f"it has not (the candidate or one in the history: {c.new_user_unseen_item_rows} of them rows of cold-start users)")
