"""Full-corpus evaluation regime of ``make bench``: 10k eval queries ranked exactly against 100k items (width 64), top 100.

``python -m recsys_runner.bench --corpus`` (or ``python -m recsys_runner.bench.corpus``) times the scoring half of a
two-tower evaluation (:func:`recsys_runner.metrics.corpus.corpus_ranks` and the ``recall@10``, ``recall@100``,
``ndcg@10``, ``mrr``, ``coverage@100`` metrics, as ``train/corpus.py`` runs them per eval batch) at two
``model.corpus_chunk_rows``, each in a fresh process so that its peak memory is its own. The target: <= 30 s on 2 CPU
cores, and memory that follows the chunk (an eval batch holds ``B × (chunk + k)`` scores), not the catalogue.

Memory is the growth of the process's peak RSS over the scoring (``VmHWM`` after ``/proc/self/clear_refs`` reset the
mark, minus the RSS before), with ``MALLOC_MMAP_THRESHOLD_`` fixed at 32 MB (glibc's dynamic ceiling: tensors larger are
mapped and returned to the system as they die, smaller ones reused without page faults); the index (``N × O`` floats, 25.6 MB) and the queries exist before the mark.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

import torch

from recsys_runner.metrics.corpus import corpus_ranks
from recsys_runner.metrics.registry import MetricsConfig, metric_entry
from recsys_runner.metrics.retrieval import Ranked

NAMES = ["recall@10", "recall@100", "ndcg@10", "mrr", "coverage@100"]
"""The metrics computed, as a two-tower model's eval would list them."""
DEFAULTS = {"queries": 10_000, "items": 100_000, "dim": 64, "k": 100, "batch": 2048}
"""The regime: eval queries, catalogue items, vector width, top ``k`` kept, queries per eval batch."""
CHUNKS = (4096, 32768)
"""The two ``model.corpus_chunk_rows`` compared."""


def _status(key: str) -> int:
    """``/proc/self/status``'s ``key`` in kB (``VmRSS``, ``VmHWM``)."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(key + ":"))
    return int(line.split()[1])


def measure(chunk: int, queries: int, items: int, dim: int, k: int, batch: int) -> dict[str, Any]:
    """Score ``queries`` random unit vectors against ``items`` in eval batches of ``batch``, ``chunk`` items at a time;
    the seconds, the peak RSS growth (MB) and the metric values."""
    g = torch.Generator().manual_seed(0)
    index = torch.nn.functional.normalize(torch.randn(items, dim, generator=g), dim=1)
    users = torch.nn.functional.normalize(torch.randn(queries, dim, generator=g), dim=1)
    targets = torch.randint(0, items, (queries,), generator=g)
    users = torch.nn.functional.normalize(users + 0.8 * index[targets], dim=1)  # queries lean towards their item
    spec = MetricsConfig(eval=NAMES, train=[])
    metrics = {name: metric_entry(name).factory(spec) for name in NAMES}
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status("VmRSS")
    start, cpu = time.perf_counter(), time.process_time()
    for at in range(0, queries, batch):
        ranks, top = corpus_ranks(users[at:at + batch], index, targets[at:at + batch], k, chunk)
        ranked = Ranked(ranks, top, items)
        for metric in metrics.values():
            metric.update(ranked)
    values = {name: round(float(m.compute()), 4) for name, m in metrics.items()}
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"chunk_rows": chunk, "seconds": round(seconds, 2), "cpu_seconds": round(cpu, 2), "peak_growth_mb": round((_status("VmHWM") - before) / 1024, 1),
            "scores_mb": round(min(batch, queries) * (chunk + k) * 4 / 2**20, 1), "threads": torch.get_num_threads(), **values}


def bench_corpus(settings: dict[str, int] | None = None, chunks: tuple[int, ...] = CHUNKS) -> list[dict[str, Any]]:
    """:func:`measure` at each chunk size, each in a fresh interpreter (its own peak memory)."""
    s = {**DEFAULTS, **(settings or {})}
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(32 << 20)}
    rows = []
    for chunk in chunks:
        args = [f"--{key}={value}" for key, value in s.items()]
        out = subprocess.run([sys.executable, "-m", "recsys_runner.bench.corpus", "--one", str(chunk), *args],
                             capture_output=True, text=True, check=True, env=env)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return rows


def table(rows: list[dict[str, Any]], settings: dict[str, int]) -> str:
    """The regime as a markdown table."""
    s = {**DEFAULTS, **settings}
    head = (f"full-corpus eval: {s['queries']} queries x {s['items']} items, dim {s['dim']}, exact top-{s['k']}, "
            f"eval batches of {s['batch']}\n\n| chunk_rows | seconds | CPU seconds | peak RSS growth MB | scores held MB | threads | "
            + " | ".join(NAMES) + " |\n|" + "---|" * (6 + len(NAMES)))
    lines = [f"| {r['chunk_rows']} | {r['seconds']} | {r['cpu_seconds']} | {r['peak_growth_mb']} | {r['scores_mb']} | {r['threads']} | "
             + " | ".join(str(r[n]) for n in NAMES) + " |" for r in rows]
    return "\n".join([head, *lines])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m recsys_runner.bench.corpus", description=__doc__.split("\n")[0])
    parser.add_argument("--one", type=int, default=None, help="measure this chunk size here and print its JSON row")
    for key, value in DEFAULTS.items():
        parser.add_argument(f"--{key}", type=int, default=value)
    args = parser.parse_args(argv)
    settings = {key: getattr(args, key) for key in DEFAULTS}
    if args.one is not None:
        print(json.dumps(measure(args.one, **settings)))
        return
    print(table(bench_corpus(settings), settings))


if __name__ == "__main__":
    main()
