"""Negative downsampling of the training rows (``data.negative_rate``) and the rate a checkpoint was trained with.

Production CTR training keeps every positive and a fraction ``r`` of the negatives (He et al., *Practical Lessons from
Predicting Clicks on Ads at Facebook*, 2014): the model then learns ``p`` on rows whose negatives were thinned, and the
probability on all rows is ``q = p / (p + (1 - p) / r)``, i.e. ``logit(q) = logit(p) + log(r)``
(:func:`~recsys_runner.tasks.logit_shift`).

Which negatives are kept is a hash of (``data.seed``, the row's file and row number), as the hash eval split decides its
rows (:func:`~recsys_runner.data.files.splits.eval_mask`): the same rows with one rank or eight, any
``data.num_workers``, any shuffle, and a resumed epoch drops exactly the rows it dropped before. The rate is written into
every checkpoint (:data:`SAMPLING_FILE`), so that evaluate, predict and export correct the model's outputs by it without
being told (:func:`trained_rate`), and a command that says otherwise is refused.
"""

from __future__ import annotations

import json
import logging
import math
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from recsys_runner import stores, uris
from recsys_runner.data.encoding.keys import splitmix64
from recsys_runner.data.files.splits import split_key
from recsys_runner.errors import CheckpointError, ConfigError

log = logging.getLogger(__name__)

SAMPLING_FILE = "sampling.json"
"""The checkpoint file that records ``data.negative_rate`` (``{"negative_rate": r}``); absent: every row was trained."""
_SALT = b"negative_rate"
"""Mixed into the file's key so that the rows kept do not follow the rows the hash eval split holds out."""


def negative_rate(config: Any) -> float | None:
    """``data.negative_rate`` of a data config (file data); ``None`` for data without the key (generated data, which draws
    its rows and downsamples none)."""
    rate = getattr(config, "negative_rate", None)
    return None if rate is None else float(rate)


def start_line(rate: float) -> str:
    """What a training run says of ``data.negative_rate`` once at start-up."""
    return (f"data.negative_rate={rate:g}: training keeps every positive and {100 * rate:.4g}% of the negatives (by a hash of data.seed, "
            f"file and row; eval rows all kept), counted as data/negatives_downsampled; the eval, evaluate, predict and export score "
            f"logit + log({rate:g}) = logit {math.log(rate):+.4f}, the probability on all rows (train metrics: the downsampled rows)")


def kept_rows(path: str, file_rows: np.ndarray, labels: np.ndarray, seed: int, rate: float) -> np.ndarray:
    """Which rows of a block of training rows are trained on: every positive (``labels > 0``), and the negatives whose
    hash of (``seed``, :func:`~recsys_runner.data.files.splits.split_key` of ``path``, row number in the file) falls below
    ``rate``. ``file_rows``: each row's 0-based row number in its file (the block's rows, after any bad row was dropped)."""
    file_id = np.uint64(zlib.crc32(_SALT + b"/" + str(seed).encode() + b"/" + split_key(path).encode()))
    h = splitmix64(file_rows.astype(np.uint64) ^ (file_id << np.uint64(32)))
    kept_negative = (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53)) < rate
    return (labels.reshape(labels.shape[0], -1)[:, 0] > 0) | kept_negative


def document(rate: float) -> bytes:
    """What :data:`SAMPLING_FILE` holds for a run trained with ``data.negative_rate=rate``."""
    return (json.dumps({"negative_rate": rate}) + "\n").encode()


def stored_rate(checkpoint: Path) -> float | None:
    """The ``data.negative_rate`` checkpoint ``checkpoint`` was trained with; ``None``: every row (no :data:`SAMPLING_FILE`,
    as in every checkpoint written before the setting existed)."""
    try:
        text = stores.read_bytes(uris.join(str(checkpoint), SAMPLING_FILE), CheckpointError)
    except FileNotFoundError:
        return None
    rate = json.loads(text).get("negative_rate")
    return None if rate is None else float(rate)


def trained_rate(checkpoint: Path, configured: float | None) -> float | None:
    """The rate a command that scores checkpoint ``checkpoint`` (evaluate, predict, export) corrects its outputs by: the
    checkpoint's own (:func:`stored_rate`), which the command's ``data.negative_rate`` (``configured``: carried from the
    training's overrides, or given) may repeat but not change.

    Raises:
        ConfigError: ``configured`` is set and differs from the rate the checkpoint was trained with: its outputs would
            be corrected by a rate its training never used.
    """
    stored = stored_rate(checkpoint)
    if configured is not None and configured != stored:
        trained = f"data.negative_rate={stored}" if stored is not None else "every negative (no data.negative_rate)"
        raise ConfigError(f"data.negative_rate={configured}, but checkpoint {checkpoint} was trained with {trained}: its outputs are "
                          f"corrected by the rate its training kept negatives at, which the checkpoint records. Fix: drop "
                          f"data.negative_rate from this command (the checkpoint's is used)")
    if stored is not None:
        log.info("checkpoint %s was trained with data.negative_rate=%g: its outputs are scored as logit + log(%g), the probability "
                 "on all rows", checkpoint, stored, stored)
    return stored
