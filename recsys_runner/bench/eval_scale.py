"""Eval metrics at production scale: ``python -m recsys_runner.bench.eval_scale``, 2M eval rows on one CPU host.

What the evaluator does with each eval batch's outputs (:class:`~recsys_runner.metrics.tasks.TaskEvalMetrics`: a
binary task's ``sigmoid`` of float32 logits, its labels, a user id per row for ``gauc``) and then at the eval's end
(``compute``), timed and measured per case, each case in a fresh interpreter so that its peak memory is its own:

* ``auc``, ``gauc``, ``pointwise`` (``logloss``, ``accuracy``, ``ne``, ``calibration``) and ``all`` (the six
  together): ``--rows`` rows in eval batches of ``--batch``, ``gauc`` over ``rows / --rows-per-group`` users, whose
  ids it reads from each batch's 26 one-id sparse features (Criteo-shaped) as the evaluator does;
* ``coverage``: ``coverage@100`` over ``--rows`` queries' top 100 of a ``--items`` catalogue (popular items first, as
  a model retrieves them; the top lists of 16 batches, made before the mark, are fed in turn).

Per case: ``update_s`` (every batch's ``update``, and the group ids' read; not the making of the batch),
``compute_s``, ``state_mb`` (the bytes the metrics' states hold alive before ``compute``: their tensors' storages), ``peak_growth_mb`` (the process's peak RSS over updates and compute, ``VmHWM`` after
``/proc/self/clear_refs`` reset the mark, minus the RSS before, with ``MALLOC_MMAP_THRESHOLD_`` fixed at 32 MB as in
:mod:`recsys_runner.bench.corpus`) and the values. The inputs exist before the mark. ``--threads`` sets torch's threads
(on a shared machine 1 gives steadier figures). Results go to ``bench_results/eval_scale.json`` (``--json``);
docs/performance.md, "At scale", quotes them. ``--in-process`` measures every case in this process instead (the peak
is then the largest so far: what a test affords).

``--ranks N``: each case on ``N`` processes at once, a gloo group on loopback, rank ``r`` holding the ``r``-th of ``N``
contiguous shares of the rows (as the evaluator's ranks each hold theirs); the row reports the largest rank's figures
(``peak_growth_mb``, the seconds) and each rank's peak (``peak_growth_mb_ranks``) — what decides whether a node runs out.
``--gather`` sends every metric through the state gather (every rank's rows copied onto every rank, then computed on
the union), as AUC and grouped AUC did before :mod:`recsys_runner.metrics.sharded` routed their rows: the comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner.bench import write_results
from recsys_runner.metrics.corpus import CoverageAtK
from recsys_runner.metrics.registry import MetricsConfig
from recsys_runner.metrics.retrieval import Ranked
from recsys_runner.metrics.state import Metric
from recsys_runner.metrics.tasks import TaskEvalMetrics, grouping_ids
from recsys_runner.tasks import BinaryTask

CASES = {"auc": ["auc"], "gauc": ["gauc"], "pointwise": ["logloss", "accuracy", "ne", "calibration"],
         "all": ["auc", "logloss", "gauc", "ne", "calibration", "accuracy"], "coverage": ["coverage@100"]}
"""Each case's eval metrics (``metrics.eval``)."""
DEFAULTS = {"rows": 2_000_000, "batch": 4096, "rows_per_group": 20, "items": 100_000, "threads": 0, "ranks": 1}
"""Eval rows (queries for ``coverage``; all ranks' together), rows per eval batch, rows per ``gauc`` user, catalogue
items, torch threads (0: torch's default), ranks (processes of one gloo group, each with its share of the rows)."""
GROUP_KEY = "user"
"""The sparse feature ``gauc`` groups by (``metrics.grouping_key``)."""
TOP_K, TOP_BATCHES = 100, 16
"""``coverage@100``'s top lists: ``k``, and how many distinct batches of them are made and fed in turn."""


