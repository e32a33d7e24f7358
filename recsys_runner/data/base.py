"""The contract between data modules and the runner, and what every data module shares."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch
import torch.distributed as dist
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner.configurable import Configurable
from recsys_runner.data.catalogue.items import ItemTable
from recsys_runner.data.workers import check_worker_start
from recsys_runner.errors import CheckpointError, DataError, require
from recsys_runner.features import DataNeeds, FeatureSpec
from recsys_runner.host_lengths import with_longest_rows

if TYPE_CHECKING:  # the annotation only: the stored encoders are handed in by the builder
    from recsys_runner.data.encoding.stored import StoredEncoders
    from recsys_runner.data.schema import Schema

__all__ = ["AUTO", "batch_kjt", "DataConfig", "DataError", "DataModule", "SplitFiles", "auto_workers", "data_device_type", "in_step", "placeholder",
           "synchronized"]  # DataError lives in errors.py with its siblings; importable from here too

log = logging.getLogger(__name__)
T = TypeVar("T")
D = TypeVar("D", bound="DataConfig")

AUTO = "auto"
"""``data.num_workers: auto``: DataLoader workers when the run's device is CUDA, none on CPU (:func:`auto_workers`)."""
MAX_AUTO_WORKERS = 12
"""The most DataLoader workers per rank that ``num_workers: auto`` starts (the best count measured on an H200's 16 CPUs)."""


@dataclass(frozen=True)
class SplitFiles:
    """The files one split of the data reads, for the run's record of its inputs (:mod:`recsys_runner.tracking.datasets`)."""

    path: str
    """The setting that named them (``data.path``, ``data.eval_path``), as given: a file, a directory, a glob or a URI."""
    files: tuple[str, ...]
    """Every file read, in read order."""
    num_rows: int | None
    """The split's rows, when known before reading (a hash split's share of shared files included)."""
    holdout: float | None = None
    """For a split held out of the training files by a hash of (file name, row number): the eval fraction."""
    split_keys: tuple[str, ...] = ()
    """For such a split: the name each file's rows were keyed by (:func:`~recsys_runner.data.files.splits.split_key`),
    in the order of ``files``: what decides which rows it holds out, beside ``holdout``."""


