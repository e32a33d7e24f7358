"""Data and config mistakes as the CLI reports them: ``Data error: …`` / ``Config error: …`` on stderr, exit 2,
no traceback, and the message naming the file, line and column and the fix. A data error during training
ends the MLflow run FAILED.

Each test runs on a tiny generated file (40 rows, batches of 4, 2 steps). Two run ``python -m recsys_runner`` to see
what the command prints (an error raised mid-training and one raised while the run is built); the others call what it
calls (``recsys_runner.__main__.run``) in-process: the CLI prints any :class:`~recsys_runner.errors.UserError` as
``<label>: <message>`` with exit 2 and no traceback, so each asserts that kind of error and its message.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from mlflow.tracking import MlflowClient

from recsys_runner.__main__ import run
from recsys_runner.configurable import make
from recsys_runner.data.__main__ import main as data_main
from recsys_runner.data.files.tabular import CsvData
from recsys_runner.data.files.tabular_config import CsvDataConfig
from recsys_runner.errors import ConfigError, UserError
from tests.conftest import run_cli

ROWS = 40
ITEM = "data.sparse=[{name: item, num_embeddings: 10}]"
BASE = ["data.batch_size=4", "data.shuffle=false", "train.num_steps=2", "train.log_every_steps=1",
        "train.eval_every_steps=null", "distributed.device=cpu", "checkpoint=none"]


def write_csv(path: Path, bad_line: int | None = None, bad_text: str = "", delimiter: str = ",") -> Path:
    """``label,item,price`` with ``ROWS`` good rows; line ``bad_line`` (1-based, header is line 1) replaced by ``bad_text``."""
    lines = ["label,item,price", *(f"{i % 2},{i % 10},{i * 0.5}" for i in range(ROWS))]
    if bad_line is not None:
        lines[bad_line - 1] = bad_text
    path.write_text("".join(line.replace(",", delimiter) + "\n" for line in lines))
    return path


def cli(tmp_path: Path, *overrides: str, data: str = "csv", tracking: list[str] | None = None) -> str:
    """Run the CLI in ``tmp_path``; assert it failed the documented way and return its stderr."""
    out = run_cli(f"data={data}", *BASE, *overrides, *(tracking or ["tracking=none"]), cwd=tmp_path, timeout=240)
    assert out.returncode == 2, f"exit {out.returncode}\n{out.stderr[-4000:]}"
    assert "Traceback" not in out.stderr and "Error executing job" not in out.stderr, out.stderr[-4000:]
    return out.stderr


def error(make_cfg, *overrides: str, data: str = "csv", tracked: bool = False) -> str:
    """Run in-process what the CLI runs; assert it failed with a :class:`UserError` and return the line the CLI prints
    for it. ``tracked``: in this test's MLflow experiment (``make_cfg``'s), else ``tracking=none``."""
    with pytest.raises(UserError) as raised:
        run(make_cfg(f"data={data}", *BASE, *overrides, *([] if tracked else ["tracking=none"]), tiny=False))
    return f"{raised.value.label}: {raised.value}"


def only_run_status(uri: str, experiment: str) -> str:
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return run.info.status


def test_id_beyond_int64_names_line_column_and_hashing(tmp_path: Path, mlflow_uri: str) -> None:
    path = write_csv(tmp_path / "ids.csv", bad_line=6, bad_text="1,9223372036854775808,1.0")
    err = cli(tmp_path, f"data.path={path}", f"data.eval_path={write_csv(tmp_path / 'eval.csv')}", ITEM,
              tracking=[f"tracking.uri={mlflow_uri}", "tracking.experiment=cli_int64"])
    assert f"Data error: bad row in {path}, line 6, column 'item': '9223372036854775808' does not fit in a signed 64-bit integer" in err
    assert "data.sparse[item].encoding=hash" in err and "docs/data.md" in err
    assert only_run_status(mlflow_uri, "cli_int64") == "FAILED"  # the error came mid-training, after the run started


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["model=dcn_v2", "model.embedding_dim=7"], "model.embedding_dim=7"),
        (["data.sparse=[{name: item, num_embeddings: 10, embedding_dim: 6}]"], "data.sparse[item].embedding_dim=6"),
    ],
)
def test_embedding_dim_not_a_multiple_of_4(make_cfg, tmp_path: Path, overrides: list[str], key: str) -> None:
    err = error(make_cfg, f"data.path={write_csv(tmp_path / 'a.csv')}", ITEM, *overrides)
    assert f"Config error: {key} is not a multiple of 4: fbgemm's fused embedding kernels" in err
    assert "Fix: use a multiple of 4, e.g." in err and "AssertionError" not in err


def test_epoch_without_a_full_step_after_skipping_says_how_many_rows(make_cfg, tmp_path: Path, mlflow_uri: str) -> None:
    path = tmp_path / "labels.csv"
    path.write_text("label,item\n" + "".join(f"2,{i % 10}\n" for i in range(ROWS)))  # every label bad
    err = error(make_cfg, f"data.path={path}", f"data.eval_path={write_csv(tmp_path / 'eval.csv')}", ITEM, "data.on_bad_rows=skip",
                tracked=True)
    assert ("Data error: epoch 0 gave rank 0 no full training step of 4 rows (data.batch_size=4 x train.grad_accum_steps=1): "
            f"its share of data.path='{path}' was {ROWS} training rows, and {ROWS} of them were bad rows skipped") in err
    assert "with data.on_bad_rows=fail the run stops at the first one" in err
    assert only_run_status(mlflow_uri, make_cfg().tracking.experiment) == "FAILED"


def test_epoch_smaller_than_a_batch(make_cfg, tmp_path: Path) -> None:
    path = write_csv(tmp_path / "small.csv")
    err = error(make_cfg, f"data.path={path}", f"data.eval_path={path}", ITEM, "data.batch_size=64")
    assert f"no full training step of 64 rows (data.batch_size=64 x train.grad_accum_steps=1): its share of data.path='{path}' was {ROWS} " in err
    assert "Fix: more data, or a smaller data.batch_size" in err


def test_nan_field_is_reported_as_nan(make_cfg, tmp_path: Path) -> None:
    path = write_csv(tmp_path / "nan.csv", bad_line=6, bad_text="1,3,nan")
    err = error(make_cfg, f"data.path={path}", f"data.eval_path={path}", ITEM, "data.dense=[{name: price}]")
    assert f"Data error: bad row in {path}, line 6, column 'price': the value is nan, not a finite number" in err


def test_nan_label_is_reported_as_nan_not_missing(make_cfg, tmp_path: Path) -> None:
    path = write_csv(tmp_path / "nanlabel.csv", bad_line=4, bad_text="nan,3,1.0")
    err = error(make_cfg, f"data.path={path}", f"data.eval_path={path}", ITEM)
    assert f"Data error: bad row in {path}, line 4, column 'label': the label is nan, but the task is binary" in err


def test_parquet_file_given_to_data_csv(make_cfg, tmp_path: Path) -> None:
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"label": [0, 1] * 20, "item": list(range(10)) * 4}), path)
    err = error(make_cfg, f"data.path={path}", ITEM)
    assert f"Data error: {path} looks like a Parquet file (it begins with Parquet's magic bytes PAR1)" in err
    assert f"Fix: use data=parquet data.path={path}" in err


def test_csv_file_given_to_data_parquet(make_cfg, tmp_path: Path) -> None:
    path = write_csv(tmp_path / "t.csv")
    err = error(make_cfg, f"data.path={path}", ITEM, data="parquet")
    assert f"Data error: {path} is not a Parquet file" in err and "first line 'label,item,price'" in err and "Fix: use data=csv" in err


def test_tsv_read_with_comma_delimiter_says_set_tab(make_cfg, tmp_path: Path) -> None:
    path = write_csv(tmp_path / "t.tsv", delimiter="\t")
    err = error(make_cfg, f"data.path={path}", ITEM)
    assert f"Data error: {path} has no column 'label': its header line is one column, 'label\\titem\\tprice'" in err
    assert "the file looks tab-separated, but data.delimiter=','. Fix: set data.delimiter='\\t'" in err


def test_the_suggested_tab_delimiter_works(tmp_path: Path) -> None:
    """``data.delimiter='\\t'`` on the command line reaches the config as backslash + t, which means a tab."""
    assert CsvDataConfig(path="x", delimiter="\\t").delimiter == "\t"
    path = write_csv(tmp_path / "t.tsv", delimiter="\t")
    data = CsvData(make(CsvDataConfig, path=str(path), eval_path=str(path), batch_size=4, shuffle=False, delimiter="\\t", sparse=[{"name": "item", "num_embeddings": 10}]))
    assert next(iter(data.train_batches(0, 0, 1))).sparse_features.values().tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("command", ["convert", "inspect", "sequences"])
def test_a_delimiter_of_several_characters_is_a_config_error_with_the_way_to_read_movielens(
        command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """MovieLens ml-1m separates fields by '::': the data commands handed it to Arrow's parser, which ended them with a
    traceback (``ValueError: only single character unicode strings …``); now each says what to do, as data.delimiter does."""
    path = tmp_path / "ratings.dat"
    path.write_text("user::item::rating::timestamp\n1::1193::5::978300760\n2::661::3::978302109\n")
    args = {"convert": [str(path), str(tmp_path / "out"), "--format", "csv"], "inspect": [str(path), "--format", "csv"],
            "sequences": [str(path), str(tmp_path / "out")]}[command]
    assert data_main([command, *args, "--delimiter", "::"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("Config error: --delimiter must be one character, got '::'. Fix: --delimiter comma") and "Traceback" not in err
    assert "MovieLens ml-1m's '::', is one character once rewritten: sed 's/::/\\t/g' ratings.dat > ratings.tsv" in err
    assert "iconv -f latin1 -t utf-8" in err
    with pytest.raises(ConfigError, match=r"data.delimiter must be one character, got '::'.*data.delimiter=null to detect it.*"
                                          r"MovieLens ml-1m's '::'"):
        CsvDataConfig(path="x", delimiter="::")


def test_inspect_takes_the_delimiters_names(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``inspect --delimiter tab`` (or pipe, semicolon …) as ``convert`` and ``data.delimiter`` take them: it handed the name to
    Arrow's parser, which refused it with a traceback."""
    path = write_csv(tmp_path / "t.tsv", delimiter="\t")
    assert data_main(["inspect", str(path), "--format", "csv", "--delimiter", "tab"]) == 0
    assert "40 rows" in capsys.readouterr().out


