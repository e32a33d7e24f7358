"""The experiment presets (``experiment=criteo_tsv|avazu_csv|movielens``) each train one epoch on a generated file in
their public layout (``recsys_runner/data/generated/generate.py``; never real data)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from recsys_runner.__main__ import run
from recsys_runner.config import RunConfig, validate
from recsys_runner.data.generated.generate import write_avazu_csv, write_criteo_tsv, write_movielens_ratings
from recsys_runner.data.schema import DenseColumn, SparseColumn
from recsys_runner.paths import CONFIG_PATH


def preset_cfg(make_cfg, experiment: str, path: Path, *overrides: str):
    return make_cfg(f"experiment={experiment}", f"data.path={path}", "distributed.device=cpu", "checkpoint=none",
                    "data.num_workers=0", *overrides, tiny=False)


@pytest.mark.parametrize(
    ("experiment", "write", "name", "overrides", "auc"),
    [pytest.param("criteo_tsv", lambda p: write_criteo_tsv(str(p), 4000), "train.txt", [], 0.58, marks=pytest.mark.slow),
     ("avazu_csv", lambda p: write_avazu_csv(str(p), 4000), "train.csv", [], 0.55),
     ("movielens", lambda p: write_movielens_ratings(str(p), 4000), "u.data", [], 0.7),
     ("movielens", lambda p: write_movielens_ratings(str(p), 4000, layout="ratings.csv"), "ratings.csv",
      ["data.delimiter=comma", "data.header=true", "data.column_names=null"], 0.7),
     ("movielens", lambda p: write_movielens_ratings(str(p), 4000, layout="ratings.csv"), "ratings.csv", [], 0.7)],
    ids=["criteo_tsv", "avazu_csv", "movielens_u.data", "movielens_ratings.csv", "movielens_ratings.csv_detected"],
)
def test_preset_trains_one_epoch_on_its_layout(make_cfg, tmp_path: Path, experiment: str, write, name: str,
                                               overrides: list[str], auc: float) -> None:
    write(tmp_path / name)
    cfg = preset_cfg(make_cfg, experiment, tmp_path / name, *overrides)
    spec = validate(cfg)
    assert spec.train.num_epochs == 1 and spec.train.num_steps is None and spec.model.embedding_dim == 8
    features = spec.data.build(device="cpu").features
    if experiment == "avazu_csv":
        assert "id" not in features.sparse_names and {"hour", "C1", "C14", "site_id", "device_ip"} <= set(features.sparse_names)
        assert features.num_dense == 0
    if experiment == "movielens":
        assert features.num_dense == 0 and len(features.sparse_names) == 2
    assert run(cfg) > auc


def test_criteo_preset_sizes_tables_from_the_file(make_cfg, tmp_path: Path) -> None:
    write_criteo_tsv(str(tmp_path / "train.txt"), 1000, cardinality=50)
    data = validate(preset_cfg(make_cfg, "criteo_tsv", tmp_path / "train.txt")).data.build(device="cpu")
    sizes = [f.num_embeddings for f in data.features.sparse]
    # the sample is the whole file: a vocabulary of each column's <= 50 values + data.infer.oov_buckets (16) rows
    assert len(sizes) == 26 and all(s <= 50 + 16 for s in sizes), sizes
    assert all(isinstance(c, SparseColumn) and c.encoding == "vocab" and c.hex and c.oov_buckets == 16 for c in data.schema.sparse)
    assert all(isinstance(d, DenseColumn) and d.transform == "log1p" for d in data.schema.dense)
    assert re.fullmatch(r"cat_\d+", data.features.sparse_names[-1])


@pytest.mark.parametrize("preset", sorted(p.stem for p in (Path(CONFIG_PATH) / "experiment").glob("*.yaml")))
@pytest.mark.parametrize("tracking", ["mlflow", "none"])
def test_every_preset_composes_and_validates(make_cfg, preset: str, tracking: str) -> None:
    """Each ``experiment=<preset>`` composes and passes every schema check as shipped (the file presets with a path),
    also with tracking off: a preset names its MLflow experiment, which ``tracking=none`` ignores."""
    cfg = make_cfg(f"experiment={preset}", f"tracking={tracking}", tiny=False)
    if "tabular" in str(cfg.data._target_):  # a preset for your own files: any path validates
        cfg = make_cfg(f"experiment={preset}", f"tracking={tracking}", "data.path=train.parquet", tiny=False)
    assert isinstance(validate(cfg), RunConfig)
