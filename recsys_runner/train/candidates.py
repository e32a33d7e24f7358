"""Which catalogue items a two-tower model ranks: the one definition the full-corpus eval
(:class:`~recsys_runner.train.corpus.CorpusEval`), ``predict``'s top-k (``scoring_topk.py``) and the exported item
index share, so that the eval's recall@k describes the list predict serves.

An id past the id mapping's values (``data sequences`` rows) is one of the table's OOV rows, which stands for no one
raw item: it is left out, and how many are, and why, is one log line per process.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from recsys_runner.data.base import DataModule
from recsys_runner.data.catalogue.items import ItemTable
from recsys_runner.data.files.tabular_config import ParquetDataConfig
from recsys_runner.data.sequences.mapping import CandidateItems, candidate_items

log = logging.getLogger(__name__)

__all__ = ["Candidates", "catalogue_candidates", "check_eval_items", "eval_mapped_files"]


def eval_mapped_files(data: DataModule) -> list[str]:
    """The eval split's Parquet files, whose metadata may name an id mapping (``data sequences`` rows): what
    :func:`~recsys_runner.data.sequences.mapping.candidate_items` reads for the eval, as predict reads its input's
    (``scoring.top_k_files``). None for other formats (no mapping to name) and for generated data."""
    split = data.split_files().get("eval")
    if split is None or not isinstance(getattr(data, "config", None), ParquetDataConfig):
        return []
    return list(split.files)


@dataclass(frozen=True)
class Candidates:
    """The catalogue items a two-tower model ranks (:func:`catalogue_candidates`)."""

    table: ItemTable
    """The rankable items, in catalogue order."""
    rows: np.ndarray | None
    """Their rows in the whole catalogue; ``None``: every item is rankable."""
    mapping: CandidateItems
    """The id mapping the rows name (its item count), or the whole id table without one."""


def catalogue_candidates(table: ItemTable, data: DataModule, files: list[str], say: bool = True) -> Candidates:
    """The items of the catalogue ``table`` that a two-tower model ranks for rows read from the Parquet ``files``: the
    ids :func:`~recsys_runner.data.sequences.mapping.candidate_items` allows (the id mapping's values; the whole id
    table for files without a mapping). The one definition both the full-corpus eval (:class:`CorpusEval`) and
    ``predict``'s top-k (``scoring_topk.py``) rank, so that the eval's recall@k describes the list predict serves.

    Why items are left out: an id past the mapping's values is one of the table's OOV rows (an unknown raw id's, a
    hash bucket), which has no raw id for predict to write and stands for no one item. How many are left out, and why,
    is one log line (when ``say``), once per process: predict builds the eval's candidates and its own, alike.

    Raises:
        ConfigError: the files name different mappings, or the mapping does not fit the item id's table
            (:func:`~recsys_runner.data.sequences.mapping.candidate_items`).
    """
    column = {f.name: f for f in data.features.sparse}[table.id_feature]
    mapping = candidate_items(files, column.table_name, column.num_embeddings)
    rankable = np.asarray(table.ids, dtype=np.int64) < mapping.count
    if rankable.all():
        return Candidates(table, None, mapping)
    rows = np.flatnonzero(rankable)
    where = getattr(getattr(getattr(data, "config", None), "items", None), "path", None)
    if say and (said := (where, len(table), len(rows), mapping.folder)) not in _SAID:
        _SAID.add(said)
        log.warning("%d of %d catalogue items%s are not rankable, neither by the full-corpus eval nor by predict: their %s ids "
                    "(%s) are past the %d item ids of the id mapping in %s, its OOV rows, which stand for no one raw item (an "
                    "eval row whose item is one of them counts as a miss). Fix: leave them out of the items file, or encode "
                    "the catalogue with that mapping", len(table) - len(rows), len(table),
                    f" ({where}, data.items.path)" if where else "", table.id_feature,
                    _some(np.asarray(table.ids)[~rankable]), mapping.count, mapping.folder)
    return Candidates(table.take(rows), rows, mapping)


def check_eval_items(candidates: Candidates, data: DataModule, say: bool = True) -> None:
    """The eval rows' items checked against ``candidates``, the items the full-corpus eval ranks (file data with
    ``data.items``: its ``eval_items_past``, one pass over the eval rows; generated data make their rows from their
    catalogue): an item the catalogue lacks stops the run, and the eval rows whose item is one of the id mapping's OOV rows
    (no catalogue item can be one) are counted in one warning (when ``say``), since each counts as a miss.

    Raises:
        DataError: an eval row's item has a rankable id, and the catalogue lacks it.
    """
    past_of = getattr(data, "eval_items_past", None)
    if past_of is None:
        return
    past = int(past_of(candidates.table, candidates.mapping.count))
    if past and say:
        log.warning("%d eval rows' items (%s) are past the %d item ids of the id mapping in %s: its OOV rows, items unknown when "
                    "the rows were written, which no catalogue item can be. The full-corpus metrics count each of these rows as a "
                    "miss (the share of them bounds recall@k from above). Fix: nothing, if cold items are meant to count; else "
                    "encode the eval rows with a mapping that knows their items", past, candidates.table.id_feature,
                    candidates.mapping.count, candidates.mapping.folder)


_SAID: set[tuple[str | None, int, int, str | None]] = set()
"""The (items file, catalogue size, candidates, mapping folder) whose unrankable items were logged in this process."""


def _some(ids: np.ndarray, shown: int = 5) -> str:
    """The first ``shown`` of ``ids``, and how many more."""
    text = ", ".join(str(int(i)) for i in ids[:shown])
    return text + (f", … {len(ids) - shown} more" if len(ids) > shown else "")
