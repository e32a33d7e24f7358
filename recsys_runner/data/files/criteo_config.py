"""The configs of the Criteo data options (``data=criteo``: the raw TSV layout; ``data=criteo_npy``: TorchRec's
preprocessed ``.npy`` days) and the Criteo layout itself (its columns, their names and preprocessing), on the common file
data config of :mod:`recsys_runner.data.files.tabular_config`.

Each config's ``_target_`` names its reader in :mod:`recsys_runner.data.files.tabular`; docs/data.md has the full reference.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from recsys_runner.data.files.tabular_config import TabularDataConfig
from recsys_runner.data.schema import DENSE_TRANSFORMS, DenseColumn, Schema, SparseColumn
from recsys_runner.errors import require

CRITEO_NUM_DENSE, CRITEO_NUM_SPARSE = 13, 26
CRITEO_COLUMNS = ["label", *(f"int_{i}" for i in range(CRITEO_NUM_DENSE)), *(f"cat_{i}" for i in range(CRITEO_NUM_SPARSE))]
CRITEO_MISSING_TEXTS = [""]
"""Criteo's missing value: an empty field (a count or a categorical the log did not record)."""


@dataclass(kw_only=True)
class CriteoDataConfig(TabularDataConfig):
    """Schema of ``conf/data/criteo.yaml``: the raw Kaggle/Terabyte Criteo layout.

    Tab-separated, no header: label, 13 integer counts (``int_0…``, may be empty or negative), 26
    categoricals (``cat_0…``) as 8 hex digits (may be empty). Preprocessing: dense missing → 0,
    negatives clamped to 0, ``log1p``; categoricals hex → integer, then modulo (or hashed into)
    the table size; a missing categorical is an empty bag (a zero vector).
    """

    _target_: str = "recsys_runner.data.files.tabular.CriteoData"
    num_embeddings: int | None = None
    """Table size of every categorical column; ``null`` (the default): each column sized from a sample of the files
    (logged): a vocabulary of its values plus ``data.infer.oov_buckets`` rows when the sample covers the column, else
    its distinct values × ``data.infer.bucket_margin``, rounded up, and ``categorical_encoding``."""
    num_embeddings_per_feature: list[int] | None = None
    """Per-column table sizes (26 entries); overrides ``num_embeddings``."""
    categorical_encoding: str = "mod"
    """``mod``: hex value modulo the table size (TorchRec's Criteo preprocessing); ``hash``: hash the hex string. With
    tables sized from the data, for the columns that get no vocabulary."""
    dense_transform: str = "log1p"
    """``log1p`` (clamp negatives to 0, then log(1+x)) or ``none``."""
    block_rows: int = 65_536
    """Lines per unit of work."""

    def missing_texts(self) -> list[str]:
        return list(CRITEO_MISSING_TEXTS)

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.num_embeddings is None or self.num_embeddings > 0, f"data.num_embeddings must be positive or null, got {self.num_embeddings}")
        if self.num_embeddings_per_feature is not None:
            require(len(self.num_embeddings_per_feature) == CRITEO_NUM_SPARSE,
                    f"data.num_embeddings_per_feature has {len(self.num_embeddings_per_feature)} entries; Criteo has {CRITEO_NUM_SPARSE} categoricals")
            require(all(n > 0 for n in self.num_embeddings_per_feature), "data.num_embeddings_per_feature entries must be positive")
        require(self.categorical_encoding in ("mod", "hash"), f"data.categorical_encoding={self.categorical_encoding!r} must be mod or hash")
        require(self.dense_transform in DENSE_TRANSFORMS, f"data.dense_transform={self.dense_transform!r} must be one of {DENSE_TRANSFORMS}")
        require(self.block_rows > 0, f"data.block_rows must be positive, got {self.block_rows}")


def criteo_columns(num_embeddings: list[int | None], categorical_encoding: str = "mod",
                   dense_transform: str = "log1p", hex_ids: bool = True) -> tuple[list[DenseColumn], list[SparseColumn]]:
    """The Criteo dense and sparse columns with the usual preprocessing (a ``None`` size: sized from the data, a
    vocabulary or ``categorical_encoding``, :mod:`recsys_runner.data.encoding.fit`); ``hex_ids`` false: the ids are
    integers already (TorchRec's ``.npy`` files), not the TSV's hex text."""
    hexed = categorical_encoding == "mod" and hex_ids
    return ([DenseColumn(name=f"int_{i}", transform=dense_transform) for i in range(CRITEO_NUM_DENSE)],
            [SparseColumn(name=f"cat_{i}", num_embeddings=n, encoding=categorical_encoding if n is not None else None, hex=hexed)
             for i, n in enumerate(num_embeddings)])


