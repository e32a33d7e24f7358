"""``python -m recsys_runner.bench.topk``: ``predict``'s top-100 for 100k users against 100k items, exclude-seen on and off.

Issue 31's second speed bullet. One generated interaction log (``--users`` users walking a ring of ``--items`` items in
steps of 1-3, lengths Zipf-distributed and capped at ``--max-len + 1``; every item is some user's first event when
there are at least as many users as items, so the id mapping holds all of them) is written as rows by
``python -m recsys_runner.data sequences --rows per-event --split leave-last-out --max-len <max_len>``: its
``eval.parquet`` holds one row per user, the user's last event with every earlier one as history — the input of the
nightly top-k job. Per model (``--models``: ``sasrec``, next-item over the history; ``dssm``, two-tower with the
history's items pooled in the user tower and the catalogue ``items.parquet`` of every mapped item), the runner trains
``--train-steps`` steps of ``--train-batch-size`` rows on ``train.parquet`` (the weights only need to exist: speed does
not depend on them), then, in batches of ``--batch-size`` rows:

* ``cli``: ``python -m recsys_runner.predict … predict.top_k=<k> predict.exclude_seen=true|false`` over every user, run
  as a user runs it: rows/s and seconds from its last line (reading, encoding, scoring, writing Parquet; the build not
  counted), the process's wall time and the 1-minute load average before and after (``load_1min``: on a shared
  machine, what else ran); the written parts are checked: one row per input row, each list ``k`` long,
  and how many top items are in the row's history (``seen_in_top``: 0 with exclude-seen on).
* ``breakdown``: where the time goes, in this process on the first ``--profile-rows`` users (the same code:
  :func:`~recsys_runner.scoring.score_files` with :func:`~recsys_runner.scoring.ranking_scorer`'s
  :class:`~recsys_runner.scoring_topk.TopK`, its steps timed apart): ``index_s`` (reading the item table, or the item
  tower over the catalogue: once per run), ``queries_s`` (the model over the histories: SASRec's blocks or the user
  tower, and the seen items), ``scoring_s`` (the chunked ``queries @ items.T`` alone, timed again on the same queries
  as the sweep computes it), ``topk_s`` (the rest of the retrieval: seen masking, each chunk's top k and the merge, the
  written scores), ``columns_s`` (Arrow lists and raw ids), ``rest_s`` (reading, encoding and writing Parquet: the
  whole minus the scorer), and ``write_s`` (the output table written again with pyarrow: about the writing's part of
  ``rest_s``).

``--quick`` runs a tiny log; ``--in-process`` does ``cli``'s predict in this process (the command's scoring without its
process start and MLflow run; what a test affords). The bench is an entry: it runs the other commands as processes and
imports none of them. Results go to ``bench_results/topk.json``
(``--json``).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from torchrec.datasets.utils import Batch

from recsys_runner.bench import write_results
from recsys_runner.bench.regimes import compose_run
from recsys_runner.bench.serving import PREDICT_LINE, run_entry
from recsys_runner.build import build
from recsys_runner.data.__main__ import main as data_main
from recsys_runner.data.sequences.mapping import load_mapping
from recsys_runner.inference_build import build_inference
from recsys_runner.models.dssm import DSSMConfig
from recsys_runner.scoring import ranking_scorer, score_files
from recsys_runner.scoring_topk import CHUNK_ROWS, TOP_ITEMS, TopK
from recsys_runner.train.loop import train

__all__ = ["MODELS", "interaction_log", "main", "model_overrides", "seen_in_top"]

MODELS = ("sasrec", "dssm")
"""The models timed: a next-item model over the history and a two-tower model over a catalogue."""


def interaction_log(num_users: int, num_items: int, max_len: int, seed: int = 0) -> pa.Table:
    """``user, item, timestamp``: each user starts at an item of a random permutation (so with ``num_users >= num_items``
    every item starts some user) and walks the ring of ``num_items`` in steps of 1-3; lengths follow a Zipf law
    (``a = 1.5``) shifted to at least 2 events and capped at ``max_len + 1`` (the last event's history is then at most
    ``max_len`` long, what the rows keep)."""
    rng = np.random.default_rng(seed)
    lengths = np.minimum(rng.zipf(1.5, num_users) + 1, max_len + 1)
    users = np.repeat(np.arange(num_users), lengths)
    starts = np.repeat(rng.permutation(max(num_users, num_items))[:num_users] % num_items, lengths)
    first = np.cumsum(lengths) - lengths
    walk = np.cumsum(rng.integers(1, 4, int(lengths.sum())))
    items = (starts + walk - np.repeat(walk[first], lengths)) % num_items  # the walk restarts at each user
    times = 1_000_000_000 + (np.arange(len(users)) - np.repeat(first, lengths)) * 3600 + rng.integers(0, 600, len(users))
    return pa.table({"user": users, "item": items, "timestamp": times})


def write_rows(workdir: Path, num_users: int, num_items: int, max_len: int) -> tuple[Path, int, int]:
    """The log's rows (``data sequences``, per event, the last event of each user held out) and the catalogue of every
    mapped item (``items.parquet``, its ids as the rows hold them) in ``workdir/rows``; ``(folder, events, items)``."""
    log, rows = workdir / "log.parquet", workdir / "rows"
    pq.write_table(interaction_log(num_users, num_items, max_len), log)
    assert data_main(["sequences", str(log), str(rows), "--user", "user", "--item", "item", "--time", "timestamp",
                      "--max-len", str(max_len), "--rows", "per-event", "--split", "leave-last-out"]) == 0
    mapped = len(load_mapping(str(rows))["item"])
    pq.write_table(pa.table({"item_id": np.arange(mapped, dtype=np.int64)}), rows / "items.parquet")
    return rows, pq.read_metadata(log).num_rows, mapped


def model_overrides(model: str, rows: Path, batch_size: int) -> list[str]:
    """The training (and so predict's) overrides of ``model`` on ``rows``: the data, its batch size, the CPU, nothing
    logged; ``dssm`` pools the history's items in its user tower (the history is then its seen items) and ranks the
    catalogue ``items.parquet``."""
    common = ["data=parquet", f"data.path={rows / 'train.parquet'}", f"data.eval_path={rows / 'eval.parquet'}",
              f"data.batch_size={batch_size}", "data.num_workers=0", "distributed.device=cpu", "tracking=none"]
    if model == "sasrec":
        return ["model=sasrec", *common]
    if model == "dssm":
        return ["model=dssm", "model.user_features=[hist_item_id]", "model.item_features=[item_id]", *common,
                f"data.items.path={rows / 'items.parquet'}", "data.items.id=item_id"]
    raise ValueError(f"--models: unknown model {model!r}; choose from {list(MODELS)}")


def train_model(overrides: list[str], steps: int, checkpoints: Path) -> tuple[Path, float]:
    """Train ``steps`` steps (one eval batch at the end) and save; ``(the checkpoint, seconds)``."""
    start = time.perf_counter()
    c = build(compose_run([*overrides, f"train.num_steps={steps}", "train.eval_every_steps=null", "train.eval_max_batches=1",
                           "train.log_every_steps=1000", f"checkpoint.dir={checkpoints}"]))
    try:
        train(c.loop)
    finally:
        c.close()
    (checkpoint,) = sorted(checkpoints.glob("step_*"))[-1:]
    return checkpoint, time.perf_counter() - start


def predict_cli(overrides: list[str], checkpoint: Path, input_file: Path, output: Path, k: int, exclude_seen: bool,
                cwd: Path) -> dict[str, Any]:
    """``python -m recsys_runner.predict`` as a user runs it: rows, seconds and rows/s of its last line, and the process's
    wall time."""
    start = time.perf_counter()
    said = run_entry("recsys_runner.predict", [*overrides, f"load={checkpoint}", f"predict.input={input_file}",
                                               f"predict.output={output}", f"predict.top_k={k}",
                                               f"predict.exclude_seen={str(exclude_seen).lower()}", "predict.columns=[user_id]"], cwd)
    process_s = time.perf_counter() - start
    line = PREDICT_LINE.search(said)
    if line is None:
        raise RuntimeError(f"python -m recsys_runner.predict wrote no 'predict: wrote … rows' line:\n{said[-3000:]}")
    return {"rows": int(line["rows"]), "seconds": float(line["seconds"]), "rows_per_s": int(line["rate"]),
            "process_s": round(process_s, 1)}


def predict_in_process(overrides: list[str], checkpoint: Path, input_file: Path, output: Path, k: int,
                       exclude_seen: bool) -> dict[str, Any]:
    """:func:`predict_cli`'s figures from the command's work done in this process (``--in-process``: the model built
    for inference, :func:`~recsys_runner.scoring.ranking_scorer`, :func:`~recsys_runner.scoring.score_files`, as
    ``recsys_runner.predict.run`` calls them, without a process start or MLflow: what a test can afford)."""
    start = time.perf_counter()
    built = build_inference(compose_run(overrides), weights=checkpoint)
    try:
        scorer = ranking_scorer(built, str(input_file), k=k, exclude_seen=exclude_seen)
        done = score_files(built, input_path=str(input_file), columns=["user_id"], output=output, log_every_batches=10**9,
                           scorer=scorer)
    finally:
        built.close()
    return {"rows": done.rows, "seconds": round(done.seconds, 1), "rows_per_s": round(done.rows_per_s),
            "process_s": None, "in_process_s": round(time.perf_counter() - start, 1)}


def seen_in_top(output: Path, input_file: Path, mapping: np.ndarray) -> tuple[int, int, list[int]]:
    """``(top items that are in their row's history, rows written, distinct list lengths)`` of predict's parts in
    ``output`` against ``input_file`` (one rank: the parts in name order are the input rows in order); the histories'
    ids are named through the id ``mapping`` (integer raw ids) as ``top_items`` are."""
    written = pq.read_table(sorted(output.glob("part-*.parquet")), columns=[TOP_ITEMS])[TOP_ITEMS].combine_chunks()
    history = pq.read_table(input_file, columns=["hist_item_id"])["hist_item_id"].combine_chunks()
    assert mapping.dtype.kind in "iu", "the bench's log has integer item ids"
    top_len = pc.list_value_length(written).to_numpy(zero_copy_only=False)
    hist_len = pc.list_value_length(history).to_numpy(zero_copy_only=False)
    if len(top_len) != len(hist_len):
        return -1, len(top_len), sorted(set(top_len.tolist()))
    top = written.flatten().to_numpy(zero_copy_only=False).astype(np.int64)
    seen = mapping[history.flatten().to_numpy(zero_copy_only=False)].astype(np.int64)
    width = int(max(top.max(initial=0), seen.max(initial=0))) + 1
    keys = lambda lengths, ids: np.repeat(np.arange(len(lengths), dtype=np.int64), lengths) * width + ids  # noqa: E731
    return int(np.isin(keys(top_len, top), keys(hist_len, seen)).sum()), len(top_len), sorted(set(top_len.tolist()))


class _Timed:
    """A :class:`~recsys_runner.scoring_topk.TopK` whose steps are timed apart (the module docstring's ``breakdown``);
    the chunked matmul alone is timed again on each batch's queries, outside the scorer's total."""

    def __init__(self, scorer: TopK) -> None:
        self.scorer = scorer
        self.seconds = dict.fromkeys(("index_s", "queries_s", "retrieve_s", "scoring_s", "columns_s"), 0.0)
        self.extra_s = 0.0
        """Time spent on measuring only (a second :meth:`TopK.queries` of the first batch, the matmul timed again)."""

    def __call__(self, batch: Batch) -> dict[str, pa.Array]:
        s, clock = self.scorer, time.perf_counter
        first = None
        if s.index is None:  # the first batch reads the index: that call's excess over a second one is the index's
            t0 = clock()
            s.queries(batch)
            first = clock() - t0
        t0 = clock()
        queries, seen = s.queries(batch)
        t1 = clock()
        found = s.retrieve(queries, seen)
        t2 = clock()
        answer = s.answer(*found)
        t3 = clock()
        if first is not None:
            self.seconds["index_s"] += max(first - (t1 - t0), 0.0)
            self.extra_s += min(first, t1 - t0)  # the second call's queries: not predict's work
        self.seconds["queries_s"] += t1 - t0
        self.seconds["retrieve_s"] += t2 - t1
        self.seconds["columns_s"] += t3 - t2
        assert s.index is not None
        t4 = clock()
        buffer = torch.empty((queries.shape[0], s.chunk_rows), dtype=queries.dtype)
        for start in range(0, s.index.shape[0], s.chunk_rows):  # as the sweep scores: full chunks into one buffer
            chunk = s.index[start:start + s.chunk_rows]
            if chunk.shape[0] == s.chunk_rows:
                torch.mm(queries, chunk.t(), out=buffer)
            else:
                queries @ chunk.t()
        self.seconds["scoring_s"] += clock() - t4
        self.extra_s += clock() - t4
        return answer


def breakdown(overrides: list[str], checkpoint: Path, sample: Path, output: Path, k: int, exclude_seen: bool) -> dict[str, Any]:
    """Where predict's time goes on the rows of ``sample``, in this process (see the module docstring)."""
    built = build_inference(compose_run(overrides), weights=checkpoint)  # the training's config, as predict's carries it
    try:
        scorer = ranking_scorer(built, str(sample), k=k, exclude_seen=exclude_seen)
        assert isinstance(scorer, TopK), type(scorer)
        timed = _Timed(scorer)
        result = score_files(built, input_path=str(sample), columns=["user_id"], output=output, log_every_batches=10**9,
                             scorer=timed)
    finally:
        built.close()
    table = pq.read_table(result.parts)
    start = time.perf_counter()
    pq.write_table(table, output / "rewritten.parquet")
    write_s = time.perf_counter() - start
    t = timed.seconds
    total = max(result.seconds - timed.extra_s, 1e-9)  # predict's own work
    scorer_s = t["index_s"] + t["queries_s"] + t["retrieve_s"] + t["columns_s"]
    # the matmul timed alone again is an estimate of its part of retrieve_s (matmul + top-k + merge); on a loaded machine
    # it can exceed the whole, so it is capped there: the parts then still add up to predict's own time
    scoring_s = min(t["scoring_s"], t["retrieve_s"])
    parts = {"index_s": t["index_s"], "queries_s": t["queries_s"], "scoring_s": scoring_s,
             "topk_s": t["retrieve_s"] - scoring_s, "columns_s": t["columns_s"],
             "rest_s": max(total - scorer_s, 0.0), "write_s": write_s}
    return {"rows": result.rows, "seconds": round(total, 2), "rows_per_s": round(result.rows / total),
            **{name: round(v, 3) for name, v in parts.items()},
            "share": {name: round(v / total, 3) for name, v in parts.items() if name != "write_s"}}


def measure(a: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Write the rows, then per model train, predict through the CLI with exclude-seen on and off, and break one sample
    down (see the module docstring)."""
    rows, events, items = write_rows(workdir, a.users, a.items, a.max_len)
    users_file = rows / "eval.parquet"
    table = pq.read_table(users_file)
    sample = rows / "profile_rows.parquet"  # beside the mapping its metadata names (".")
    pq.write_table(table.slice(0, a.profile_rows), sample)
    hist = pc.list_value_length(table["hist_item_id"]).to_numpy(zero_copy_only=False)
    mapping = load_mapping(str(rows))["item"]
    result: dict[str, Any] = {
        "users": a.users, "items": items, "events": events, "max_len": a.max_len, "k": a.k, "batch_size": a.batch_size,
        "chunk_rows": {"sasrec": CHUNK_ROWS, "dssm": DSSMConfig().corpus_chunk_rows},
        "input_rows": table.num_rows, "mean_history": round(float(hist.mean()), 1), "max_history": int(hist.max()),
        "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "torch": torch.__version__,
        "predict": "in_process" if a.in_process else "cli", "models": {}}
    for model in a.models:
        overrides = model_overrides(model, rows, a.batch_size)
        checkpoint, train_s = train_model(model_overrides(model, rows, a.train_batch_size), a.train_steps, workdir / f"ck_{model}")
        figures: dict[str, Any] = {"overrides": overrides, "train_steps": a.train_steps, "train_batch_size": a.train_batch_size,
                                   "train_s": round(train_s, 1)}
        for exclude_seen in (True, False):
            name = "exclude_seen_on" if exclude_seen else "exclude_seen_off"
            out = workdir / f"out_{model}_{name}"
            load_before = os.getloadavg()[0]  # other work on the machine: what the figure shares the cores with
            cli = predict_in_process(overrides, checkpoint, users_file, out, a.k, exclude_seen) if a.in_process else \
                predict_cli(overrides, checkpoint, users_file, out, a.k, exclude_seen, workdir)
            cli["load_1min"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
            cli["seen_in_top"], cli["rows_written"], cli["list_lengths"] = seen_in_top(out, users_file, mapping)
            whole = f"process {cli['process_s']} s" if cli["process_s"] is not None else "in this process"
            print(f"{model} {name}: {cli['rows']} rows in {cli['seconds']} s, {cli['rows_per_s']} rows/s ({whole}); "
                  f"seen items in the top {a.k}: {cli['seen_in_top']}", flush=True)
            figures[name] = cli
            profile = breakdown(overrides, checkpoint, sample, workdir / f"profile_{model}_{name}", a.k, exclude_seen)
            print(f"{model} {name} breakdown of {profile['rows']} rows: " +
                  ", ".join(f"{n} {v:.0%}" for n, v in profile["share"].items()), flush=True)
            figures[f"breakdown_{name}"] = profile
        result["models"][model] = figures
    return result


def main(argv: list[str] | None = None) -> int:
    """Parse the flags, measure, print and write ``bench_results/topk.json``."""
    p = argparse.ArgumentParser(prog="python -m recsys_runner.bench.topk", description=__doc__.splitlines()[0])
    p.add_argument("--users", type=int, default=100_000, help="users, so predict's input rows")
    p.add_argument("--items", type=int, default=100_000, help="items of the ring (all mapped when users >= items)")
    p.add_argument("--max-len", type=int, default=50, help="the longest history kept")
    p.add_argument("--k", type=int, default=100, help="predict.top_k")
    p.add_argument("--batch-size", type=int, default=1024, help="predict's data.batch_size")
    p.add_argument("--train-steps", type=int, default=20)
    p.add_argument("--train-batch-size", type=int, default=128,
                   help="training's data.batch_size (SASRec's in-batch softmax over every position grows with its square)")
    p.add_argument("--profile-rows", type=int, default=10_240, help="users of the in-process breakdown")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--in-process", action="store_true",
                   help="do predict's scoring in this process instead of launching the command: no process start, what "
                        "a test can afford")
    p.add_argument("--quick", action="store_true", help="a tiny log (tests): 600 users, 500 items, top 20")
    p.add_argument("--json", default="bench_results/topk.json")
    p.add_argument("--workdir", default=None, help="keep the log, rows, checkpoints and outputs here (default: a temporary "
                                                   "folder, removed at the end)")
    a = p.parse_args(argv)
    if a.quick:
        a.users, a.items, a.max_len, a.k, a.batch_size, a.train_steps, a.profile_rows = 600, 500, 20, 20, 128, 3, 256
        a.train_batch_size = 64
    start = time.perf_counter()
    if a.workdir is not None:
        Path(a.workdir).mkdir(parents=True, exist_ok=True)
        result = measure(a, Path(a.workdir))
    else:
        with tempfile.TemporaryDirectory(prefix="bench-topk-") as tmp:
            result = measure(a, Path(tmp))
    result["bench_seconds"] = round(time.perf_counter() - start, 1)
    write_results(a.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
