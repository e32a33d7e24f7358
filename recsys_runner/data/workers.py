"""How DataLoader worker processes start (``data.worker_start``), and the one loader that every data module with workers
builds (:func:`worker_loader`): synthetic data and file data alike.

A new round of workers starts at every pass over a split (each epoch, each evaluation), from a training process that by
then runs threads: gloo's, MLflow's, the read-ahead thread of object-store files, Arrow's and OpenMP's pools.

* ``fork`` (the default) copies the training process as it is: the cheapest start, nothing to pickle. A thread of the
  parent does not survive a fork, and a lock it held at that moment stays held in the child; a library that uses such
  a lock in the worker can hang or abort there. One such path is closed here (:class:`WorkerLoader`): garbage of the
  parent (an earlier run's gloo process group in a reference cycle, say) that the child's garbage collector would
  finalize, running a destructor that joins threads the child does not have — measured here: the worker hangs; CI
  saw workers die with ``std::system_error: Invalid argument``. Where the platform has no fork (Windows) the
  platform's own method (spawn) starts them, as before.
* ``forkserver`` forks each worker from a small server process started once, before any of those threads, with the
  modules a worker needs already imported (:func:`worker_context`): a clean process at about fork's cost after the
  first round. The dataset is pickled to each worker, so a worker-side dataset holds plain state only (configs, file
  names, tensors) and opens its files itself. Not persistent workers: each pass is a new dataset for its (split,
  epoch, rank) — the epoch's order, and a resume's skipped batches made again — which a persistent worker, keeping the
  dataset it started with, would not see.
* ``spawn`` starts each worker as a new interpreter that imports everything again: as clean, and the dearest start.

What a worker reads from its process and does not inherit outside ``fork`` travels with the loader (:func:`_in_worker`):
the object-store settings (``storage.*``) and the environment (a store's endpoint and credentials, as the training process
has them now: the forkserver's own is that of its start).
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import sys
from multiprocessing.context import BaseContext

from torch.utils.data import DataLoader, IterableDataset
from torch.utils.data.dataloader import _BaseDataLoaderIter

from recsys_runner import store_settings
from recsys_runner.collection import frozen
from recsys_runner.errors import ConfigError, require

WORKER_STARTS = ("fork", "forkserver", "spawn")
"""The values of ``data.worker_start``: Python's start methods for a DataLoader's worker processes."""

PRELOAD = ("torch", "numpy", "pyarrow", "pyarrow.parquet", "pyarrow.csv", "recsys_runner.data.files.shard_stream",
           "recsys_runner.data.generated.synthetic")
"""Modules the forkserver imports once, so that a worker forked from it starts with them (beside the dataset's own module):
both of this package's worker-side datasets, whichever round starts the server (a process may read files and generate
data, and tests do both).
The server imports them from its own ``sys.path`` (the installed package, ``PYTHONPATH``, the working directory); one it
cannot import is imported by each worker instead. Not ``__main__``: Python 3.11's forkserver does not preload it. A script run as ``python train.py`` is imported again (as
``__mp_main__``) by every worker that forkserver or spawn starts, so its imports and work belong under its
``if __name__ == "__main__"`` guard; ``python -m recsys_runner`` has no script to import."""


def check_worker_start(method: str, num_workers: int | str) -> None:
    """Refuse a ``data.worker_start`` that is not a start method, or one this platform lacks when workers may start
    (``num_workers`` not 0: with none, nothing starts).

    ``fork`` is never refused: where the platform has none, the platform's method starts the workers (module docstring).

    Raises:
        ConfigError: naming the key, the choices and the fix.
    """
    require(method in WORKER_STARTS, f"data.worker_start={method!r} must be one of {list(WORKER_STARTS)}. Fix: data.worker_start=fork "
            f"(the default: the cheapest start), or data.worker_start=forkserver (workers that start clean of the training "
            f"process's threads)")
    available = multiprocessing.get_all_start_methods()
    if num_workers != 0 and method != "fork" and method not in available:
        raise ConfigError(f"data.worker_start={method} is not available on this platform ({sys.platform}: {available}). "
                          f"Fix: data.worker_start={'spawn' if 'spawn' in available else 'fork'}, or data.num_workers=0")


def worker_context(method: str, dataset_module: str) -> BaseContext | None:
    """The multiprocessing context that starts a loader's workers by ``method`` (``None``: the platform's own, for ``fork``
    where there is no fork). For ``forkserver``, the server's preloaded modules: :data:`PRELOAD` and ``dataset_module``
    (the dataset's, which imports what it unpickles into), taken when the server starts (the first round of the process)."""
    if method == "fork" and "fork" not in multiprocessing.get_all_start_methods():
        return None
    context = multiprocessing.get_context(method)
    if method == "forkserver":
        context.set_forkserver_preload(list(dict.fromkeys([*PRELOAD, dataset_module])))
    return context


class WorkerLoader(DataLoader):
    """A DataLoader whose workers never finalize the training process's objects: a round of workers starts inside
    :func:`~recsys_runner.collection.frozen` (which says how, and what it costs), so a forked worker's collector leaves the
    training process's objects alone; that process collects its own garbage, where the threads its destructors join exist.
    """

    def __iter__(self) -> _BaseDataLoaderIter:
        if self.num_workers == 0:
            return super().__iter__()
        with frozen():
            return super().__iter__()


def worker_loader(dataset: IterableDataset, *, num_workers: int, pin_memory: bool, method: str) -> DataLoader:
    """A DataLoader over ``dataset`` (which makes whole batches: ``batch_size=None``) with ``num_workers`` worker processes
    started by ``method`` (``data.worker_start``); with ``pin_memory``, its pin thread pins each batch."""
    context = worker_context(method, type(dataset).__module__)
    forked = context is not None and context.get_start_method() == "fork"
    return WorkerLoader(dataset, batch_size=None, num_workers=num_workers, pin_memory=pin_memory, multiprocessing_context=context,
                        worker_init_fn=None if forked or num_workers == 0 else
                        functools.partial(_in_worker, store_settings.settings(), dict(os.environ)))


def _in_worker(storage: store_settings.StorageConfig, environ: dict[str, str], worker_id: int) -> None:
    """In a worker as it starts: the training process's object-store settings and environment, which a worker that was not
    forked from it lacks (it would reach a bucket through AWS's endpoint, not ``storage.endpoint_url`` or
    ``AWS_ENDPOINT_URL`` set after the forkserver started, and without the credentials). A forked worker has them already
    (it gets no such function)."""
    if dict(os.environ) != environ:
        os.environ.clear()
        os.environ.update(environ)
    if store_settings.settings() != storage:
        store_settings.configure(storage)
