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
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
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
DEFAULTS = {"rows": 2_000_000, "batch": 4096, "rows_per_group": 20, "items": 100_000, "threads": 0}
"""Eval rows (queries for ``coverage``), rows per eval batch, rows per ``gauc`` user, catalogue items, torch threads
(0: torch's default)."""
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


def measure(case: str, rows: int, batch: int, rows_per_group: int, items: int, threads: int) -> dict[str, Any]:
    """One case: the seconds of the updates and of ``compute``, the states' bytes, the peak RSS growth, the values."""
    if threads:
        torch.set_num_threads(threads)
    update, compute, owners = _coverage(rows, batch, items) if case == "coverage" else _eval_metrics(case, rows, batch, rows_per_group)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak RSS mark starts again here
    before = _status("VmRSS")
    updating = sum(update(at) for at in range(0, rows, batch))
    state = _state_bytes(owners)
    start = time.perf_counter()
    values = compute()
    computing = time.perf_counter() - start
    return {"case": case, "metrics": CASES[case], "rows": rows, "update_s": round(updating, 2),
            "compute_s": round(computing, 2), "state_mb": round(state / 2**20, 1), "state_bytes": state,
            "peak_growth_mb": round((_status("VmHWM") - before) / 1024, 1), "threads": torch.get_num_threads(),
            "values": {k: round(v, 6) for k, v in values.items()}}


Case = tuple[Callable[[int], float], Callable[[], dict[str, float]], list[Metric]]
"""A case's ``update(first row)`` of one batch (the seconds its metric work took), its ``compute()`` and the metrics
whose states it fills."""


def _eval_metrics(case: str, rows: int, batch: int, rows_per_group: int) -> Case:
    """The evaluator's metrics of a binary task (:class:`TaskEvalMetrics`) over :func:`eval_rows`; ``gauc``'s group ids
    read from each batch's sparse features as the evaluator reads them (:func:`grouping_ids`)."""
    names = CASES[case]
    spec = MetricsConfig(eval=names, train=[], grouping_key=GROUP_KEY if "gauc" in names else None)
    metrics = TaskEvalMetrics(spec, (BinaryTask(),), torch.device("cpu"))
    logits, labels, groups = eval_rows(rows, rows_per_group)

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


def bench_eval_scale(settings: dict[str, int], cases: list[str], in_process: bool = False) -> list[dict[str, Any]]:
    """:func:`measure` for each case, each in a fresh interpreter (its own peak memory) unless ``in_process``."""
    if in_process:
        return [measure(case, **settings) for case in cases]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(32 << 20)}
    args = [f"--{key.replace('_', '-')}={value}" for key, value in settings.items()]
    rows = []
    for case in cases:
        out = subprocess.run([sys.executable, "-m", "recsys_runner.bench.eval_scale", "--one", case, *args],
                             capture_output=True, text=True, check=True, env=env)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The cases as a markdown table."""
    head = ("| case | metrics | rows | update s | compute s | states MB | peak RSS growth MB | threads | values |\n"
            "|---|---|---|---|---|---|---|---|---|")
    lines = [f"| {r['case']} | {', '.join(r['metrics'])} | {r['rows']:,} | {r['update_s']} | {r['compute_s']} | {r['state_mb']} | "
             f"{r['peak_growth_mb']} | {r['threads']} | {', '.join(f'{k}={v}' for k, v in r['values'].items())} |" for r in rows]
    return "\n".join([head, *lines])


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(prog="python -m recsys_runner.bench.eval_scale", description=__doc__.split("\n")[0])
    parser.add_argument("--one", choices=list(CASES), default=None, help="measure this case here and print its JSON row")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated cases (default all: {','.join(CASES)})")
    for key, value in DEFAULTS.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, default=value)
    parser.add_argument("--in-process", action="store_true", help="every case in this process (no fresh interpreter each)")
    parser.add_argument("--json", default="bench_results/eval_scale.json", help="where to write the results")
    args = parser.parse_args(argv)
    settings = {key: getattr(args, key) for key in DEFAULTS}
    if args.one is not None:
        row = measure(args.one, **settings)
        print(json.dumps(row))
        return [row]
    cases = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        parser.error(f"--cases: unknown {unknown}; the cases are {', '.join(CASES)}")
    rows = bench_eval_scale(settings, cases, args.in_process)
    print(table(rows))
    write_results(args.json, {"settings": settings, "cases": rows})
    return rows


if __name__ == "__main__":
    main()
