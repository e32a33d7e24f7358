"""Files whose labels break a funnel (``data.funnel``: a conversion positive where its click is 0), refused as the row is
read, naming the file, the row and both columns, with the key that declares the funnel and the fix (docs/data.md,
*Bad data*; docs/multitask.md, *ESMM*). ``model=esmm`` declares it; before, ESMM's batch check said only how many rows of
"this training batch" broke it, not which file or row."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recsys_runner.config import validate
from recsys_runner.data.generated.generate import write_funnel_parquet
from recsys_runner.errors import ConfigError, DataError

BAD_ROW = 1234


@pytest.fixture(scope="module")
def funnel_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A funnel Parquet file (``ctr: click``, ``cvr: conversion``, stored schema; row groups of 500 rows) and a copy whose
    row :data:`BAD_ROW` converts without a click; a small CSV of the same form with one such line."""
    root = tmp_path_factory.mktemp("funnel")
    write_funnel_parquet(str(root / "good.parquet"), 2000, row_group_rows=500)
    table = pq.read_table(root / "good.parquet")
    click = table.column("click").to_numpy().copy()
    conversion = table.column("conversion").to_numpy().copy()
    assert not ((conversion > 0) & (click == 0)).any() and click[BAD_ROW] in (0, 1)
    click[BAD_ROW], conversion[BAD_ROW] = 0, 1
    table = table.set_column(table.schema.get_field_index("click"), "click", pa.array(click))
    table = table.set_column(table.schema.get_field_index("conversion"), "conversion", pa.array(conversion))
    pq.write_table(table, root / "bad.parquet", row_group_size=500)
    rng = np.random.default_rng(0)
    lines = ["click,buy,user,price"]
    for i in range(40):
        c = int(rng.random() < 0.5)
        b = 1 if i == 17 else c * int(rng.random() < 0.5)
        lines.append(f"{0 if i == 17 else c},{b},u{i % 7},{rng.random():.3f}")
    (root / "bad.csv").write_text("\n".join(lines) + "\n")
    return {"root": root}


def _data(make_cfg, *overrides: str) -> Any:
    """The data module as ``model=esmm`` (or ``overrides``' model) gets it: ``for_model`` of the model's needs, built."""
    spec = validate(make_cfg("model=esmm", "model.tower_layer_sizes=[8]", "model.embedding_dim=8", "data.batch_size=256",
                             "data.shuffle=false", "data.num_workers=0", "tracking=none", *overrides, tiny=False))
    return spec.served_data.build(device="cpu")


def _read_all(data: Any) -> int:
    return sum(b.labels.shape[0] for b in data.train_batches(epoch=0, rank=0, world_size=1))


def test_a_conversion_without_a_click_in_parquet_is_refused_naming_file_row_and_columns(make_cfg, funnel_files: dict[str, Path]) -> None:
    root = funnel_files["root"]
    good = _data(make_cfg, "data=parquet", f"data.path={root}/good.parquet", f"data.eval_path={root}/good.parquet")
    assert good.config.funnel == ["ctr", "cvr"]  # model=esmm declared it, from model.click_label and model.conversion_label
    assert _read_all(good) == 1792  # 2000 rows, full batches of 256
    bad = _data(make_cfg, "data=parquet", f"data.path={root}/bad.parquet", f"data.eval_path={root}/good.parquet")
    with pytest.raises(DataError, match=(
            rf"bad row in {root}/bad.parquet, row group 2, row {BAD_ROW} of the file, column 'conversion': the label of task "
            rf"'cvr' is 1 where the label of task 'ctr' before it \(column 'click'\) is 0, but data.funnel=\['ctr', 'cvr'\] has "
            rf"each later label positive only on rows where the one before it is; .*model=esmm, which sets data.funnel from "
            rf"model.click_label and model.conversion_label.* unless model.conversion_without_click=and.*\. Fix the data, or set "
            rf"data.on_bad_rows=skip")):
        _read_all(bad)
    skipped = _data(make_cfg, "data=parquet", f"data.path={root}/bad.parquet", f"data.eval_path={root}/good.parquet",
                    "data.on_bad_rows=skip", "data.drop_remainder=false")
    assert _read_all(skipped) == 1999 and skipped._bad_rows == 1  # skipped and counted (data/bad_rows_skipped)


def test_a_csv_line_that_breaks_the_funnel_is_named_by_line(make_cfg, funnel_files: dict[str, Path]) -> None:
    root = funnel_files["root"]
    csv = ["data=csv", f"data.path={root}/bad.csv", f"data.eval_path={root}/bad.csv", "data.label=null",
           "data.labels={ctr: click, cvr: buy}", "data.sparse=[{name: user, num_embeddings: 10, encoding: hash}]", "data.dense=[{name: price}]",
           "data.batch_size=8"]
    with pytest.raises(DataError, match=rf"bad row in {root}/bad.csv, line 19, column 'buy': the label of task 'cvr' is 1 where "
                                        rf"the label of task 'ctr' before it \(column 'click'\) is 0"):
        _read_all(_data(make_cfg, *csv))
    # ESMM told to train on click AND conversion: no funnel declared, the row reads as it is
    lenient = _data(make_cfg, *csv, "model.conversion_without_click=and")
    assert lenient.config.funnel is None and _read_all(lenient) == 40
    # any multi-task model's labels may be declared a funnel
    mmoe = _data(make_cfg, *csv, "model=mmoe", "model.tasks=[ctr,cvr]", "data.funnel=[ctr,cvr]")
    with pytest.raises(DataError, match=r"line 19, column 'buy'.*data.funnel=\['ctr', 'cvr'\]"):
        _read_all(mmoe)


@pytest.mark.parametrize(("overrides", "message"), [
    (["data.funnel=[ctr]"], r"data.funnel=\['ctr'\] must name two or more distinct label tasks"),
    (["data.funnel=[ctr,buy]"], r"data.funnel=\['ctr', 'buy'\] names task\(s\) \['buy'\] that the data's labels lack \(its label "
                                r"tasks: \['ctr', 'cvr'\]\).*Fix: give the data those labels"),
    (["data.funnel=[ctr,cvr]", "data.label_kinds={cvr: regression}"], r"data.funnel=\['ctr', 'cvr'\] holds tasks that are not binary"),
])
def test_a_funnel_of_tasks_the_data_lacks_is_a_config_error(make_cfg, funnel_files: dict[str, Path], overrides: list[str],
                                                             message: str) -> None:
    root = funnel_files["root"]
    with pytest.raises(ConfigError, match=message):
        _data(make_cfg, "model=mmoe", "model.tasks=[ctr,cvr]", "data=csv", f"data.path={root}/bad.csv", "data.label=null",
              "data.labels={ctr: click, cvr: buy}", "data.sparse=[{name: user, num_embeddings: 10, encoding: hash}]", "data.dense=[{name: price}]",
              *overrides)