class DataModule(Protocol):
    """Yields a rank's share of the training and evaluation data as TorchRec batches.

    Every rank must receive the same number of *training* batches: a sharded forward pass is a collective,
    so a rank that runs out early would leave the others waiting forever. A data module either
    guarantees equal counts or wraps its training iterators in :func:`synchronized`. Eval batches are
    each rank's share of every eval row, whatever their counts: the evaluator keeps the ranks in step
    (:func:`in_step`), so that no eval row is left out to even them.

    A data module subclasses this protocol explicitly, so that it inherits the defaults of
    :meth:`metrics` (no counters), :meth:`explain_empty_epoch` and :meth:`explain_empty_eval` (generic hints) unless it has
    something better to say.
    """

    features: FeatureSpec
    batch_size: int

    def train_batches(self, epoch: int, rank: int, world_size: int) -> Iterable[Batch]:
        """This rank's training batches for ``epoch`` (order may depend on the epoch)."""
        ...

    def eval_batches(self, rank: int, world_size: int) -> Iterable[Batch]:
        """This rank's evaluation batches, identical on every call: over all ranks, every eval row exactly once (ranks
        may hold different numbers of batches)."""
        ...

    def num_train_batches(self, world_size: int) -> int | None:
        """Batches per rank per epoch, or ``None`` when it is not known before reading."""
        ...

    def metrics(self) -> dict[str, float]:
        """Counters since the module was built (e.g. ``data/bad_rows_skipped``), logged with the training
        metrics (summed over ranks); none by default."""
        return {}

    def counters_kept(self) -> contextlib.AbstractContextManager[None]:
        """Within the block, reading batches leaves the counters of :meth:`metrics` as they were: the train loop's sanity
        eval reads a few eval batches before the first step, and their rows must not reach the logged counters. Nothing to
        keep by default (no counters)."""
        return contextlib.nullcontext()

    def encoders_document(self) -> bytes | None:
        """The encoders this data fitted to its files (:mod:`recsys_runner.data.encoding.stored`), stored with every checkpoint;
        ``None`` for data that fits none (generated data: its ids are its rows)."""
        return None

    def split_files(self) -> dict[str, SplitFiles]:
        """Per split (``train``, ``eval``), the files it reads and its rows; ``{}`` for data that reads no files
        (generated data: its record is its generator's config)."""
        return {}

    def raw_rows(self, rows: int) -> Any:
        """The first ``rows`` rows of the files, raw, as the training reader reads them (a ``pyarrow.Table``: text for every
        CSV column) — the served model's input example; ``None`` for data without raw columns (generated data)."""
        return None

    def item_table(self) -> ItemTable | None:
        """The item catalogue (:class:`~recsys_runner.data.catalogue.items.ItemTable`, encoded as this data's rows) that sampled
        negatives are drawn from and full-corpus evaluation scores against; ``None`` when the data has none (the default:
        a retrieval model then sees only the items of its batches)."""
        return None

    def shards_per_rank(self) -> int:
        """How many shards a rank's epoch is cut into, each read on its own, whose number the order of the rank's batches
        depends on (file data: one per DataLoader worker); 1 (the default) where that order does not depend on the
        workers. A checkpoint records it with the world size, so that a resume in the middle of an epoch whose rows are cut
        otherwise is said (:func:`recsys_runner.checkpoint.resume_changes.epoch_cut_change`)."""
        return 1

    def explain_empty_epoch(self, epoch: int, rank: int) -> str:
        """Why the last pass over ``train_batches(epoch, rank, …)`` ended before one full training step (rows
        read, rows skipped) and what to do, for the :class:`DataError` the runner raises then."""
        return "Fix: check the data, or lower data.batch_size / train.grad_accum_steps"

    def check_eval_rows(self) -> None:
        """Before the first training step (the evaluator is built), refuse eval data known to hold no row to evaluate, so that
        a run does not train for hours and then find every eval metric NaN; nothing to check by default (generated data).

        Raises:
            DataError: no eval row is left, naming the eval data and the fix.
        """
        return

    def explain_empty_eval(self, rank: int) -> str:
        """Where the eval rows come from, how many ``rank`` read and skipped in its last pass over ``eval_batches``, and what
        to do: for the :class:`~recsys_runner.errors.DataError` the evaluator raises when no rank had an eval row (its
        metrics would all be NaN)."""
        return "Fix: check the eval data"