def test_inspect_of_a_folder_says_which_of_its_files_it_leaves_unread(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``inspect d`` counts d's own files, not those of its subdirectories; training says so at INFO, but the data commands
    left Python's default level (WARNING) in place, so inspect's counts covered part of the data without a word. The
    logger's state is restored after the command (tests call it in process)."""
    import logging

    (tmp_path / "d" / "day=2").mkdir(parents=True)
    write_csv(tmp_path / "d" / "a.csv")
    write_csv(tmp_path / "d" / "day=2" / "b.csv")
    logger = logging.getLogger("recsys_runner")
    before = logger.level, logger.propagate, list(logger.handlers)
    assert data_main(["inspect", str(tmp_path / "d"), "--format", "csv"]) == 0
    captured = capsys.readouterr()
    assert "40 rows" in captured.out
    assert f"INFO path='{tmp_path / 'd'}': its files are read, not its 1 subdirectories (day=2); to read theirs too, name them " \
           f"with a glob" in captured.err, captured.err
    assert (logger.level, logger.propagate, list(logger.handlers)) == before


def test_inspect_of_a_text_file_without_format_names_format_csv(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``inspect ratings.csv`` reads Parquet by default: it was Arrow's traceback ("Parquet magic bytes not found")."""
    path = write_csv(tmp_path / "ratings.csv")
    assert data_main(["inspect", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"Data error: {path} is not a Parquet file (it does not begin with PAR1), and inspect reads Parquet "
                          "unless --format says otherwise. Fix: --format csv") and "Traceback" not in err


def test_convert_with_a_label_not_in_the_header_names_the_flag_and_the_closest_column(tmp_path: Path,
                                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """``convert --label labl``: the schema was inferred and printed around the typo, then the training settings' message
    ("correct the column names in data.label(s) / data.dense / data.sparse") named no flag."""
    path = write_csv(tmp_path / "r.csv")
    assert data_main(["convert", "--format", "csv", str(path), str(tmp_path / "out"), "--label", "labl"]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"Data error: --label 'labl' is not a column of {path}: its header lists ['label', 'item', "
                                   "'price'] (did you mean label?). Fix: --label label") and "schema inferred" not in captured.out


def test_convert_into_a_file_or_under_one_is_refused_before_reading(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An output that is a file, or under one, was os.makedirs' raw FileExistsError/NotADirectoryError traceback."""
    path = write_csv(tmp_path / "r.csv")
    assert data_main(["convert", "--format", "csv", str(path), str(path)]) == 2
    assert capsys.readouterr().err.startswith(f"Config error: the output folder {path} is a file. Fix: name a folder")
    assert data_main(["convert", "--format", "csv", str(path), str(path / "out")]) == 2
    assert capsys.readouterr().err.startswith(f"Config error: the output folder {path / 'out'} cannot be written: a file is in "
                                              f"the place of its parent folder {path}. Fix: move or remove {path}, or another output folder")


def test_convert_of_a_csv_without_format_names_format_csv(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """convert reads Criteo's TSV by default: a CSV was a bad row whose fix was 'set data.delimiter', a training key."""
    path = write_csv(tmp_path / "r.csv")
    assert data_main(["convert", str(path), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.startswith(f"Data error: {path} is not Criteo's TSV (its first line has no tab: "
                                              "'label,item,price'), which convert reads unless --format says otherwise. "
                                              "Fix: --format csv")


def test_file_level_error_at_startup_is_a_data_error_with_exit_2(tmp_path: Path) -> None:
    """Raised in the data module's constructor, while the run is being built; a column spelled close to the one asked for
    is named (a preset's ``click`` on a copy whose header says ``is_clicked`` was a list of 24 names to search)."""
    path = write_csv(tmp_path / "cols.csv")
    err = cli(tmp_path, f"data.path={path}", "data.sparse=[{name: itme, num_embeddings: 10}]")
    assert (f"Data error: {path} has no column 'itme'; its header lists ['label', 'item', 'price'] (did you mean 'item'?). Fix: "
            "correct the column names") in err


def test_inspect_of_a_text_file_cut_short_names_the_line_or_the_compression(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A download cut short — a plain file ending in a partial line, a gzip file without its end — was Arrow's traceback
    (``ArrowInvalid: CSV parse error: Expected 3 columns, got 1``, ``OSError: Truncated compressed stream``), where
    training names the file, the line and the fix."""
    import gzip

    text = write_csv(tmp_path / "full.csv").read_bytes()
    (tmp_path / "cut.csv").write_bytes(text[:-6])  # the last line ends before its price: 1,9
    (tmp_path / "cut.csv.gz").write_bytes(gzip.compress(text * 50)[:-40])
    assert data_main(["inspect", str(tmp_path / "cut.csv"), "--format", "csv"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"Data error: bad row in {tmp_path / 'cut.csv'}, line 41: expected 3 fields separated by ',', found 2 "
                          "('1,9'); inspect stops at it") and "Traceback" not in err
    assert data_main(["inspect", str(tmp_path / "cut.csv.gz"), "--format", "csv"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"Data error: {tmp_path / 'cut.csv.gz'} cannot be decompressed as gzip (") and "gzip -t" in err
    assert "remove it from the files inspected" in err and "Traceback" not in err
    # convert reads its own positional paths: its fix named data.path, a training run's key
    assert data_main(["convert", "--format", "csv", str(tmp_path / "cut.csv.gz"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"Data error: {tmp_path / 'cut.csv.gz'} cannot be decompressed as gzip (") and "data.path" not in err
    assert err.rstrip().endswith("or remove it from convert's inputs")
    (tmp_path / "bad.csv.gz").write_bytes(b"\x00\x01" * 300)  # not gzip from its first byte
    assert data_main(["convert", "--format", "csv", str(tmp_path / "bad.csv.gz"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "does not begin as a gzip file does" in err and err.rstrip().endswith("or remove it from convert's inputs")


def test_sequences_reads_a_log_without_a_header_line_by_column_names(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """MovieLens' u.data and ml-1m's ratings.dat (once its '::' are tabs) have no header line: ``sequences`` took the first
    event for the column names and answered ``has no column(s) ['user', …]; its columns are ['196', '242', '3', …]. Fix: name
    the log's columns with --user …`` — no flag could name them. ``--column-names`` does, and both errors say so."""
    from recsys_runner.data.generated.generate import write_movielens_ratings

    log = tmp_path / "u.data"
    write_movielens_ratings(str(log), 600, num_users=40, num_items=60)
    flags = ["--delimiter", "tab", "--user", "user", "--item", "item", "--time", "timestamp"]
    assert data_main(["sequences", str(log), str(tmp_path / "out"), *flags]) == 2
    err = capsys.readouterr().err
    assert f"{log} has no column(s) ['user', 'item', 'timestamp']" in err and "is data, not a header naming the columns" in err
    assert "Fix: name its 4 columns in file order with --column-names, e.g. --column-names user,item,rating,timestamp" in err
    dat = tmp_path / "ratings.dat"
    dat.write_text(log.read_text().replace("\t", "::"))
    assert data_main(["sequences", str(dat), str(tmp_path / "out"), *flags, "--column-names", "user,item,rating,timestamp"]) == 2
    assert "Its fields are separated by '::' (MovieLens ml-1m's ratings.dat)" in capsys.readouterr().err
    names = ["--column-names", "user,item,rating,timestamp"]
    assert data_main(["sequences", str(log), str(tmp_path / "out"), *flags, *names, "--label", "rating", "--label-threshold", "4"]) == 0
    assert f"read 600 events from {log}; no exact duplicates" in capsys.readouterr().out
    assert sum(pq.read_metadata(p).num_rows for p in (tmp_path / "out").glob("*.parquet")) == 600  # every line an event
    assert data_main(["sequences", str(log), str(tmp_path / "out2"), *flags, "--column-names", "user,item,rating"]) == 2
    assert "lacks ['timestamp']" in capsys.readouterr().err


def test_column_names_of_another_length_than_every_line_is_told_at_start(tmp_path: Path) -> None:
    """data.column_names naming fewer columns than every line holds — ml-1m's ratings.dat read with data.delimiter=':' (7
    fields, every other one empty), or a file of 5 columns named 3 — left every sampled line out as a bad row, and the
    run said ``left out 'user': empty in the sample``, as if the column held nothing."""
    from recsys_runner.errors import DataError

    (tmp_path / "ratings.dat").write_text("1::1193::5::978300760\n1::661::3::978302109\n2::914::3::978301968\n")
    names = ["user", "item", "rating", "timestamp"]
    with pytest.raises(DataError, match=r"its fields are separated by '::', which data.delimiter=':' splits into 7 fields, every "
                                        r"other one empty, where data.column_names names 4 columns .*Fix: .*sed 's/::/\\t/g'"):
        CsvData(make(CsvDataConfig, path=str(tmp_path / "ratings.dat"), delimiter=":", header=False, column_names=names,
                     label="rating", label_threshold=4))
    (tmp_path / "five.csv").write_text("1,2,3,4,5\n0,5,6,7,8\n1,2,2,2,2\n")
    with pytest.raises(DataError, match=r"split into 5 field\(s\) by data.delimiter=',', but data.column_names names 3 columns "
                                        r".*Fix: data.column_names naming all 5 columns in file order"):
        CsvData(make(CsvDataConfig, path=str(tmp_path / "five.csv"), header=False, column_names=["label", "u", "i"]))