def _status(key: str) -> int:
    """``/proc/self/status``'s ``key`` in kB (``VmRSS``, ``VmHWM``)."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(key + ":"))
    return int(line.split()[1])


def _state_bytes(metrics: list[Metric]) -> int:
    """The bytes the states of ``metrics`` hold alive: the storages of their tensors, each counted once (a state that is a
    view of a larger tensor holds all of it)."""
    storages: dict[int, int] = {}
    for metric in metrics:
        for name in metric._defaults:
            value = getattr(metric, name)
            for t in value if isinstance(value, list) else [value]:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def eval_rows(rows: int, rows_per_group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``rows`` float32 logits, their 0/1 labels (drawn with the logit's probability: an AUC near 0.74) and user ids."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, generator=g)
    labels = (torch.rand(rows, generator=g) < torch.sigmoid(logits)).float()
    return logits, labels, torch.randint(0, max(rows // rows_per_group, 1), (rows,), generator=g)


def measure(case: str, rows: int, batch: int, rows_per_group: int, items: int, threads: int, ranks: int = 1,
            gather: bool = False) -> dict[str, Any]:
    """One case: the seconds of the updates and of ``compute``, the states' bytes, the peak RSS growth, the values.
    With ``ranks`` above 1, this process is one rank of a gloo group whose address ``torchrun``'s variables give
    (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``: :func:`bench_eval_scale` sets them), and measures
    its share of the rows; ``gather``: every metric through the state gather (:func:`_gathering`)."""
    if threads:
        torch.set_num_threads(threads)
    if ranks > 1:
        dist.init_process_group("gloo", timeout=timedelta(minutes=10))
    rank = dist.get_rank() if ranks > 1 else 0
    share = slice(rank * rows // ranks, (rank + 1) * rows // ranks)
    try:
        update, compute, owners = (_coverage(share.stop - share.start, batch, items) if case == "coverage"
                                   else _eval_metrics(case, rows, batch, rows_per_group, share))
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak RSS mark starts again here
        before = _status("VmRSS")
        updating = sum(update(at) for at in range(0, share.stop - share.start, batch))
        state = _state_bytes(owners)
        start = time.perf_counter()
        with _gathering(gather, owners):
            values = compute()
        computing = time.perf_counter() - start
    finally:
        if ranks > 1:
            dist.destroy_process_group()
    return {"case": case, "metrics": CASES[case], "rows": rows, "update_s": round(updating, 2),
            "compute_s": round(computing, 2), "state_mb": round(state / 2**20, 1), "state_bytes": state,
            "peak_growth_mb": round((_status("VmHWM") - before) / 1024, 1), "threads": torch.get_num_threads(),
            "ranks": ranks, "gather": gather, "values": {k: round(v, 6) for k, v in values.items()}}


@contextmanager
def _gathering(gather: bool, metrics: list[Metric]) -> Iterator[None]:
    """Within, when ``gather``: none of ``metrics`` computes over ranks its own way (their
    :meth:`Metric._compute_sharded` answers ``None``), so AUC and grouped AUC gather every rank's rows as they did before
    routing them — the bench's "before"."""
    if gather:
        for metric in metrics:
            vars(metric)["_compute_sharded"] = lambda: None  # shadows the class's method on this instance only
    try:
        yield
    finally:
        for metric in metrics:
            vars(metric).pop("_compute_sharded", None)


Case = tuple[Callable[[int], float], Callable[[], dict[str, float]], list[Metric]]
"""A case's ``update(first row)`` of one batch (the seconds its metric work took), its ``compute()`` and the metrics
whose states it fills."""


def _eval_metrics(case: str, rows: int, batch: int, rows_per_group: int, share: slice | None = None) -> Case:
    """The evaluator's metrics of a binary task (:class:`TaskEvalMetrics`) over :func:`eval_rows` (this rank's ``share``
    of them); ``gauc``'s group ids read from each batch's sparse features as the evaluator reads them
    (:func:`grouping_ids`)."""
    names = CASES[case]
    spec = MetricsConfig(eval=names, train=[], grouping_key=GROUP_KEY if "gauc" in names else None)
    metrics = TaskEvalMetrics(spec, (BinaryTask(),), torch.device("cpu"))
    logits, labels, groups = (t[share].clone() for t in eval_rows(rows, rows_per_group))

    def update(at: int) -> float:
        sparse = sparse_batch(groups[at:at + batch]) if "gauc" in names else None  # the data's batch: not timed
        start = time.perf_counter()
        extra = {"groups": grouping_ids(sparse, GROUP_KEY)} if sparse is not None else {}
        metrics.update(logits[at:at + batch], labels[at:at + batch], **extra)
        return time.perf_counter() - start

    def compute() -> dict[str, float]:
        return {key.removeprefix("eval/"): value for key, value in metrics.compute().items()}

    return update, compute, [m for collection in metrics.collections for m in collection.values()]


def sparse_batch(users: torch.Tensor, features: int = 26) -> KeyedJaggedTensor:
    """A Criteo-shaped batch's sparse features: ``features`` one-id features, the first :data:`GROUP_KEY` (``users``)."""
    others = torch.randint(0, 1000, ((features - 1) * users.numel(),))
    return KeyedJaggedTensor.from_lengths_sync(keys=[GROUP_KEY, *(f"c{i}" for i in range(1, features))],
                                               values=torch.cat([users, others]),
                                               lengths=torch.ones(features * users.numel(), dtype=torch.int32))