@dataclass(kw_only=True)
class DataConfig(Configurable):
    """Base of every data config (``conf/data/*.yaml``): the fields every data option shares, and how the
    config builds its data module (``_target_``, whose constructor takes the config: ``Cls(config)``)."""

    batch_size: int = 512
    """Rows per batch *per rank* (the global batch is ``batch_size × world_size``)."""
    batch_tokens: int | None = None
    """Instead of ``batch_size`` rows, batches of as many rows as fit this many history tokens per rank (a row costs
    its history length + 1, :mod:`recsys_runner.data.sequences.tokens`); only for data with sequences. ``null``: ``batch_size``."""
    group_by_length: bool = True
    """With ``batch_tokens``: batch rows of similar history length together (within a pool of rows: the shuffle buffer, or
    a pool of generated batches), each batch cut so that rows × (its longest history + 1) fits ``batch_tokens``, then the
    batches shuffled. Models pad a batch to its longest history (DIN, BST, SASRec), so this makes a step's memory follow
    the budget and its work the tokens (docs/performance.md, *Sequences*). ``false``: rows in read order, cut when their
    tokens reach the budget (a batch then pads to its longest row)."""
    num_workers: int | str = AUTO
    """DataLoader worker processes per rank that produce the batches off the training thread; 0 produces them
    in the training process. ``auto``: three quarters of the CPUs per local rank, at most 12 (at least 1), when the run's
    device is CUDA; 0 on CPU, where extra processes only compete with the step for the cores (measured: one worker
    delivers fewer rows/s than the training process makes itself, docs/performance.md "The input path on a CPU")."""
    pin_memory: bool | None = None
    """Produce batches in page-locked (pinned) memory, so that their copy to the GPU overlaps the step;
    ``null``: when the run's device is CUDA."""
    worker_start: str = "fork"
    """How the DataLoader workers start (:mod:`recsys_runner.data.workers`), a new round at every pass over a split:
    ``fork`` copies the training process (the cheapest start; where the platform has no fork, its own method);
    ``forkserver`` forks them from a clean server process started before the training process's threads (gloo, MLflow,
    read-ahead, Arrow's pools), for a long-lived process with threads or a large CUDA process; ``spawn`` starts new
    interpreters. The batches are the same, bit for bit, whichever starts them. Nothing starts with ``num_workers: 0``."""

    def __post_init__(self) -> None:
        require(self.batch_size > 0, f"data.batch_size must be positive, got {self.batch_size}. Fix: data.batch_size=512")
        if self.batch_tokens is not None:
            require(self.batch_tokens > 0, f"data.batch_tokens must be positive or null, got {self.batch_tokens}")
            require(self.supports_batch_tokens(), self.no_histories())
        workers = self.num_workers
        require(workers == AUTO or (isinstance(workers, int) and not isinstance(workers, bool) and workers >= 0),
                f"data.num_workers={workers!r} must be a number >= 0 or auto. Fix: data.num_workers=auto (workers on CUDA, "
                f"none on CPU), data.num_workers=0 (in the training process) or e.g. data.num_workers=2")
        check_worker_start(self.worker_start, workers)

    def supports_batch_tokens(self) -> bool:
        """Whether this data has histories whose tokens ``batch_tokens`` can count (data with sequences overrides this)."""
        return False

    def no_histories(self, why: str = "") -> str:
        """The message refusing ``batch_tokens`` for this data, which has no histories (``why``: a clause saying why)."""
        return (f"data.batch_tokens={self.batch_tokens} sizes batches by history tokens, but this data ({type(self).__name__}) "
                f"has no histories{why}. Fix: data.batch_tokens=null and data.batch_size=<rows>, or data with sequences "
                f"(data=synthetic_sequences, or data.sequences on Parquet/CSV files)")

    def build(self, *, device: torch.device | str | None = None, encoders: StoredEncoders | None = None,
              fit_on_head: bool = False, grow: Callable[[Schema], StoredEncoders] | None = None) -> DataModule:
        """The data module this config describes, for a run on ``device`` (``None``: where ``distributed.device=auto``
        puts it): built from :meth:`resolved`, so that the module sees a number of workers and a pinning decision.

        ``encoders``: the encoders a checkpoint stored (evaluate, predict, resume, ``init_from``, export): the files are
        encoded by them, not by encoders fitted again (:mod:`recsys_runner.data.encoding.stored`). ``fit_on_head``: without
        them, file data fits its encoders on the files' first ``data.infer.sample_rows`` rows, not on rows spread over the
        files: a checkpoint written before encoders were stored was fitted so, and fitting it otherwise again would move
        its ids to rows they never trained.

        ``grow`` (``data.vocabulary=extend``, file data only): the files are encoded by the encoders ``grow`` makes of the
        schema a new run would fit on them (the checkpoint's, each vocabulary grown by the fit's: :mod:`recsys_runner.data_build`),
        so that the fit, which only ``grow`` reads, and the module are made once.

        Raises:
            CheckpointError: ``encoders`` for data that takes none (the checkpoint was trained on files).
        """
        if grow is not None:
            assert encoders is None and self.takes_encoders(), "grow makes the encoders of file data"
            grown: DataModule = self.component_class()(self.resolved(device), grow=grow)
            return grown
        if encoders is None:
            head = {"fit_on_head": True} if fit_on_head and self.takes_encoders() else {}
            data: DataModule = self.component_class()(self.resolved(device), **head)
            return data
        if not self.takes_encoders():
            raise CheckpointError(f"the checkpoint {encoders.source} was trained on files (it stores their encoders), but this "
                                  f"run's data is {type(self).__name__}. Fix: the training run's data option (e.g. data=csv "
                                  f"data.path=<files>)")
        with_encoders: DataModule = self.component_class()(self.resolved(device), encoders=encoders)
        return with_encoders

    def takes_encoders(self) -> bool:
        """Whether this data encodes files by fitted encoders (file data overrides this)."""
        return False

    def missing_texts(self) -> list[str]:
        """The field texts this data's reader reads as a missing value: none for data whose values are typed (generated,
        Parquet); text options override it. The exported MLflow model reads a request's fields by them, so a served raw
        row takes the fill and the empty bag where training's reader saw a missing value."""
        return []

    def resolved(self: D, device: torch.device | str | None = None) -> D:
        """This config with ``num_workers: auto`` and ``pin_memory: null`` decided for a run on ``device`` (``None``:
        CUDA when it is available, as ``distributed.device=auto`` decides); ``self`` when both are already set."""
        if self.num_workers != AUTO and self.pin_memory is not None:
            return self
        cuda = data_device_type(device) == "cuda"
        workers = auto_workers() if cuda else 0
        return replace(self, num_workers=workers if self.num_workers == AUTO else self.num_workers,
                       pin_memory=cuda if self.pin_memory is None else self.pin_memory)

    def default_num_steps(self) -> int | None:
        """The run length when neither ``train.num_steps`` nor ``train.num_epochs`` is set: a number of optimizer
        steps, or ``None`` for one epoch (one pass over the data: what "train on my file" means). Data made up
        on the spot, whose epoch is an arbitrary size, names a number of steps instead."""
        return None

    def for_model(self, needs: DataNeeds) -> DataConfig:
        """This config made to serve a model with ``needs``: a new config with the fields the data leaves to
        the model filled in (generated data); ``self`` for data whose labels and columns are fixed (files),
        which the model then checks against its needs."""
        return self

    def for_evaluate(self) -> DataConfig:
        """This config as ``python -m recsys_runner.evaluate`` reads it: ``self``, unless the data keeps rows apart for
        that command (``data=criteo_npy data.last_day=holdout``: the last day's test half, where training evaluates on its
        val half)."""
        return self


