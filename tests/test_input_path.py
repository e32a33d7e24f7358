"""The input path from DataLoader workers: batches packed into one buffer per batch are the batches of the in-process path,
bit for bit (Parquet, CSV, synthetic; 2 workers); the loader benchmark runs; every bench that times runner windows refuses
too few ``--steps`` before it builds anything."""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data._utils.pin_memory import pin_memory
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import recsys_runner.data.files.shard_stream as shard_stream
import recsys_runner.data.generated.synthetic as synthetic
import recsys_runner.data.packed as packed
import recsys_runner.data.workers as data_workers
from recsys_runner.bench import input_path
from recsys_runner.configurable import make
from recsys_runner.data.files.tabular import CsvData, ParquetData
from recsys_runner.data.files.tabular_config import CsvDataConfig, ParquetDataConfig
from recsys_runner.data.generated.synthetic import SyntheticData
from recsys_runner.data.generated.synthetic_config import SyntheticDataConfig
from recsys_runner.data.packed import Packed, pack, unpack
from recsys_runner.errors import DataError

BENCHES_WITH_WINDOWS = ("data", "regimes", "storage", "zoo", "caching", "table_dtype", "step_options", "multitask", "retrieval")


@pytest.mark.parametrize("name", BENCHES_WITH_WINDOWS)
def test_bench_refuses_steps_without_a_timed_window(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``--steps 10`` is one warm-up window and nothing to time: refused at parsing (exit 2, naming the fix), not a
    ``StatisticsError: no median for empty data`` after the model is built and trained."""
    main = importlib.import_module(f"recsys_runner.bench.{name}").main
    with pytest.raises(SystemExit) as exit_info:
        main(["--steps", "10"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --steps: 10 steps time no window" in err and "Fix: 20 or more" in err, err


# -- one buffer per batch across the worker boundary (data/packed.py) -----------------------------------------------------


def test_pack_gives_back_every_tensor_bit_for_bit_and_every_other_item_as_it_was() -> None:
    nan_payload = torch.tensor([float("nan"), -0.0, 1.5], dtype=torch.float64)
    item = (torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),  # not contiguous
            torch.tensor([True, False, True]), torch.zeros(0, dtype=torch.int64), torch.tensor(7, dtype=torch.int32),
            nan_payload, None, 3, {"tags": (1, 2)}, torch.arange(5, dtype=torch.int16))
    packed = pack(item)
    assert isinstance(packed, Packed) and packed.buffer.dtype == torch.uint8
    back = unpack(packed)
    assert len(back) == len(item)
    for x, y in zip(item, back, strict=True):
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and (y.dtype, y.shape) == (x.dtype, x.shape) and y.is_contiguous()
            assert torch.equal(x.contiguous().view(-1).view(torch.uint8), y.view(-1).view(torch.uint8))  # bits, NaN included
        else:
            assert y == x
    assert pack(("error", "bad row")) == ("error", "bad row")  # nothing to pack: as it is
    assert unpack(("error", "bad row")) == ("error", "bad row")


def test_the_pin_thread_pins_a_packed_batch_as_one_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    """DataLoader's pin thread (``pin_memory=True``) calls a batch's own ``pin_memory``: one pinned copy of the buffer, whose
    views are the batch. Pinning itself needs CUDA: here a copy stands in for it."""
    pinned: list[int] = []

    def pin(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        pinned.append(self.numel())
        return self.clone()

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    item = (torch.rand(4, 3), torch.arange(5), None, 2)
    packed_item = pack(item)
    assert isinstance(packed_item, Packed)
    out = pin_memory(packed_item)
    assert isinstance(out, Packed) and pinned == [packed_item.buffer.numel()]
    back = unpack(out)
    assert torch.equal(back[0], item[0]) and torch.equal(back[1], item[1]) and back[2:] == (None, 2)


def _csv_and_parquet(tmp_path: Path, n: int = 230) -> None:
    """The same rows as CSV and Parquet: a label, an id, a dense number and a weighted multi-hot list; every 17th row bad
    (a price that is no number in the CSV, a missing label in the Parquet file), so batches come with skipped-row counts."""
    lines = ["label,item,price,tags"]
    for i in range(n):
        price = "abc" if i % 17 == 5 else f"{i * 0.25}"
        lines.append(f"{i % 2},{i % 97},{price},{i % 50}:{(i % 7) * 0.5}|{(i * 3) % 50}:1.5")
    (tmp_path / "rows.csv").write_text("\n".join(lines) + "\n")
    pq.write_table(pa.table({
        "label": pa.array([None if i % 17 == 5 else i % 2 for i in range(n)], pa.int64()),
        "item": pa.array([i % 97 for i in range(n)], pa.int64()),
        "price": pa.array([i * 0.25 for i in range(n)], pa.float32()),
        "tags": pa.array([[i % 50, (i * 3) % 50][: 1 + i % 2] for i in range(n)], pa.list_(pa.int64())),
        "tags_w": pa.array([[(i % 7) * 0.5, 1.5][: 1 + i % 2] for i in range(n)], pa.list_(pa.float32())),
    }), tmp_path / "rows.parquet", row_group_size=31)


def _file_data(kind: str, tmp_path: Path, **kw: Any) -> ParquetData | CsvData:
    common: dict[str, Any] = {"batch_size": 8, "shuffle_buffer_rows": 24, "eval_fraction": 0.2, "on_bad_rows": "skip",
                              "num_workers": 2, "pin_memory": False, "dense": [{"name": "price"}]} | kw
    if kind == "parquet":
        sparse = [{"name": "item", "num_embeddings": 100}, {"name": "tags", "num_embeddings": 50, "weights": "tags_w"}]
        return ParquetData(make(ParquetDataConfig, path=str(tmp_path / "rows.parquet"), sparse=sparse, **common))
    sparse = [{"name": "item", "num_embeddings": 100}, {"name": "tags", "num_embeddings": 50, "separator": "|", "weighted": True}]
    return CsvData(make(CsvDataConfig, path=str(tmp_path / "rows.csv"), block_rows=29, sparse=sparse, **common))


def _identical(a: list[Batch], b: list[Batch]) -> None:
    """The same batches in the same order, bit for bit: every tensor's dtype, shape and values; weights None or present alike."""
    assert len(a) == len(b) and a
    for x, y in zip(a, b, strict=True):
        kx, ky = x.sparse_features, y.sparse_features
        assert kx.keys() == ky.keys()
        pairs = [(x.dense_features, y.dense_features), (x.labels, y.labels), (kx.values(), ky.values()), (kx.lengths(), ky.lengths())]
        assert (kx.weights_or_none() is None) == (ky.weights_or_none() is None)
        if kx.weights_or_none() is not None:
            pairs.append((kx.weights(), ky.weights()))
        for s, t in pairs:
            assert (s.dtype, s.shape) == (t.dtype, t.shape) and torch.equal(s, t)


@pytest.fixture
def count_packed(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each item the training process unpacks came packed (so that a test of the packed path is not vacuous)."""
    seen: list[bool] = []
    real = packed.unpack

    def spy(item: Any) -> tuple[Any, ...]:
        seen.append(isinstance(item, Packed))
        return real(item)

    monkeypatch.setattr(packed, "unpack", spy)
    return seen


def _unpacked_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers send their tuples as they did before packing: one shared segment per tensor (the reference)."""
    monkeypatch.setattr(shard_stream, "packed_stream", lambda items: items)
    monkeypatch.setattr(synthetic, "packed_stream", lambda items: items)


class _RoundRobinInProcess:
    """What ``DataLoader(stream, batch_size=None, num_workers=W)`` yields, made in this process: worker ``w``'s stream is
    the dataset iterated under a worker info saying ``w`` of ``W`` (its shard, unpacked), and the streams are taken in
    turn as DataLoader takes its workers' results, an exhausted worker dropping out of the turn. The reference of the packed
    path without a second round of worker processes: a worker forked from this long-lived test process once aborted in
    CI (``std::system_error``, both workers, in the reference's round only), which its batches need not depend on."""

    def __init__(self, dataset: Any, batch_size: None = None, num_workers: int = 0, **_: Any) -> None:
        self.dataset, self.workers = dataset, num_workers

    def __iter__(self) -> Iterator[Any]:
        streams = []
        for w in range(self.workers):
            info = SimpleNamespace(id=w, num_workers=self.workers)
            with pytest.MonkeyPatch.context() as m:
                m.setattr(shard_stream, "get_worker_info", lambda info=info: info)
                streams.append(list(self.dataset))  # the shard read whole under its worker info
        turn = [iter(s) for s in streams]
        while turn:
            for it in list(turn):
                item = next(it, None)
                if item is None:
                    turn.remove(it)
                else:
                    yield item


@pytest.mark.parametrize("kind", ["parquet", "csv"])
def test_packed_file_batches_from_two_workers_are_the_unpacked_ones(kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     count_packed: list[bool]) -> None:
    """Weighted features, skipped-row markers and their counts: through one buffer per batch from two worker processes,
    exactly the tuples each worker's shard makes, in DataLoader's order."""
    _csv_and_parquet(tmp_path)
    data = _file_data(kind, tmp_path)
    got = [list(data.train_batches(e, 0, 1)) for e in (0, 1)] + [list(data.eval_batches(0, 1))]
    counters = data.metrics()
    assert any(count_packed) and counters["data/bad_rows_skipped"] > 0
    with monkeypatch.context() as m:
        _unpacked_workers(m)
        m.setattr(data_workers, "WorkerLoader", _RoundRobinInProcess)
        count_packed.clear()
        reference = _file_data(kind, tmp_path)
        expected = [list(reference.train_batches(e, 0, 1)) for e in (0, 1)] + [list(reference.eval_batches(0, 1))]
        assert not any(count_packed)
    for g, e in zip(got, expected, strict=True):
        _identical(g, e)
    assert counters == reference.metrics()


def test_a_bad_row_in_a_worker_is_still_named(tmp_path: Path) -> None:
    _csv_and_parquet(tmp_path)
    with pytest.raises(DataError, match=r"bad row in .*rows\.csv, line \d+, column 'price': 'abc' is not a number"):
        list(_file_data("csv", tmp_path, on_bad_rows="fail").train_batches(0, 0, 1))


def test_packed_synthetic_batches_from_two_workers_are_the_in_process_ones(monkeypatch: pytest.MonkeyPatch,
                                                                           count_packed: list[bool]) -> None:
    config = make(SyntheticDataConfig, batch_size=32, num_dense=3, num_sparse=4, num_embeddings=50, num_train_rows=32 * 9,
                  num_eval_rows=32 * 3, tasks=["ctr", "cvr"], user_item_clusters=4, hard_negatives=2, pin_memory=False)
    workers, here = SyntheticData(replace(config, num_workers=2)), SyntheticData(replace(config, num_workers=0))
    _identical(list(workers.train_batches(1, 0, 1)), list(here.train_batches(1, 0, 1)))
    _identical(list(workers.eval_batches(0, 1)), list(here.eval_batches(0, 1)))
    assert count_packed and all(count_packed)
    with monkeypatch.context() as m:
        _unpacked_workers(m)
        _identical(list(workers.train_batches(1, 0, 1)), list(here.train_batches(1, 0, 1)))


# -- the loader benchmark ---------------------------------------------------------------------------------------------------


def test_input_path_bench_measures_every_grid_point_and_writes_them(tmp_path: Path) -> None:
    """A few batches of each point (it checks the bench works, not how fast): the grid capped by the CPUs, pinning only
    where CUDA is, and with --train the fed and in-memory rounds and their ratio; the JSON holds what the table prints."""
    out = tmp_path / "input_path.json"
    result = input_path.main(["--batch-sizes", "64", "--workers", "0,1,9999", "--batches", "3", "--rounds", "1", "--train",
                              "--steps", "20", "--json", str(out), "distributed.device=cpu", "data.num_embeddings=1000",
                              "model.embedding_dim=4", "model.dense_arch_layer_sizes=[4]", "model.deep_layer_sizes=[8]"])
    points = json.loads(out.read_text())["points"]
    assert points == result["points"] and result["workers_left_out"] == [9999]
    assert [(p["data"], p["num_workers"], p["pin_memory"]) for p in points] == [
        ("synthetic", 0, False), ("synthetic", 1, False), ("parquet", 0, False), ("parquet", 1, False)]
    assert all(p["rows_per_s"] > 0 and p["batch_size"] == 64 and p["ratio"] > 0 for p in points)


def test_input_path_bench_refuses_a_grid_it_cannot_run(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, says in ((["--data", "csv"], "--data must name some of synthetic, parquet"),
                       (["--workers", "9999"], "every --workers value exceeds the")):
        with pytest.raises(SystemExit):
            input_path.main(argv)
        assert says in capsys.readouterr().err


# -- per-key lengths known on the host (data/base.py batch_kjt) -------------------------------------------------------------


def _per_key_lengths_are_known(batches: list[Batch]) -> None:
    """Each batch's KJT comes with ``length_per_key``/``offset_per_key`` set (no step computes them from device lengths)
    and equal to what TorchRec's own sync computes."""
    assert batches
    for b in batches:
        kjt = b.sparse_features
        assert kjt._length_per_key is not None and kjt._offset_per_key is not None
        synced = KeyedJaggedTensor.from_lengths_sync(kjt.keys(), kjt.values(), kjt.lengths())
        assert kjt.length_per_key() == synced.length_per_key() and kjt.offset_per_key() == synced.offset_per_key()
        assert kjt.stride() == synced.stride() == b.labels.shape[0]


@pytest.mark.parametrize("workers", [0, 2])
def test_generated_and_file_batches_carry_their_per_key_lengths(workers: int, tmp_path: Path) -> None:
    config = make(SyntheticDataConfig, batch_size=32, num_dense=3, num_sparse=4, num_embeddings=50, num_train_rows=32 * 3,
                  num_eval_rows=32, tasks=["ctr", "cvr"], user_item_clusters=4, hard_negatives=2, num_workers=workers,
                  pin_memory=False)
    _per_key_lengths_are_known(list(SyntheticData(config).train_batches(0, 0, 1)))
    _csv_and_parquet(tmp_path)
    for kind in ("parquet", "csv"):
        data = _file_data(kind, tmp_path, num_workers=workers)
        _per_key_lengths_are_known(list(data.train_batches(0, 0, 1)) + list(data.eval_batches(0, 1)))
