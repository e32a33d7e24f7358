"""The experiment presets (``experiment=criteo_tsv|avazu_csv|movielens``) each train one epoch on a generated file in
their public layout (``recsys_runner/data/generated/generate.py``; never real data)."""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from recsys_runner.__main__ import objective, run
from recsys_runner.build import build
from recsys_runner.config import GROUPS, RunConfig, validate
from recsys_runner.data.__main__ import main as data_main
from recsys_runner.data.files.tabular_config import ParquetDataConfig
from recsys_runner.data.generated.generate import write_avazu_csv, write_criteo_tsv, write_funnel_parquet, write_movielens_ratings
from recsys_runner.data.schema import DenseColumn, SparseColumn
from recsys_runner.models.dcn_v2 import DCNv2Config
from recsys_runner.models.deepfm import DeepFMConfig
from recsys_runner.models.dlrm import DLRMConfig
from recsys_runner.models.sasrec import SASRecConfig
from recsys_runner.paths import CONFIG_PATH
from recsys_runner.train.loop import train
from tests.test_evaluate import compose_entry
from tests.test_interaction_models import one_thread


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


def test_columns_sized_alike_are_logged_once_in_the_inferred_schema_line(make_cfg, tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    """``data=criteo`` on a file whose 26 columns each got the same size: the line said it 26 times (~1800 characters
    for a 20000-row file), above the schema that lists every column anyway; now once, naming the run of columns."""
    write_criteo_tsv(str(tmp_path / "train.txt"), 300, cardinality=4)
    with caplog.at_level(logging.INFO, logger="recsys_runner.data.files.tabular"):
        validate(preset_cfg(make_cfg, "criteo_tsv", tmp_path / "train.txt")).data.build(device="cpu")
    (line,) = [r.getMessage().split("\n")[0] for r in caplog.records if r.getMessage().startswith("data schema of")]
    assert "inferred (26 columns cat_0 … cat_25: num_embeddings=20 (vocabulary of 4 + 16 OOV rows) each). To keep" in line, line
    assert line.count("num_embeddings=") == 1 and len(line) < 400, line


@pytest.mark.parametrize("preset", sorted(p.stem for p in (Path(CONFIG_PATH) / "experiment").glob("*.yaml")))
@pytest.mark.parametrize("tracking", ["mlflow", "none"])
def test_every_preset_composes_and_validates(make_cfg, preset: str, tracking: str) -> None:
    """Each ``experiment=<preset>`` composes and passes every schema check as shipped (the file presets with a path),
    also with tracking off: a preset names its MLflow experiment, which ``tracking=none`` ignores; those of
    :data:`PRESET_BEST` train one epoch and keep the best checkpoint by their metric."""
    cfg = make_cfg(f"experiment={preset}", f"tracking={tracking}", tiny=False)
    if "tabular" in str(cfg.data._target_):  # a preset for your own files: any path validates (set as data.path=train.parquet
        cfg.data.path = "train.parquet"  # would set it, without composing again)
    spec = validate(cfg)
    assert isinstance(spec, RunConfig)
    assert set(PRESET_BEST) <= set(PRESETS), "a preset of PRESET_BEST was renamed"
    if preset in PRESET_BEST:  # they train one epoch and keep the best checkpoint by the preset's own metric
        assert spec.checkpoint.best_metric == PRESET_BEST[preset] and spec.train.num_epochs == 1


PRESET_BEST = {"deepfm_criteo": "eval/auc", "dlrm_criteo": "eval/auc", "dcn_v2_criteo": "eval/auc", "wide_deep_criteo": "eval/auc",
               "mmoe_taobao": "eval/ctr/auc", "dssm_taobao": "eval/recall_at_50"}
"""Presets whose best-checkpoint metric is checked (tests/test_training_features.py checked them apart before)."""


# --- presets compose with model= and data= (issue 30) ------------------------------------------------------------------
# A preset's own file sets no model key and only data keys its documented data options share; what is for one model or
# one data option lives in conf/experiment/model/<preset>_<model>.yaml or conf/experiment/data/<preset>_<data>.yaml,
# which conf/config.yaml applies only with that option.

EXPERIMENT = Path(CONFIG_PATH) / "experiment"
PRESETS = sorted(p.stem for p in EXPERIMENT.glob("*.yaml"))
FILE_PATHS = {"criteo_tsv": "data.path=train.txt", "avazu_csv": "data.path=train.csv", "movielens": "data.path=u.data"}

PRESET_MODELS = [  # every preset x model that a preset's YAML or docs/ document
    ("criteo_tsv", "deepfm", 8), ("criteo_tsv", "lr", None), ("criteo_tsv", "fm", 8), ("criteo_tsv", "dlrm", 8),
    ("avazu_csv", "deepfm", 8), ("avazu_csv", "lr", None), ("avazu_csv", "fm", 8),
    ("movielens", "deepfm", 8), ("movielens", "lr", None), ("movielens", "fm", 8),  # docs/models.md: fm for MovieLens
]
"""``(preset, model, embedding_dim the preset gives it)``; docs/models.md: lr and fm are the baselines on these samples."""

ITEMS = ["data.items.path=items.parquet", "data.items.id=item_id"]
TAOBAO_LABELS = ["data.path=/data/taobao/", "data.labels={ctr: click, cvr: buy}"]
PRESET_DATA = {  # the presets' documented data= uses (their YAML comments, docs/sequences.md, docs/retrieval.md, docs/storage.md)
    "sasrec_movielens-parquet": ["experiment=sasrec_movielens", "data=parquet", "data.path=ml-1m-histories/"],
    "hstu_movielens-parquet": ["experiment=hstu_movielens", "data=parquet", "data.path=ml_users/train.parquet",
                               "data.eval_path=ml_users/valid.parquet"],
    "bst_taobao-parquet": ["experiment=bst_taobao", "data=parquet", "data.path=out/train.parquet", "data.eval_path=out/eval.parquet"],
    "din_taobao-parquet": ["experiment=din_taobao", "data=parquet", "data.path=out/train.parquet", "data.eval_path=out/eval.parquet"],
    "mmoe_taobao-parquet": ["experiment=mmoe_taobao", "data=parquet", *TAOBAO_LABELS],
    "mmoe_taobao-csv": ["experiment=mmoe_taobao", "data=csv", *TAOBAO_LABELS],
    "ple_taobao-parquet": ["experiment=ple_taobao", "data=parquet", *TAOBAO_LABELS],
    "dbmtl_taobao-parquet": ["experiment=dbmtl_taobao", "data=parquet", *TAOBAO_LABELS],
    "dssm_taobao-parquet": ["experiment=dssm_taobao", "data=parquet", "data.path=clicks/", "model.user_features=[user_id,age_level]",
                            "model.item_features=[adgroup_id,cate_id]"],
    "dssm_negatives-parquet": ["experiment=dssm_negatives", "data=parquet", "data.path=clicks/", *ITEMS, "data.items.features=[cate_id]",
                               "model.user_features=[user_id]", "model.item_features=[item_id,cate_id]"],
    "dssm_uniform_negatives-parquet": ["experiment=dssm_uniform_negatives", "data=parquet", "data.path=clicks/", *ITEMS,
                                       "data.items.features=[cate_id]", "model.user_features=[user_id]",
                                       "model.item_features=[item_id,cate_id]"],
    "dssm_hard_negatives-parquet": ["experiment=dssm_hard_negatives", "data=parquet", "data.path=clicks/", *ITEMS,
                                    "data.negatives.hard_column=shown_items", "model.user_features=[user_id]",
                                    "model.item_features=[item_id]"],
    "mind_taobao-parquet": ["experiment=mind_taobao", "data=parquet", "data.path=out/train.parquet", "data.eval_path=out/eval.parquet",
                            *ITEMS, "data.items.features=[cate_id]", "model.user_features=[hist_item_id,hist_cate_id]",
                            "model.item_features=[item_id,cate_id]"],
    "deepfm_criteo-criteo": ["experiment=deepfm_criteo", "data=criteo", "data.path=day_0"],
    "xdeepfm_criteo-criteo": ["experiment=xdeepfm_criteo", "data=criteo", "data.path=day_0"],
    "autoint_criteo-criteo": ["experiment=autoint_criteo", "data=criteo", "data.path=day_0"],
    "dcn_criteo-criteo": ["experiment=dcn_criteo", "data=criteo", "data.path=day_0"],
    "hstu_rank_taobao-parquet": ["experiment=hstu_rank_taobao", "data=parquet", "data.path=out/train.parquet",
                                 "data.eval_path=out/eval.parquet"],
    "esmm_taobao-parquet": ["experiment=esmm_taobao", "data=parquet", *TAOBAO_LABELS],
    "deepfm_criteo-parquet": ["experiment=deepfm_criteo", "data=parquet", "data.path=s3://my-bucket/criteo/train/*.parquet",
                              "data.eval_path=s3://my-bucket/criteo/eval/", "checkpoint.dir=s3://my-bucket/runs/deepfm-1"],
}


@pytest.mark.parametrize(("preset", "model", "width"), PRESET_MODELS, ids=[f"{p}-{m}" for p, m, _ in PRESET_MODELS])
def test_a_preset_composes_with_each_model_it_documents(make_cfg, preset: str, model: str, width: int | None) -> None:
    """``experiment=criteo_tsv model=lr`` (and fm, dlrm; movielens with fm) composes, validates and keeps the preset's other
    settings; the model gets the preset's settings for it, or its own defaults."""
    run = validate(make_cfg(f"experiment={preset}", f"model={model}", FILE_PATHS[preset], "tracking=none", tiny=False))
    assert type(run.model) is GROUPS["model"][model]
    assert getattr(run.model, "embedding_dim", None) == width
    assert run.optim.lr == 0.02 and run.data.batch_size == 128 and run.train.num_epochs == 1
    if isinstance(run.model, DeepFMConfig):
        assert run.model.deep_layer_sizes == [128, 64]
    if isinstance(run.model, DLRMConfig):
        assert run.model.over_arch_layer_sizes == [128, 64]


def test_a_model_the_preset_has_no_settings_for_keeps_its_own_defaults(make_cfg) -> None:
    run = validate(make_cfg("experiment=criteo_tsv", "model=dcn_v2", FILE_PATHS["criteo_tsv"], "tracking=none", tiny=False))
    assert isinstance(run.model, DCNv2Config) and run.model.embedding_dim == DCNv2Config().embedding_dim
    assert run.optim.lr == 0.02  # the rest of the preset holds


@pytest.mark.parametrize("overrides", list(PRESET_DATA.values()), ids=list(PRESET_DATA))
def test_a_preset_composes_with_each_data_option_it_documents(make_cfg, overrides: list[str]) -> None:
    """``experiment=sasrec_movielens data=parquet`` and the other documented uses compose and validate; the keys only the
    preset's generated data has (``max_len``, ``hard_negatives``) stay with it."""
    run = validate(make_cfg(*overrides, "tracking=none", tiny=False))
    assert type(run.data).__name__ == {"parquet": "ParquetDataConfig", "csv": "CsvDataConfig", "criteo": "CriteoDataConfig"}[
        overrides[1].removeprefix("data=")]
    assert not hasattr(run.data, "max_len") and not hasattr(run.data, "hard_negatives")
    if isinstance(run.model, SASRecConfig):
        assert run.data.batch_size == 128 and run.model.num_blocks == 2
    if overrides[0] == "experiment=dssm_hard_negatives":
        assert isinstance(run.data, ParquetDataConfig)
        assert run.data.negatives.hard_column == "shown_items" and run.data.negatives.num_negatives == 256


@pytest.mark.parametrize(("preset", "key", "value"), [("sasrec_movielens", "max_len", 200), ("dssm_hard_negatives", "hard_negatives", 8)])
def test_a_presets_own_generated_data_keeps_its_settings(make_cfg, preset: str, key: str, value: int) -> None:
    assert getattr(validate(make_cfg(f"experiment={preset}", "tracking=none", tiny=False)).data, key) == value


def _split(stem: str, options: list[str]) -> tuple[str, str]:
    """``<preset>_<option>`` → ``(preset, option)``; exactly one way, else the file would apply to no or two choices."""
    found = [(p, stem.removeprefix(f"{p}_")) for p in PRESETS if stem.startswith(f"{p}_") and stem.removeprefix(f"{p}_") in options]
    assert len(found) == 1, f"conf/experiment/.../{stem}.yaml must be <preset>_<option> for one preset {PRESETS} and option {options}"
    return found[0]


def _option_schema(group: str, option: str) -> type:
    """The schema ``conf/<group>/<option>.yaml`` extends (``/schema/<group>/<name>@_here_``)."""
    defaults = OmegaConf.load(Path(CONFIG_PATH) / group / f"{option}.yaml").get("defaults", [])
    (name,) = [d.split("/")[-1].split("@")[0] for d in defaults if isinstance(d, str) and d.startswith(f"/schema/{group}/")]
    return GROUPS[group][name]


def test_presets_keep_option_specific_keys_in_their_option_files() -> None:
    """The rule that lets ``model=``/``data=`` change under any preset: no preset file sets a model key (every model key is
    one model's); each option file names one preset and one option, and holds only keys that option's schema has."""
    for preset in PRESETS:
        body = OmegaConf.load(EXPERIMENT / f"{preset}.yaml")
        assert "model" not in body, f"conf/experiment/{preset}.yaml sets model.*: move it to conf/experiment/model/{preset}_<model>.yaml"
    models, data = sorted(p.stem for p in (Path(CONFIG_PATH) / "model").glob("*.yaml")), \
        sorted(p.stem for p in (Path(CONFIG_PATH) / "data").glob("*.yaml"))
    blocks = {"model": models, "data": data}
    seen: dict[str, set[str]] = {"model": set(), "data": set()}
    for group, options in blocks.items():
        for path in sorted((EXPERIMENT / group).glob("*.yaml")):
            preset, option = _split(path.stem, options)
            seen[group].add(preset)
            fields = {f.name for f in dataclasses.fields(_option_schema(group, option))}
            extra = set(OmegaConf.load(path)) - fields
            assert not extra, f"{path.name}: {sorted(extra)} are not keys of {group}={option}"
    assert seen["model"] == set(PRESETS)  # every preset tunes its own model
    assert seen["data"] == {"sasrec_movielens", "hstu_movielens", "dssm_hard_negatives", "dlrm_criteo_npy"}


def test_baselines_build_under_the_criteo_preset(make_cfg, tmp_path: Path) -> None:
    """``experiment=criteo_tsv`` with lr, fm and dlrm builds data and model on a generated Criteo file."""
    write_criteo_tsv(str(tmp_path / "train.txt"), 400, cardinality=30)
    for model in ("lr", "fm", "dlrm"):
        spec = validate(preset_cfg(make_cfg, "criteo_tsv", tmp_path / "train.txt", f"model={model}", "tracking=none"))
        data = spec.served_data.build(device="cpu")
        built = spec.model.build(features=data.features, dense_device=torch.device("cpu"))
        assert sum(p.numel() for p in built.parameters() if not p.is_meta) > 0


def test_movielens_preset_trains_fm(make_cfg, tmp_path: Path) -> None:
    """docs/models.md's advice for MovieLens, ``experiment=movielens model=fm``, trains one epoch and learns."""
    write_movielens_ratings(str(tmp_path / "u.data"), 3000)
    assert run(preset_cfg(make_cfg, "movielens", tmp_path / "u.data", "model=fm", "tracking=none")) > 0.7


# --- the zoo's presets (issue 32) on their real data's layout ----------------------------------------------------------

ZOO_PUBLISHED = {  # each preset's model keys as its YAML maps them from the paper or example it cites
    "xdeepfm_criteo": {"embedding_dim": 12, "cin_layer_sizes": [200, 200, 200], "deep_layer_sizes": [400, 400]},
    "autoint_criteo": {"embedding_dim": 16, "num_layers": 3, "num_heads": 2, "attention_dim": 32, "deep_layer_sizes": [400, 400]},
    "dcn_criteo": {"embedding_dim": 16, "num_cross_layers": 6, "deep_layer_sizes": [1024, 1024]},
    "hstu_rank_taobao": {"embedding_dim": 64, "num_layers": 3, "num_heads": 4, "time_buckets": 128, "deep_layer_sizes": [512]},
    "esmm_taobao": {"embedding_dim": 16, "tower_layer_sizes": [360, 200, 80], "cvr_weight": 0.0},
}
ZOO_BATCH = {"xdeepfm_criteo": 4096, "autoint_criteo": 1024, "dcn_criteo": 512, "hstu_rank_taobao": 8192, "esmm_taobao": 8192}


def write_taobao_events(path: Path, num_events: int, seed: int = 0) -> None:
    """A Taobao-style click log (``user_id, adgroup_id, cate_id, time_stamp, clk``): each user browses two categories,
    and clicks ads of the one browsed last more often."""
    rng = np.random.default_rng(seed)
    lines = ["user_id,adgroup_id,cate_id,time_stamp,clk"]
    for event in range(num_events):
        user = int(rng.integers(60))
        cate = (user + int(rng.integers(2)) * 7) % 12
        lines.append(f"{user},{cate * 10 + int(rng.integers(10))},{cate},{1_494_000_000 + 37 * event},{int(rng.random() < 0.2 + 0.4 * (cate == user % 12))}")
    path.write_text("\n".join(lines) + "\n")


def zoo_layout(tmp_path: Path, preset: str) -> list[str]:
    """The preset's real-data layout, generated: a Criteo TSV; ``data sequences`` output of a Taobao click log; a Taobao
    funnel file with ``click`` and ``buy`` columns. The data options the preset's YAML documents for it."""
    if preset.endswith("_criteo"):
        write_criteo_tsv(str(tmp_path / "train.txt"), 600, cardinality=50)
        return ["data=criteo", f"data.path={tmp_path / 'train.txt'}"]
    if preset == "hstu_rank_taobao":
        write_taobao_events(tmp_path / "events.csv", 1200)
        assert data_main(["sequences", str(tmp_path / "events.csv"), str(tmp_path / "out"), "--user", "user_id", "--item", "adgroup_id",
                          "--time", "time_stamp", "--side", "cate_id", "--label", "clk"]) == 0
        return ["data=parquet", f"data.path={tmp_path / 'out' / 'train.parquet'}", f"data.eval_path={tmp_path / 'out' / 'eval.parquet'}"]
    write_funnel_parquet(str(tmp_path / "taobao.parquet"), 600, labels={"ctr": "click", "cvr": "buy"}, row_group_rows=200)
    return ["data=parquet", f"data.path={tmp_path / 'taobao.parquet'}", "data.labels={ctr: click, cvr: buy}"]


@pytest.mark.parametrize("preset", sorted(ZOO_PUBLISHED))
def test_a_zoo_preset_trains_at_its_published_sizes_on_its_real_data_layout(tmp_path: Path, preset: str) -> None:
    """The preset as shipped carries the cited sizes and batch; with only the documented ``data=`` (and a small batch and
    two steps), the published model builds on that layout (Criteo's 13 + 26 columns, a Taobao history with event times,
    a click and a conversion), trains and evaluates."""
    shipped = OmegaConf.load(EXPERIMENT / f"{preset}.yaml")  # composed as shipped: test_every_preset_composes_and_validates
    assert (shipped.data.batch_size, shipped.train.num_epochs, shipped.optim.lr) == (ZOO_BATCH[preset], 1, 0.001)
    cfg = compose_entry("config", f"experiment={preset}", *zoo_layout(tmp_path, preset), "data.batch_size=64", "data.num_workers=0",
                        "train.num_epochs=null", "train.num_steps=2", "train.eval_max_batches=1", "distributed.device=cpu",
                        f"checkpoint.dir={tmp_path / 'ck'}", "tracking=none")
    c = build(validate(cfg))
    try:
        assert {k: getattr(c.run.model, k) for k in ZOO_PUBLISHED[preset]} == ZOO_PUBLISHED[preset]
        features = c.loop.data.features
        if preset.endswith("_criteo"):
            assert (features.num_dense, len(features.sparse_names)) == (13, 26)
        if preset == "hstu_rank_taobao":
            (group,) = features.sequences
            assert group.features == ("hist_item_id", "hist_cate_id") and group.timestamps == "hist_ts"
        if preset == "esmm_taobao":
            assert features.label_names == ("ctr", "cvr")
        with one_thread():
            final = train(c.loop)
    finally:
        c.close()
    assert 0.0 < objective(final, None) < 1.0