def data_device_type(device: torch.device | str | None = None) -> str:
    """``cuda`` or ``cpu``: the type of ``device``, or for ``None`` where ``distributed.device=auto`` runs (CUDA when available)."""
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device).type


def auto_workers(local_world_size: int | None = None) -> int:
    """DataLoader workers per rank for ``num_workers: auto`` on CUDA: three quarters of the CPUs per local rank, at most
    :data:`MAX_AUTO_WORKERS`, at least 1.

    Measured on an H200 with 16 CPUs (docs/performance.md, *The input path on the GPU*): 12 workers fed the runner best or
    near best for Parquet and generated data at batch 4096 and 65536, 8 or fewer starved it at 65536, and 15 (every CPU but
    the training process's) collapsed it (0.11x of in-memory for Parquet at 65536): the training process, DataLoader's pin
    thread and the CUDA driver's threads need cores of their own. ``local_world_size`` defaults to ``LOCAL_WORLD_SIZE``
    (``WORLD_SIZE``, 1), as the process group reads it.
    """
    if local_world_size is None:
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(MAX_AUTO_WORKERS, cpus // max(local_world_size, 1) * 3 // 4))


def synchronized(batches: Iterable[T], on_dropped: Callable[[T], None] | None = None) -> Iterator[T]:
    """Yield from ``batches`` until *any* rank runs out, so that all ranks stop at the same step.

    Before each batch the ranks all-reduce (MIN) a "have one" flag over the default process group;
    when one rank is out, every rank stops. A rank that still had batches drains them into
    ``on_dropped`` (for counting: nothing is dropped silently). Costs one tiny collective per
    batch, so data modules use it only where equal counts are not guaranteed. For training batches; what must see
    every row (evaluation, predict) steps in :func:`in_step` instead.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        yield from batches
        return
    it = iter(batches)
    while True:
        item = next(it, None)
        if not _ranks_agree(item is not None, dist.ReduceOp.MIN):
            break
        assert item is not None
        yield item
    if item is not None and on_dropped is not None:
        on_dropped(item)
        for rest in it:
            on_dropped(rest)


def in_step(items: Iterable[T]) -> Iterator[T | None]:
    """``items``, then ``None`` while another rank still has some: every rank takes the same number of steps, none
    leaves any of its items out.

    Where each step is a sharded forward (a collective), a rank out of items steps with a stand-in (its last batch, or
    :func:`placeholder`) whose outputs count nowhere, until the last rank is done: the evaluator and predict, which must
    see every row (training, where a rank's extra batch may wait for the next epoch, stops at the first rank's end:
    :func:`synchronized`). Before each item the ranks all-reduce (MAX) a "have one" flag over the default process group.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        yield from items
        return
    it = iter(items)
    while True:
        item = next(it, None)
        if not _ranks_agree(item is not None, dist.ReduceOp.MAX):
            return
        yield item


def _ranks_agree(have: bool, op: dist.ReduceOp.RedOpType) -> bool:
    """Every rank's ``have`` reduced by ``op`` (MIN: all have one; MAX: any has one), in one tiny all-reduce over the
    default process group (on the GPU under NCCL, which reduces no CPU tensor)."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    flag = torch.tensor([int(have)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=op)
    return bool(flag.item())


def batch_kjt(keys: list[str], values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None = None) -> KeyedJaggedTensor:
    """A batch's ``KeyedJaggedTensor`` (every key ``len(lengths) // len(keys)`` rows) with its per-key lengths and offsets
    already known, summed here on the host by NumPy on one thread, and each key's longest row and rows' lengths (a
    :class:`~recsys_runner.host_lengths.HostLengthsKJT`), which a model that pads histories sizes its block by
    (``models/sequence.py``), and a model on jagged rows its tile plan (``models/jagged.py``): counted in the step, on
    the GPU, each was a device-to-host sync too.

    Why: TorchRec's sharded modules split a batch by table with ``length_per_key()`` (``KeyedJaggedTensor.split`` and
    ``permute`` in their input distribution). Left unset, it is computed from the lengths where they are when first asked,
    on the GPU inside the step, and read back with ``tolist()``: a device-to-host sync in every step. The in-memory batches
    of the benches carried it (``from_lengths_sync``), file batches did not. ``from_lengths_sync`` computes it with torch's
    intra-op threads, which compete with the DataLoader workers for the cores; NumPy takes one.
    """
    if not keys or lengths.numel() % len(keys) or lengths.device.type != "cpu":
        return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, weights=weights)  # not a batch of equal rows per key
    stride = lengths.numel() // len(keys)
    rows = lengths.numpy().reshape(len(keys), stride)
    per_key = rows.sum(axis=1, dtype="int64").tolist()
    longest = rows.max(axis=1, initial=0).tolist()
    kjt = KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, weights=weights, stride=stride,
                            length_per_key=per_key, offset_per_key=list(itertools.accumulate(per_key, initial=0)))
    return with_longest_rows(kjt, dict(zip(keys, map(int, longest), strict=True)), lengths,
                             values if values.device.type == "cpu" else None)


def placeholder(features: FeatureSpec) -> Batch:
    """A one-row batch (zeros, id 0 in every feature) that a rank with no rows of its own steps with while the others
    score theirs (:func:`in_step`)."""
    labels = torch.zeros(1, len(features.label_names)) if features.multi_label else torch.zeros(1)
    keys = features.kjt_keys
    kjt = KeyedJaggedTensor(keys=keys, values=torch.zeros(len(keys), dtype=torch.int64), lengths=torch.ones(len(keys), dtype=torch.int32),
                            weights=torch.ones(len(keys)) if features.weighted else None)
    return Batch(dense_features=torch.zeros(1, features.num_dense), sparse_features=kjt, labels=labels)
