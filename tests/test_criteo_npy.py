"""``data=criteo_npy``: TorchRec's preprocessed Criteo days, written by TorchRec's own ``tsv_to_npys``, read into the same
rows TorchRec's ``InMemoryBinaryCriteoIterDataPipe`` yields (dense as they are, ids modulo the table sizes, labels), split
between ranks, trained on by ``model=dlrm``; mismatched days refused naming the file."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from torchrec.datasets.criteo import DEFAULT_CAT_NAMES, BinaryCriteoUtils, InMemoryBinaryCriteoIterDataPipe

from recsys_runner import evaluate
from recsys_runner.__main__ import run
from recsys_runner.config import validate
from recsys_runner.configurable import make
from recsys_runner.data import inspect as inspect_module
from recsys_runner.data.__main__ import main as data_main
from recsys_runner.data.files.criteo_config import CriteoNpyDataConfig
from recsys_runner.data.files.npy_source import NpySource
from recsys_runner.data.files.tabular import CriteoNpyData, ParquetData
from recsys_runner.data.files.tabular_config import ParquetDataConfig
from recsys_runner.data.generated.generate import write_criteo_tsv
from recsys_runner.data.inspect import BITMAP_IDS
from recsys_runner.errors import ConfigError, DataError
from recsys_runner.models.dlrm import DLRMConfig
from recsys_runner.paths import CONFIG_PATH

SIZES = [50 + 7 * i for i in range(26)]
"""Table sizes below the generated ids' spread, so the modulo matters."""
DAY_ROWS = (1500, 1100)
KINDS = ("dense", "sparse", "labels")


