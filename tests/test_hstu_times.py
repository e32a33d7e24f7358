"""HSTU's time bias on the event times of ``python -m recsys_runner.data sequences``'s rows (issue 31, point 5).

The rows' ``hist_ts`` reach the blocks as each position's key time, and the time of the event a position predicts as
its query time (generative-recommenders' ``RelativeBucketedTimeAndPositionBasedBias``: ``ts(next) - ts(current)``); a
model on rows with times learns the time-bias weights and its outputs depend on the times; rows without times give
the relative position bias alone.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner.configurable import make
from recsys_runner.data.__main__ import main as data_main
from recsys_runner.data.files.tabular import ParquetData
from recsys_runner.data.files.tabular_config import ParquetDataConfig
from recsys_runner.models.hstu import HSTUBlock, RelativeBias, query_and_key_times, time_buckets
from recsys_runner.models.sasrec import SASRec, SASRecConfig
from recsys_runner.models.train_wrapper import TrainWrapper


def spread_log(num_users: int = 24, seed: int = 0) -> pa.Table:
    """Events whose gaps span seconds to months (so they fall in many time buckets), shuffled."""
    rng = np.random.default_rng(seed)
    rows = []
    for u in range(num_users):
        k = int(rng.integers(4, 12))
        times = 1_000_000_000 + np.cumsum(np.exp(rng.uniform(0, 16, k)).astype(np.int64) + 1)
        rows += [(u, int(rng.integers(0, 40)), int(t)) for t in times]
    order = rng.permutation(len(rows))
    users, items, times = zip(*[rows[i] for i in order], strict=True)
    return pa.table({"user": list(users), "item": list(items), "timestamp": list(times)})


def rows(tmp_path: Path) -> Path:
    pq.write_table(spread_log(), tmp_path / "log.parquet")
    out = tmp_path / "users"
    assert data_main(["sequences", str(tmp_path / "log.parquet"), str(out), "--rows", "per-user", "--split", "leave-two-out",
                      "--max-len", "16"]) == 0
    return out


def hstu(data: ParquetData) -> SASRec:
    torch.manual_seed(0)
    model = SASRec(make(SASRecConfig, embedding_dim=8, block="hstu", dropout=0.0), features=data.features)
    model.arch.to_empty(device=torch.device("cpu"))
    for p in model.arch.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return model


def parquet(path: Path, n: int = 64) -> ParquetData:
    return ParquetData(make(ParquetDataConfig, path=str(path), eval_path=str(path), num_workers=0, shuffle=False,
                            drop_remainder=False, batch_size=n))


def with_times(kjt: KeyedJaggedTensor, key: str, times: torch.Tensor) -> KeyedJaggedTensor:
    """``kjt`` with ``key``'s values replaced by ``times`` (same lengths)."""
    d = kjt.to_dict()
    values = [times if k == key else d[k].values() for k in kjt.keys()]
    return KeyedJaggedTensor(keys=kjt.keys(), values=torch.cat(values), lengths=kjt.lengths())


def test_query_time_is_the_predicted_events_time_and_key_time_its_own() -> None:
    ts = torch.tensor([[10, 20, 40], [5, 0, 0], [0, 0, 0]])
    lengths = torch.tensor([3, 1, 0])
    query, key = query_and_key_times(ts, lengths)
    # row 0: positions 0..3 predict events 1, 2, 3 and the candidate (no candidate time: the newest event's)
    assert query.tolist()[0] == [10, 20, 40, 40] and key.tolist()[0] == [10, 10, 20, 40]
    assert query.tolist()[1][:2] == [5, 5] and key.tolist()[1][:2] == [5, 5]
    assert query.tolist()[2][:1] == [0] and key.tolist()[2][:1] == [0]
    query, key = query_and_key_times(ts, lengths, next_times=torch.tensor([100, 9, 7]))
    assert query.tolist()[0] == [10, 20, 40, 100] and query.tolist()[1][:2] == [5, 9] and query.tolist()[2][0] == 7
    assert key.tolist()[2][0] == 7, "the start token's key time is its query time (gap 0)"


def test_time_buckets_are_the_reference_codes() -> None:
    gaps = torch.tensor([0, 1, 2, 3, 60, 3600, 86_400, -86_400, 10**12])
    expected = [min(int(math.log(max(abs(g), 1)) / 0.301), 128) for g in gaps.tolist()]
    assert time_buckets(gaps, 128).tolist() == expected
    bias = RelativeBias(4, 128)
    q, k = torch.tensor([[0, 100, 100, 5000]]), torch.tensor([[0, 0, 100, 100]])
    out = bias(4, (q, k))
    assert out.shape == (1, 4, 4)
    # (position + time) - position is the time weight up to float32 rounding of the sum
    torch.testing.assert_close(out[0, 3, 1] - bias.position[2], bias.time[time_buckets(torch.tensor(5000 - 0), 128)])


def test_hstu_on_rows_with_times_learns_the_time_bias_and_reads_the_times(tmp_path: Path) -> None:
    data = parquet(rows(tmp_path) / "train.parquet")
    assert data.features.sequences[0].timestamps == "hist_ts", "the command's rows declare their event times"
    model = hstu(data)
    blocks = [b for b in model.blocks if isinstance(b, HSTUBlock)]
    assert len(blocks) == 2 and all(b.bias.time is not None for b in blocks)
    wrapper = TrainWrapper(model, features=data.features)
    (batch,) = list(data.train_batches(0, 0, 1))
    loss, _ = wrapper(batch)
    loss.backward()
    for b in blocks:
        assert b.bias.time is not None and b.bias.time.grad is not None and b.bias.time.grad.abs().sum() > 0
    model.eval()
    kjt = batch.sparse_features
    with torch.no_grad():
        scores, _ = model(batch.dense_features, kjt)
        ts = kjt["hist_ts"].values()
        shuffled = ts[torch.randperm(ts.numel(), generator=torch.Generator().manual_seed(0))]
        again, _ = model(batch.dense_features, with_times(kjt, "hist_ts", shuffled))
        same, _ = model(batch.dense_features, with_times(kjt, "hist_ts", ts + 12345))
    assert not torch.allclose(scores, again), "shuffled event times change the scores"
    torch.testing.assert_close(scores, same, msg="only gaps matter: a shift of every time changes nothing")


def test_hstu_on_rows_without_times_uses_positions_only(tmp_path: Path) -> None:
    out = rows(tmp_path)
    table = pq.read_table(out / "train.parquet")
    meta = table.schema.metadata  # the stored schema, its group without event times
    kept = table.drop(["hist_ts"])
    stored = {k: v.replace(b'"timestamps": "hist_ts"', b'"timestamps": null') for k, v in (meta or {}).items()}
    pq.write_table(kept.replace_schema_metadata(stored), tmp_path / "untimed.parquet")
    data = parquet(tmp_path / "untimed.parquet")
    assert data.features.sequences[0].timestamps is None and "hist_ts" not in data.features.kjt_keys
    model = hstu(data)
    assert all(isinstance(b, HSTUBlock) and b.bias.time is None for b in model.blocks)
    loss, _ = TrainWrapper(model, features=data.features)(next(iter(data.train_batches(0, 0, 1))))
    loss.backward()
    assert torch.isfinite(loss)
