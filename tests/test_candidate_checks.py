"""What a two-tower run checks of its eval rows when it is built looks at the items the full-corpus eval ranks
(``train.candidates.catalogue_candidates``: the catalogue less the ``data sequences`` id mapping's OOV rows), not at the
whole item table: an eval row whose item is an OOV row is a miss, counted in one warning, whether or not the items file
lists the OOV rows; a rankable item the catalogue lacks is an error; ``model.eval_negatives`` is refused only when a
query's seen *candidates* leave too few to draw, as the eval's draw counts them."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hydra import compose, initialize_config_dir

from recsys_runner import evaluate
from recsys_runner.__main__ import run as train
from recsys_runner.config import register_configs
from recsys_runner.data.sequences.mapping import load_mapping
from recsys_runner.errors import ConfigError, DataError
from recsys_runner.paths import CONFIG_PATH
from tests.test_evaluate import compose_entry
from tests.test_sequence_rows import distinct_times_log, run_sequences

OOV_ROWS, COLD, KEPT = 16, 3, 3
"""The item table's OOV rows; eval rows whose item is one of them; history events kept per eval row."""


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, int]:
    """``data sequences`` rows (item table: the mapping's items, then ``OOV_ROWS`` OOV rows) whose eval file has ``COLD``
    rows of an OOV item (as rows encoded with an older mapping hold), every history cut to its last ``KEPT`` events, and
    row 5's history led by 3 OOV items: the folder, the mapping's item count and the most rankable items one eval row has
    seen besides its own (by brute force)."""
    root = tmp_path_factory.mktemp("candidate_checks")
    out = run_sequences(root, distinct_times_log(num_users=40, seed=7), "rows", "--max-len", "6", "--oov-buckets", str(OOV_ROWS))
    items = len(load_mapping(str(out))["item"])
    table = pq.read_table(out / "eval.parquet")
    own = table["item_id"].to_pylist()
    own[:COLD] = [items + 1 + i for i in range(COLD)]
    hist = [h[-KEPT:] for h in table["hist_item_id"].to_pylist()]
    ts = [t[-KEPT:] for t in table["hist_ts"].to_pylist()]
    hist[5], ts[5] = [items + 4, items + 5, items + 6, *hist[5]], [ts[5][0]] * 3 + ts[5]
    changed = table.set_column(table.schema.get_field_index("item_id"), "item_id", pa.array(own, pa.int64()))
    changed = changed.set_column(changed.schema.get_field_index("hist_item_id"), "hist_item_id", pa.array(hist, pa.list_(pa.int64())))
    changed = changed.set_column(changed.schema.get_field_index("hist_ts"), "hist_ts", pa.array(ts, pa.list_(pa.int64())))
    pq.write_table(changed.replace_schema_metadata(table.schema.metadata), out / "eval.parquet")
    most = max(len({h for h in seen if h < items and h != item}) for seen, item in zip(hist, own, strict=True))
    listed = max(len({h for h in seen if h != item}) for seen, item in zip(hist, own, strict=True))  # OOV rows counted
    assert listed > most, "row 5 has seen more rows of an items file listing the OOV rows than candidates"
    return out, items, most


def _catalogue(root: Path, ids: np.ndarray, name: str) -> Path:
    pq.write_table(pa.table({"item_id": ids.astype(np.int64)}), root / name)
    return root / name


def _overrides(out: Path, items: Path, *more: str) -> list[str]:
    return ["model=dssm", "model.user_features=[user_id,hist_item_id]", "model.item_features=[item_id]", "model.tower_layer_sizes=[8]",
            "model.eval_metrics=[recall@20,mrr]", "model.corpus_chunk_rows=16", "data=parquet", f"data.path={out}/train.parquet",
            f"data.eval_path={out}/eval.parquet", f"data.items.path={items}", "data.items.id=item_id", "data.batch_size=16",
            "train.num_steps=4", "train.eval_every_steps=null", "distributed.device=cpu", "tracking=none",
            f"checkpoint.dir={items.parent}/ck_{items.stem}", *more]


def _train(overrides: list[str]) -> None:
    register_configs()
    with initialize_config_dir(config_dir=CONFIG_PATH, version_base="1.3"):
        train(compose(config_name="config", overrides=overrides))


def _said(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "eval rows' items" in r.getMessage()]


def test_eval_rows_of_oov_items_are_misses_said_once_whatever_rows_the_items_file_lists(
        rows: tuple[Path, int, int], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    out, items, _ = rows
    mapped = _catalogue(tmp_path, np.arange(items), "mapped.parquet")  # the mapping's items only
    every = _catalogue(tmp_path, np.arange(items + OOV_ROWS), "every.parquet")  # every table row: the OOV rows too
    with caplog.at_level(logging.WARNING):
        _train(_overrides(out, mapped))
    said = _said(caplog)
    assert len(said) == 1 and said[0].startswith(f"{COLD} eval rows' items (item_id) are past the {items} item ids of the id "
                                                 f"mapping in {out}"), said
    (step,) = sorted((tmp_path / "ck_mapped").glob("step_*"))[-1:]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        from_mapped = evaluate.run(compose_entry("evaluate", *_overrides(out, mapped), f"load={step}"))
        from_every = evaluate.run(compose_entry("evaluate", *_overrides(out, every), f"load={step}"))
    assert from_mapped == from_every, "the same items ranked, the same metrics"
    assert len(_said(caplog)) == 2 and all(s.startswith(f"{COLD} eval rows'") for s in _said(caplog)), _said(caplog)


def test_a_rankable_eval_item_the_catalogue_lacks_is_an_error(rows: tuple[Path, int, int], tmp_path: Path) -> None:
    out, items, _ = rows
    missing = pq.read_table(out / "eval.parquet")["item_id"][COLD].as_py()
    lacking = _catalogue(tmp_path, np.setdiff1d(np.arange(items + OOV_ROWS), [missing]), "lacking.parquet")
    with pytest.raises(DataError, match=rf"eval row .*eval\.parquet.*: its item {missing} \(column 'item_id'\) is not in the item "
                                        rf"table .*lacking\.parquet \(data\.items\.path\).*Fix: add the item"):
        _train(_overrides(out, lacking))


def test_eval_negatives_are_checked_against_the_seen_candidates(rows: tuple[Path, int, int], tmp_path: Path) -> None:
    """Row 5 has seen 3 OOV rows that the items file lists: not candidates, so they leave the draw as many items as before."""
    out, items, most = rows
    every = _catalogue(tmp_path, np.arange(items + OOV_ROWS), "every.parquet")
    free = items - 1 - most
    with pytest.raises(ConfigError, match=rf"model.eval_negatives={free + 1} .*the catalogue has {items} items and an eval query "
                                          rf"has seen {most} of them besides its own item \(hist_item_id\), leaving {free} to draw "
                                          rf"from. Fix: model.eval_negatives<={free}"):
        _train(_overrides(out, every, f"model.eval_negatives={free + 1}"))
    _train(_overrides(out, every, f"model.eval_negatives={free}"))