@pytest.fixture(scope="module")
def days(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two days in TorchRec's layout, written by TorchRec's ``tsv_to_npys`` from generated Criteo TSV."""
    root = tmp_path_factory.mktemp("npy")
    for day, rows in enumerate(DAY_ROWS):
        tsv = root / f"day_{day}.tsv"
        write_criteo_tsv(str(tsv), rows, seed=day, cardinality=5000)
        BinaryCriteoUtils.tsv_to_npys(str(tsv), *(str(root / f"day_{day}_{kind}.npy") for kind in KINDS))
        tsv.unlink()
    return root


def rows_of(batches) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Dense values, ids (a column per table, TorchRec's order) and labels of ``batches``, row after row."""
    batches = list(batches)
    dense = torch.cat([b.dense_features for b in batches]).numpy()
    ids = np.concatenate([np.stack([b.sparse_features[k].values().numpy() for k in DEFAULT_CAT_NAMES], axis=1) for b in batches])
    labels = torch.cat([b.labels.reshape(-1) for b in batches]).numpy()
    return dense, ids, labels


def in_row_order(rows: tuple[np.ndarray, ...]) -> list[np.ndarray]:
    """``rows`` (as :func:`rows_of`) sorted by their values: rows read in another order, aligned."""
    order = np.lexsort(np.concatenate([rows[0], rows[1], rows[2][:, None]], axis=1).T)
    return [r[order] for r in rows]


def npy_data(path: Path, **overrides) -> CriteoNpyData:
    return CriteoNpyData(make(CriteoNpyDataConfig, path=str(path), eval_path=str(path), batch_size=256, shuffle=False, drop_remainder=False,
                              num_embeddings_per_feature=SIZES, block_rows=400, **overrides))


def test_rows_equal_torchrec_datapipe(days: Path) -> None:
    """Every row as TorchRec's pipe yields it (with ``hashes``): in order on one rank, and two ranks' rows are those rows,
    each once. TSV ids ~5000 apart are taken modulo tables of 50-225 rows, and dense are not logged a second time."""
    paths = {kind: [str(days / f"day_{d}_{kind}.npy") for d in range(len(DAY_ROWS))] for kind in KINDS}
    pipe = InMemoryBinaryCriteoIterDataPipe("train", paths["dense"], paths["sparse"], paths["labels"], batch_size=300, rank=0,
                                            world_size=1, hashes=SIZES)
    want = rows_of(pipe)
    assert len(want[0]) == sum(DAY_ROWS) and want[1].max() < max(SIZES)
    data = npy_data(days)
    got = rows_of(data.train_batches(0, 0, 1))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    ranks = [rows_of(data.train_batches(0, r, 2)) for r in range(2)]
    assert all(0 < len(r[0]) < sum(DAY_ROWS) for r in ranks)
    both = tuple(np.concatenate([r[i] for r in ranks]) for i in range(3))
    for g, w in zip(in_row_order(both), in_row_order(want), strict=True):
        np.testing.assert_array_equal(g, w)


@pytest.fixture(scope="module")
def three_days(days: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``days`` and a third of an odd number of rows (day 1's first 1099, reversed), whose halves differ in size."""
    root = tmp_path_factory.mktemp("npy3")
    for f in days.glob("*.npy"):
        (root / f.name).write_bytes(f.read_bytes())
    for kind in KINDS:
        np.save(root / f"day_2_{kind}.npy", np.load(days / f"day_1_{kind}.npy")[:1099][::-1])
    return root


@pytest.mark.parametrize("half", ["val", "test"])
def test_last_day_halves_equal_torchrec_stages(three_days: Path, half: str) -> None:
    """``data.last_day=holdout``: training reads the days before the last, as TorchRec's ``train`` stage of them; the eval
    reads the last day's ``val`` (first ``ceil(1099 / 2)`` = 550 rows) or ``test`` half (549), row for row as TorchRec's
    stage of that name yields it (in order on one rank; two ranks' rows are those rows, each once)."""
    paths = {kind: [str(three_days / f"day_{d}_{kind}.npy") for d in range(3)] for kind in KINDS}

    def stage(name: str, days: slice) -> tuple[np.ndarray, ...]:
        return rows_of(InMemoryBinaryCriteoIterDataPipe(name, paths["dense"][days], paths["sparse"][days], paths["labels"][days],
                                                        batch_size=300, rank=0, world_size=1, hashes=SIZES))

    data = CriteoNpyData(make(CriteoNpyDataConfig, path=str(three_days), batch_size=256, shuffle=False, drop_remainder=False,
                              num_embeddings_per_feature=SIZES, block_rows=400, last_day="holdout", last_day_half=half))
    want = stage(half, slice(2, 3))
    assert len(want[0]) == (550 if half == "val" else 549)
    for g, w in zip(rows_of(data.eval_batches(0, 1)), want, strict=True):
        np.testing.assert_array_equal(g, w)
    both = tuple(np.concatenate(parts) for parts in zip(*(rows_of(data.eval_batches(r, 2)) for r in range(2)), strict=True))
    for g, w in zip(in_row_order(both), in_row_order(want), strict=True):
        np.testing.assert_array_equal(g, w)
    for g, w in zip(rows_of(data.train_batches(0, 0, 1)), stage("train", slice(0, 2)), strict=True):
        np.testing.assert_array_equal(g, w)
    splits = data.split_files()
    assert (splits["train"].num_rows, splits["eval"].num_rows, splits["eval"].files) == (sum(DAY_ROWS), len(want[0]), (paths["dense"][2],))


def test_last_day_holdout_refusals(days: Path, tmp_path: Path) -> None:
    """Eval rows from one place; a half without a held-out day; a single day to both train and hold out; an empty half."""
    with pytest.raises(ConfigError, match="data.last_day=holdout evaluates on halves of the last day of data.path, but "
                                          "data.eval_path is set too"):
        make(CriteoNpyDataConfig, path=str(days), eval_path=str(days), last_day="holdout")
    with pytest.raises(ConfigError, match="data.last_day=train holds no day out. Fix: data.last_day=holdout"):
        make(CriteoNpyDataConfig, path=str(days), last_day_half="test")
    with pytest.raises(DataError, match="holds only day 0"):
        CriteoNpyData(make(CriteoNpyDataConfig, path=f"{days}/day_0_*.npy", num_embeddings_per_feature=SIZES, last_day="holdout"))
    tiny = tmp_path / "one_row_last"
    tiny.mkdir()
    for kind in KINDS:
        np.save(tiny / f"day_0_{kind}.npy", np.load(days / f"day_0_{kind}.npy"))
        np.save(tiny / f"day_1_{kind}.npy", np.load(days / f"day_1_{kind}.npy")[:1])
    with pytest.raises(DataError, match=r"day_1_dense.npy: no rows of 1\), held out by data.last_day=holdout has no rows .* Fix: a last day with rows, or data.last_day=train"):
        CriteoNpyData(make(CriteoNpyDataConfig, path=str(tiny), num_embeddings_per_feature=SIZES, last_day="holdout", last_day_half="test"))
    config = make(CriteoNpyDataConfig, path=str(days), last_day="holdout")
    assert (config.for_evaluate().last_day_half, make(CriteoNpyDataConfig, path=str(days)).for_evaluate().last_day_half) == ("test", None)


def test_workers_read_the_same_rows(days: Path) -> None:
    """Two DataLoader workers (each a share of the blocks) read every row once: the source crosses to them whole."""
    alone, workers = (rows_of(npy_data(days, num_workers=n).train_batches(0, 0, 1)) for n in (0, 2))
    assert not np.array_equal(alone[0], workers[0])  # the workers' batches interleave: read apart
    for g, w in zip(in_row_order(workers), in_row_order(alone), strict=True):
        np.testing.assert_array_equal(g, w)


def test_dlrm_trains_on_npy_days(make_cfg, days: Path) -> None:
    cfg = make_cfg("data=criteo_npy", f"data.path={days}", "data.num_embeddings_per_feature=[" + ",".join(map(str, SIZES)) + "]",
                   "model=dlrm", "train.num_steps=8", "train.log_every_steps=4", "train.eval_every_steps=null",
                   "distributed.device=cpu", "data.batch_size=256", tiny=False)
    assert np.isfinite(run(cfg))


def copy_days(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.glob("*.npy"):
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


@pytest.mark.parametrize("broken, message", [
    (lambda d: (d / "day_1_sparse.npy").unlink(),
     r"day 1 has day_1_\w+\.npy but no day_1_sparse\.npy next to it .* each day is three files.*Fix: write day 1 again"),
    (lambda d: np.save(d / "day_0_labels.npy", np.zeros((7, 1), np.int32)),
     r"day 0's files differ in rows \(day_0_dense.npy: 1500, day_0_sparse.npy: 1500, day_0_labels.npy: 7\).*Fix: write the day again"),
    (lambda d: np.save(d / "day_1_dense.npy", np.zeros((1100, 12), np.float32)),
     r"day_1_dense\.npy holds an array of shape \(1100, 12\), but TorchRec's dense file of a Criteo day holds \[rows, 13\].*Fix"),
    (lambda d: np.save(d / "day_0_sparse.npy", np.zeros((1500, 26), np.float32)),
     r"day_0_sparse\.npy holds float32 values, but TorchRec's sparse file holds integers.*Fix"),
    (lambda d: np.save(d / "extra.npy", np.zeros(3)),
     r"extra\.npy is not named as TorchRec names its Criteo files \(day_<i>_dense\.npy.*Fix: rename it so, or remove it"),
])
def test_mismatched_days_name_the_file(days: Path, tmp_path: Path, broken, message: str) -> None:
    folder = copy_days(days, tmp_path / "days")
    broken(folder)
    with pytest.raises(DataError, match=message) as e:
        npy_data(folder)
    assert "\n" not in str(e.value)


def set_value(path: Path, row: int, column: int, value: float) -> None:
    """``path`` (an ``.npy`` file) with one value changed."""
    arr = np.load(path)
    arr.reshape(len(arr), -1)[row, column] = value
    np.save(path, arr)


@pytest.mark.parametrize("kind, column, value, named", [
    ("labels", 0, 3, r"day_1_labels\.npy, rows 0-399, row 7 of the file, column 'label': the label is 3"),
    ("dense", 2, np.nan, r"day_1_dense\.npy, rows 0-399, row 7 of the file, column 'int_2': the value is nan"),
])
def test_bad_value_names_the_file_holding_it(days: Path, tmp_path: Path, kind: str, column: int, value: float, named: str) -> None:
    """A bad label is told in the day's labels file (it named the dense file, the unit's, whatever the column)."""
    folder = copy_days(days, tmp_path / "days")
    set_value(folder / f"day_1_{kind}.npy", 7, column, value)
    with pytest.raises(DataError, match=r"^bad row in \S*" + named):
        list(npy_data(folder).train_batches(0, 0, 1))


def test_missing_folder_and_criteo_defaults(tmp_path: Path) -> None:
    """A DLRM user's defaults: no second log, ids modulo dlrm_main's 100000 rows; a folder without .npy files is refused."""
    config = make(CriteoNpyDataConfig, path=str(tmp_path))
    assert (config.dense_transform, config.num_embeddings, config.categorical_encoding) == ("none", 100_000, "mod")
    with pytest.raises(DataError, match=re.escape(str(tmp_path))):
        CriteoNpyData(config)


def test_inspect_describes_the_days(days: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``inspect --format criteo_npy``: rows per day, the label rate, distinct ids per column and their range, as the
    files hold them (the default format names the flag)."""
    assert data_main(["inspect", str(days), "--format", "criteo_npy"]) == 0
    out = capsys.readouterr().out
    labels = np.concatenate([np.load(days / f"day_{d}_labels.npy").reshape(-1) for d in range(len(DAY_ROWS))])
    sparse = np.concatenate([np.load(days / f"day_{d}_sparse.npy") for d in range(len(DAY_ROWS))])
    assert f"6 file(s), {sum(DAY_ROWS)} rows\n2 day(s): day 0 1500 rows, day 1 1100 rows\n" in out
    assert f"label 'label': rate {labels.mean():.4f}" in out
    assert re.search(rf"^cat_7 +int64 +0 +{len(np.unique(sparse[:, 7]))}$", out, re.M)
    assert f"ids (26 columns): lowest {sparse.min()}, highest {sparse.max()} (spread, not contiguous" in out
    assert data_main(["inspect", str(days)]) == 2
    assert "holds .npy files" in (err := capsys.readouterr().err) and "Fix: --format criteo_npy" in err


def test_inspect_sizes_contiguous_ids(days: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Ids made contiguous (TorchRec's 1TB preprocessing): the sizes that give each its own row."""
    folder = copy_days(days, tmp_path / "days")
    for d in range(len(DAY_ROWS)):
        np.save(folder / f"day_{d}_sparse.npy", np.load(folder / f"day_{d}_sparse.npy") % np.array(SIZES))
    assert data_main(["inspect", str(folder), "--format", "criteo_npy"]) == 0
    sizes = [int(np.load(folder / "day_0_sparse.npy")[:, i].max() + 1) for i in range(26)]  # day 0's 1500 rows fill every table
    assert f"data.num_embeddings_per_feature=[{','.join(map(str, sizes))}] gives every id a row of its own" in capsys.readouterr().out


@pytest.mark.parametrize("cap", [1_000_000, 900])
def test_inspect_counts_each_column_in_numpy(days: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch, cap: int) -> None:
    """Every column's distinct count as the files hold it (``np.unique`` of the whole column; past ``--max-distinct``
    only ``>cap``), counted in numpy, not in Python values: ids in a bitmap (contiguous, ``cat_0``), sorted (spread, the
    others), and a bitmap's ids sorted once a later day's ids go past it (``cat_1``)."""
    folder = copy_days(days, tmp_path / "days")
    for d in range(len(DAY_ROWS)):
        sparse = np.load(folder / f"day_{d}_sparse.npy")
        sparse[:, 0] %= SIZES[0]
        sparse[:, 1] = sparse[:, 1] % SIZES[1] + (BITMAP_IDS if d == 1 else 0)
        np.save(folder / f"day_{d}_sparse.npy", sparse)
    monkeypatch.setattr(inspect_module, "counted_values", None)  # Python sets of every value: 5-7x as long
    assert data_main(["inspect", str(folder), "--format", "criteo_npy", "--max-distinct", str(cap)]) == 0
    out = capsys.readouterr().out
    columns = {"label": np.concatenate([np.load(folder / f"day_{d}_labels.npy").reshape(-1) for d in range(len(DAY_ROWS))])}
    dense = np.concatenate([np.load(folder / f"day_{d}_dense.npy") for d in range(len(DAY_ROWS))])
    sparse = np.concatenate([np.load(folder / f"day_{d}_sparse.npy") for d in range(len(DAY_ROWS))])
    columns |= {f"int_{i}": dense[:, i] for i in range(13)} | {f"cat_{i}": sparse[:, i] for i in range(26)}
    for name, values in columns.items():
        n = len(np.unique(values))
        assert re.search(rf"^{name} +\S+ +0 +{n if n <= cap else f'>{cap}'}$", out, re.M), (name, n, out)
    assert any(len(np.unique(v)) > 900 for v in columns.values()) and len(np.unique(sparse[:, 0])) < 900


def test_convert_writes_the_rows_training_reads(days: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``convert --format criteo_npy``: a Parquet file per day holding the rows ``data=criteo_npy`` reads (ids modulo the
    sizes, dense as they are), which ``data=parquet`` reads back as the same batches; the default format names the flag."""
    out = tmp_path / "out"
    assert data_main(["convert", "--format", "criteo_npy", str(days), str(out), "--num-embeddings-per-feature",
                      ",".join(map(str, SIZES)), "--progress", "log"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["day_0.parquet", "day_1.parquet"]
    assert f"converted {sum(DAY_ROWS)} rows from 2 day(s)" in capsys.readouterr().out
    parquet = ParquetData(make(ParquetDataConfig, path=str(out), eval_path=str(out), batch_size=256, shuffle=False, drop_remainder=False))
    for g, w in zip(rows_of(parquet.train_batches(0, 0, 1)), rows_of(npy_data(days).train_batches(0, 0, 1)), strict=True):
        np.testing.assert_array_equal(g, w)
    assert data_main(["convert", str(days), str(tmp_path / "other")]) == 2
    assert "is a NumPy file, not Criteo's TSV" in (err := capsys.readouterr().err) and "Fix: --format criteo_npy" in err


README_1TB = {"embedding_dim": 128, "dense_arch_layer_sizes": [512, 256, 128], "over_arch_layer_sizes": [1024, 1024, 512, 256]}
"""torchrec_dlrm/README.MD's Criteo 1TB command for dlrm_main.py, as ``model.*`` (the final 1-unit layer is the model's)."""


def test_dlrm_criteo_npy_preset_carries_dlrm_main_settings_and_trains(make_cfg, days: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """``experiment=dlrm_criteo_npy`` as shipped: the README's sizes, SGD at lr 15, batch 2048, the 1TB table sizes, the
    last day held out; with smaller tables and batch it trains at the model's published sizes on TorchRec's files,
    evaluating on the last day's val half, and ``evaluate`` of its checkpoint scores the test half."""
    spec = validate(make_cfg("experiment=dlrm_criteo_npy", f"data.path={days}", "tracking=none", tiny=False))
    assert {k: getattr(spec.model, k) for k in README_1TB} == README_1TB and isinstance(spec.model, DLRMConfig)
    assert (spec.optim.lr, type(spec.optim.sparse).__name__, type(spec.optim.dense).__name__) == (15.0, "SparseSGDConfig", "DenseSGDConfig")
    assert (spec.data.batch_size, spec.train.num_epochs, spec.data.num_embeddings_per_feature[:3]) == (2048, 1, [45833188, 36746, 17245])
    assert isinstance(spec.data, CriteoNpyDataConfig) and (spec.data.last_day, spec.data.last_day_half) == ("holdout", None)
    halves: list[str] = []
    apart = NpySource.last_day_apart
    monkeypatch.setattr(NpySource, "last_day_apart", lambda self, half, key: (halves.append(half), apart(self, half, key))[1])
    overrides = ["experiment=dlrm_criteo_npy", f"data.path={days}", "data.num_embeddings_per_feature=[" + ",".join(map(str, SIZES)) + "]",
                 "data.batch_size=128", "data.num_workers=0", "train.num_epochs=null", "train.num_steps=4", "train.eval_max_batches=2",
                 "distributed.device=cpu", f"checkpoint.dir={tmp_path / 'ck'}", "tracking=none"]
    assert np.isfinite(run(make_cfg(*overrides, tiny=False)))
    with initialize_config_dir(config_dir=CONFIG_PATH, version_base="1.3"):
        metrics = evaluate.run(compose(config_name="evaluate", overrides=[*overrides, f"load={tmp_path / 'ck'}"]))
    assert np.isfinite(metrics["eval/auc"]) and set(halves) == {"val", "test"} and halves[-1] == "test", halves