def _coverage(rows: int, batch: int, items: int) -> Case:
    """``coverage@100`` fed :data:`TOP_BATCHES` batches of skewed top lists in turn."""
    g = torch.Generator().manual_seed(0)
    tops = [(torch.rand(min(batch, rows), TOP_K, generator=g) ** 3 * items).long() for _ in range(TOP_BATCHES)]
    metric = CoverageAtK(TOP_K)

    def update(at: int) -> float:
        start = time.perf_counter()
        metric.update(Ranked(torch.zeros(0), tops[at // batch % TOP_BATCHES][:rows - at], items))
        return time.perf_counter() - start

    return update, lambda: {"coverage@100": float(metric.compute())}, [metric]


def bench_eval_scale(settings: dict[str, int], cases: list[str], in_process: bool = False,
                     gather: bool = False) -> list[dict[str, Any]]:
    """:func:`measure` for each case, each in a fresh interpreter (its own peak memory; with ``ranks``, one per rank,
    started together) unless ``in_process``."""
    if in_process:
        return [measure(case, **settings, gather=gather) for case in cases]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(32 << 20)}
    args = [f"--{key.replace('_', '-')}={value}" for key, value in settings.items()] + (["--gather"] if gather else [])
    rows = []
    for case in cases:
        command = [sys.executable, "-m", "recsys_runner.bench.eval_scale", "--one", case, *args]
        ranks = settings.get("ranks", 1)
        if ranks == 1:
            out = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            continue
        group = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": str(ranks)}
        procs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env={**env, **group, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(ranks)]
        outs = [p.communicate() for p in procs]
        for p, (_, err) in zip(procs, outs, strict=True):
            if p.returncode:
                raise subprocess.CalledProcessError(p.returncode, command, stderr=err)
        rows.append(_largest_rank([json.loads(out.strip().splitlines()[-1]) for out, _ in outs]))
    return rows


def _largest_rank(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """The ranks' rows as one: the largest rank's seconds, states and peak (each rank's peak kept as well); the values
    are every rank's alike (a collective ``compute``), rank 0's reported."""
    row = dict(per_rank[0])
    for key in ("update_s", "compute_s", "state_mb", "state_bytes", "peak_growth_mb"):
        row[key] = max(r[key] for r in per_rank)
    row["peak_growth_mb_ranks"] = [r["peak_growth_mb"] for r in per_rank]
    return row


def _free_port() -> int:
    """A TCP port free on loopback now, for the ranks' rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def table(rows: list[dict[str, Any]]) -> str:
    """The cases as a markdown table."""
    head = ("| case | metrics | rows | ranks | update s | compute s | states MB | peak RSS growth MB | threads | values |\n"
            "|---|---|---|---|---|---|---|---|---|---|")
    lines = [f"| {r['case']} | {', '.join(r['metrics'])} | {r['rows']:,} | {_ranks(r)} | {r['update_s']} | {r['compute_s']} | "
             f"{r['state_mb']} | {r['peak_growth_mb']} | {r['threads']} | {', '.join(f'{k}={v}' for k, v in r['values'].items())} |"
             for r in rows]
    return "\n".join([head, *lines])


def _ranks(row: dict[str, Any]) -> str:
    """A row's ranks for the table: their number, ``gathered`` when ``--gather`` sent the metrics through the gather."""
    return f"{row['ranks']}{' gathered' if row['gather'] else ''}"


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(prog="python -m recsys_runner.bench.eval_scale", description=__doc__.split("\n")[0])
    parser.add_argument("--one", choices=list(CASES), default=None, help="measure this case here and print its JSON row")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated cases (default all: {','.join(CASES)})")
    for key, value in DEFAULTS.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, default=value)
    parser.add_argument("--in-process", action="store_true", help="every case in this process (no fresh interpreter each)")
    parser.add_argument("--gather", action="store_true",
                        help="every metric through the state gather (every rank's rows on every rank): the comparison")
    parser.add_argument("--json", default="bench_results/eval_scale.json", help="where to write the results")
    args = parser.parse_args(argv)
    settings = {key: getattr(args, key) for key in DEFAULTS}
    if args.in_process and args.ranks > 1:
        parser.error(f"--in-process measures in this one process; --ranks {args.ranks} needs a process per rank")
    if args.one is not None:
        row = measure(args.one, **settings, gather=args.gather)
        print(json.dumps(row))
        return [row]
    cases = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        parser.error(f"--cases: unknown {unknown}; the cases are {', '.join(CASES)}")
    rows = bench_eval_scale(settings, cases, args.in_process, args.gather)
    print(table(rows))
    write_results(args.json, {"settings": settings, "cases": rows})
    return rows


if __name__ == "__main__":
    main()