def criteo_schema(num_embeddings: list[int], categorical_encoding: str = "mod", dense_transform: str = "log1p") -> Schema:
    """The Criteo columns with the usual preprocessing (see :class:`CriteoDataConfig`)."""
    dense, sparse = criteo_columns(list(num_embeddings), categorical_encoding, dense_transform)
    return Schema(label="label", dense=dense, sparse=sparse)


LAST_DAY_MODES = ("train", "holdout")
"""``data.last_day`` of ``data=criteo_npy`` (:class:`CriteoNpyDataConfig`)."""
LAST_DAY_HALVES = ("val", "test")
"""``data.last_day_half``: TorchRec's stages, the first and the second half of the held-out last day."""


@dataclass(kw_only=True)
class CriteoNpyDataConfig(CriteoDataConfig):
    """Schema of ``conf/data/criteo_npy.yaml``: Criteo as TorchRec's DLRM example preprocesses it
    (:mod:`recsys_runner.data.files.npy_source`): ``data.path`` a folder of ``day_{i}_{dense,sparse,labels}.npy``.

    The dense values are already log-transformed (``dense_transform: none``: a second log would change them); the ids
    are integers, taken modulo the table size as TorchRec's ``InMemoryBinaryCriteoIterDataPipe`` takes them with its
    ``hashes`` (``num_embeddings_per_feature``, else ``num_embeddings`` for all 26, ``100000`` as in ``dlrm_main.py``).
    """

    _target_: str = "recsys_runner.data.files.tabular.CriteoNpyData"
    num_embeddings: int | None = 100_000
    """Table size of every categorical column (TorchRec's ``dlrm_main.py --num_embeddings`` default); ``null``: sized from
    a sample of the files, as ``data=criteo``'s."""
    dense_transform: str = "none"
    """``none``: the files' dense values are ``log`` of the counts already (``tsv_to_npys``)."""
    last_day: str = "train"
    """``train``: every day of ``data.path`` is trained on (eval rows from ``eval_path``, else ``eval_fraction``).
    ``holdout``: TorchRec's split (``InMemoryBinaryCriteoIterDataPipe``'s stages, as its DLRM example evaluates): the
    last day of ``data.path`` (its highest day number) is never trained on; its first ``ceil(rows / 2)`` rows (TorchRec's
    ``val``) are the eval during training, the rest (``test``) what ``python -m recsys_runner.evaluate`` scores."""
    last_day_half: str | None = None
    """With ``last_day: holdout``, the half of the last day the eval reads: ``val`` or ``test``; ``null``: ``val`` in
    training, ``test`` in evaluate (``data.last_day_half=val`` there gives the training's own eval again)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.categorical_encoding == "mod", f"data.categorical_encoding={self.categorical_encoding!r}: data=criteo_npy reads "
                "integer ids, taken modulo the table size as TorchRec does. Fix: leave data.categorical_encoding=mod")
        require(self.last_day in LAST_DAY_MODES, f"data.last_day={self.last_day!r} must be one of {', '.join(LAST_DAY_MODES)}")
        require(self.last_day_half in (None, *LAST_DAY_HALVES),
                f"data.last_day_half={self.last_day_half!r} must be one of {', '.join(LAST_DAY_HALVES)} or null")
        if self.last_day == "holdout":
            setting = "data.eval_path" if self.eval_path is not None else "data.eval_fraction" if self.eval_fraction is not None else None
            require(setting is None, f"data.last_day=holdout evaluates on halves of the last day of data.path, but {setting} is set "
                    f"too; eval rows come from one of them. Fix: {setting}=null, or data.last_day=train")
        else:
            require(self.last_day_half is None, f"data.last_day_half={self.last_day_half} chooses a half of the held-out last day, "
                    f"but data.last_day={self.last_day} holds no day out. Fix: data.last_day=holdout, or data.last_day_half=null")

    def for_evaluate(self) -> CriteoNpyDataConfig:
        """With ``last_day: holdout`` and no half chosen, the ``test`` half: what ``evaluate`` scores, as TorchRec's test stage."""
        return replace(self, last_day_half="test") if self.last_day == "holdout" and self.last_day_half is None else self
