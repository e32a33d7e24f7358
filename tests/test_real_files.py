"""Real files as good as synthetic ones. Id columns sized from the data: a vocabulary plus out-of-vocabulary rows, so ids unseen in training never share a
row with seen ones; ``data=criteo`` sized from its files; text layouts detected (MovieLens' two); ``data.delimiter``
spellings; and a file-data run prints no more warnings than a synthetic one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir

from recsys_runner.__main__ import run
from recsys_runner.config import register_configs, validate
from recsys_runner.configurable import make
from recsys_runner.data.files.tabular import CsvData
from recsys_runner.data.files.tabular_config import CsvDataConfig
from recsys_runner.data.generated.generate import write_criteo_tsv, write_movielens_ratings
from recsys_runner.errors import DataError
from recsys_runner.paths import CONFIG_PATH


def _ids(data: CsvData, feature: str, batches) -> np.ndarray:
    return np.concatenate([b.sparse_features[feature].values().numpy() for b in batches])


def test_unseen_users_read_oov_rows_never_a_seen_users_row(tmp_path: Path) -> None:
    """A cold-start split: the training file's users and the eval file's users are disjoint for 85% of the eval rows."""
    rng = np.random.default_rng(0)
    train_users = rng.integers(0, 300, 3000)
    cold = rng.random(1000) < 0.85
    eval_users = np.where(cold, rng.integers(1000, 1600, 1000), rng.integers(0, 300, 1000))
    for name, users in (("train.csv", train_users), ("eval.csv", eval_users)):
        lines = [f"{u},{(u * 7 + i) % 50},{int((u + i) % 3 == 0)}" for i, u in enumerate(users)]
        (tmp_path / name).write_text("user,item,click\n" + "\n".join(lines) + "\n")
    data = CsvData(make(CsvDataConfig, path=str(tmp_path / "train.csv"), eval_path=str(tmp_path / "eval.csv"), batch_size=100,
                        num_workers=0, shuffle=False, infer={"oov_buckets": 8}))
    user = next(c for c in data.schema.sparse if c.name == "user")
    seen = len(set(train_users.tolist()))
    assert user.encoding == "vocab" and user.oov_buckets == 8 and user.num_embeddings == seen + 8
    train_rows = _ids(data, "user", data.train_batches(0, 0, 1))
    eval_rows = _ids(data, "user", data.eval_batches(0, 1))
    assert set(train_rows.tolist()) <= set(range(seen))  # every training user has a row of its own...
    by_user = dict(zip(eval_users.tolist(), eval_rows.tolist(), strict=True))
    unseen_rows = {r for u, r in by_user.items() if u >= 1000}
    seen_rows = {r for u, r in by_user.items() if u < 1000}
    assert unseen_rows <= set(range(seen, seen + 8)) and len(unseen_rows) > 1  # ...and unseen ones share the OOV rows
    assert not unseen_rows & seen_rows  # no seen user's row is read by an unseen user
    # a seen user keeps its training row at eval time
    first_train_row = dict(zip(train_users.tolist()[: len(train_rows)], train_rows.tolist(), strict=True))
    assert all(first_train_row[u] == r for u, r in by_user.items() if u in first_train_row)


def test_plain_criteo_sizes_its_tables_from_the_files(make_cfg, tmp_path: Path) -> None:
    write_criteo_tsv(str(tmp_path / "day_0.tsv"), 1000, cardinality=50)
    spec = validate(make_cfg("data=criteo", f"data.path={tmp_path}/day_0.tsv", "data.num_workers=0", tiny=False))
    assert spec.data.num_embeddings is None  # type: ignore[attr-defined]
    data = spec.data.build(device="cpu")
    sizes = [f.num_embeddings for f in data.features.sparse]
    assert len(sizes) == 26 and all(s <= 50 + 16 for s in sizes), sizes  # <= 50 values each + 16 OOV rows, not 100 000
    assert all(c.encoding == "vocab" and c.hex for c in data.schema.sparse)
    fixed = validate(make_cfg("data=criteo", f"data.path={tmp_path}/day_0.tsv", "data.num_embeddings=1000", tiny=False)).data
    assert fixed.build(device="cpu").features.sparse[0].num_embeddings == 1000


def test_movielens_preset_reads_ratings_csv_as_is(make_cfg, tmp_path: Path) -> None:
    write_movielens_ratings(str(tmp_path / "ratings.csv"), 3000, layout="ratings.csv")
    cfg = make_cfg("experiment=movielens", f"data.path={tmp_path}/ratings.csv", "distributed.device=cpu", "checkpoint=none",
                   "data.num_workers=0", tiny=False)
    data = validate(cfg).data.build(device="cpu")
    assert isinstance(data, CsvData) and data.csv.delimiter == "," and data.csv.header is True
    assert data.features.sparse_names == ["user", "item"] and all(c.encoding == "vocab" for c in data.schema.sparse)
    assert run(cfg) > 0.7


def test_a_misread_layout_names_the_delimiter_and_header_it_detected(tmp_path: Path) -> None:
    write_movielens_ratings(str(tmp_path / "ratings.csv"), 200, layout="ratings.csv")
    config = make(CsvDataConfig, path=str(tmp_path / "ratings.csv"), label="rating", label_threshold=4.0, delimiter="\t", header=False,
                  column_names=["user", "item", "rating", "timestamp"], num_workers=0, infer={"exclude": ["timestamp"]})
    with pytest.raises(DataError, match=r"1 field\(s\) by data.delimiter='\\t', but data.column_names names 4 columns.*detected: "
                                        r"delimiter 'comma', a header line \(userId, movieId, rating, timestamp\).*"
                                        r"Fix: data.delimiter=comma data.header=true"):
        CsvData(config)
    (tmp_path / "r.csv").write_text((tmp_path / "ratings.csv").read_text())
    with pytest.raises(DataError, match=r"it names columns, but data.header=false reads it as data. Fix: data.header=true"):
        CsvData(make(CsvDataConfig, path=str(tmp_path / "r.csv"), label="rating", label_threshold=4.0, header=False,
                     column_names=["user", "item", "rating", "timestamp"], num_workers=0))


@pytest.mark.parametrize("override", ["data.delimiter=comma", "data.delimiter=\\,", "data.delimiter=','", "data.delimiter=null"])
def test_a_comma_delimiter_the_hydra_ways(tmp_path: Path, override: str) -> None:
    register_configs()
    with initialize_config_dir(config_dir=CONFIG_PATH, version_base="1.3"):
        cfg = compose(config_name="config", overrides=["data=csv", f"data.path={tmp_path}/x.csv", override, "tracking=none"])
    assert validate(cfg).data.delimiter == ("," if override != "data.delimiter=null" else None)  # type: ignore[attr-defined]


@pytest.mark.slow
def test_a_file_data_run_prints_no_more_warnings_than_a_synthetic_one(tmp_path: Path, mlflow_uri: str) -> None:
    """Each run is its own ``python -m recsys_runner`` (warnings are printed once per process); the three are independent,
    so they run side by side: an interpreter's start is mostly one core's work."""
    write_movielens_ratings(str(tmp_path / "u.data"), 2000)
    write_criteo_tsv(str(tmp_path / "train.txt"), 2000)
    common = ["distributed.device=cpu", "checkpoint=none", f"tracking.uri={mlflow_uri}", "data.num_workers=0"]
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    runs = {
        "synthetic": ["train.num_steps=10", "data.num_train_rows=8192", "data.num_eval_rows=2048", "data.num_embeddings=1000"],
        "movielens": ["experiment=movielens", f"data.path={tmp_path}/u.data"],
        "criteo_tsv": ["experiment=criteo_tsv", f"data.path={tmp_path}/train.txt"],
    }
    procs = {}
    for name, args in runs.items():
        with open(tmp_path / f"{name}.log", "w") as log:  # a file each: no pipe fills while another is read
            procs[name] = subprocess.Popen([sys.executable, "-m", "recsys_runner", *args, *common, f"hydra.run.dir={tmp_path}/{name}"],
                                           cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    warnings = {}
    try:
        for name, proc in procs.items():
            code = proc.wait(timeout=300)
            out = (tmp_path / f"{name}.log").read_text()
            assert code == 0, (name, out[-2000:])
            warnings[name] = [line for line in out.splitlines() if "Warning" in line]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for preset in ("movielens", "criteo_tsv"):
        assert len(warnings[preset]) <= len(warnings["synthetic"]), (preset, warnings)
