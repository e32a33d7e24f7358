"""Compressed text files (gzip, bz2, zstd) read as streams: the rows, inferred schema, vocabularies and eval split of
the same plain file, whole files shared exactly between ranks and workers, Criteo's day files, an object store; a
damaged file named with its compression; eval files laid out otherwise than the training files (``data.eval_header``);
and the warning of an epoch of few steps."""

from __future__ import annotations

import bz2
import gzip
import logging
import uuid
from pathlib import Path

import fsspec
import pyarrow as pa
import pytest

from recsys_runner.build import FEW_EPOCH_STEPS, _total_steps, build
from recsys_runner.config import validate
from recsys_runner.configurable import make
from recsys_runner.data.files import compression
from recsys_runner.data.files.criteo_config import CriteoDataConfig
from recsys_runner.data.files.tabular import CriteoData, CsvData
from recsys_runner.data.files.tabular_config import CsvDataConfig
from recsys_runner.data.generated.generate import write_criteo_tsv
from recsys_runner.errors import ConfigError, DataError

CODECS = {"gzip": ".gz", "bz2": ".bz2", "zstd": ".zst"}
COLUMNS = {"label": "label", "dense": [{"name": "price"}], "sparse": [{"name": "rid", "num_embeddings": 5000}]}
"""Explicit columns: ``rid`` is the row's id, so every row can be followed through shards."""


def text_rows(first: int, n: int, header: bool = True, last_newline: bool = True) -> bytes:
    """Rows ``label,price,rid,user,item`` with ``rid`` = ``first`` .. ``first + n - 1``."""
    lines = ["label,price,rid,user,item"] if header else []
    lines += [f"{(i * 7) % 3 == 0:d},{i % 13 * 0.5},{i},u{i % 37},{i * 11 % 101}" for i in range(first, first + n)]
    return ("\n".join(lines) + ("\n" if last_newline else "")).encode()


def compressed(path: Path, text: bytes, codec: str) -> Path:
    """``text`` written to ``path`` + the codec's suffix: gzip and bz2 by Python's own modules (as the command-line tools
    write them), zstd by Arrow."""
    target = path.with_name(path.name + CODECS[codec])
    if codec == "gzip":
        target.write_bytes(gzip.compress(text))
    elif codec == "bz2":
        target.write_bytes(bz2.compress(text))
    else:
        with pa.output_stream(str(target), compression="zstd") as f:
            f.write(text)
    return target


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decompressed chunks of a few hundred bytes, so a file's lines cross many chunk ends."""
    monkeypatch.setattr(compression, "STREAM_CHUNK_BYTES", 333)


def rids(batches) -> list[int]:
    return [i for b in batches for i in b.sparse_features["rid"].values().tolist()]


def everything(batches) -> list[tuple]:
    """Every value of every batch: labels, dense and each sparse feature's values and lengths."""
    out = []
    for b in batches:
        kjt = b.sparse_features
        out.append((b.labels.tolist(), b.dense_features.tolist(), kjt.keys(), kjt.values().tolist(), kjt.lengths().tolist()))
    return out


@pytest.mark.parametrize("codec", CODECS)
def test_a_compressed_csv_reads_like_the_plain_file(tmp_path: Path, codec: str) -> None:
    """The schema inferred from a sample (a vocabulary for ``user`` and ``item``), the hash-split eval rows and every
    batch's values are those of the same file uncompressed (whose last line has no newline)."""
    text = text_rows(0, 700, last_newline=False)
    plain = tmp_path / "a.csv"
    plain.write_bytes(text)
    args = {"label": "label", "batch_size": 32, "eval_fraction": 0.2, "shuffle": False, "drop_remainder": False, "block_rows": 50}
    ours = CsvData(make(CsvDataConfig, path=str(compressed(plain, text, codec)), **args))
    theirs = CsvData(make(CsvDataConfig, path=str(plain), **args))
    assert ours.schema == theirs.schema
    assert {c.name: c.encoding for c in ours.schema.sparse} == {"user": "vocab", "item": "vocab"}
    assert len(ours._train.units) == 1 and len(theirs._train.units) == 14, "a compressed file is one unit, read as a stream"
    assert everything(ours.train_batches(0, 0, 1)) == everything(theirs.train_batches(0, 0, 1))
    assert everything(ours.eval_batches(0, 1)) == everything(theirs.eval_batches(0, 1))
    assert ours.num_train_batches(1) == theirs.num_train_batches(1)


def test_compressed_files_are_shared_exactly_over_two_ranks_and_their_workers(tmp_path: Path) -> None:
    """Two compressed files and a plain one, 2 ranks × 2 DataLoader workers: each row of an epoch on exactly one
    (rank, worker), eval rows apart; with ``drop_remainder`` every rank the same number of full batches."""
    compressed(tmp_path / "a.csv", text_rows(0, 600), "gzip")
    compressed(tmp_path / "b.csv", text_rows(600, 400), "zstd")
    (tmp_path / "c.csv").write_bytes(text_rows(1000, 300))
    args = {"path": str(tmp_path), "batch_size": 16, "eval_fraction": 0.2, "num_workers": 2, "block_rows": 100, **COLUMNS}
    data = CsvData(make(CsvDataConfig, drop_remainder=False, **args))
    assert [u.compression for u in data._train.units] == ["gzip", "zstd", None, None, None]
    for epoch in (0, 1):
        train = [rids(data.train_batches(epoch, rank, 2)) for rank in range(2)]
        evals = [rids(data.eval_batches(rank, 2)) for rank in range(2)]
        assert sorted(sum(train + evals, [])) == list(range(1300)), "every row exactly once, train and eval together"
        assert 180 < len(sum(evals, [])) < 340
    assert train != [rids(data.train_batches(0, rank, 2)) for rank in range(2)], "the unit order is shuffled per epoch"
    data = CsvData(make(CsvDataConfig, **args))
    train = [rids(data.train_batches(0, rank, 2)) for rank in range(2)]
    assert len(train[0]) == len(train[1]) == 16 * data.num_train_batches(2)
    assert not set(train[0]) & set(train[1])


def test_criteo_day_files_read_gzipped_with_tables_sized_from_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``data=criteo`` on ``day_0.gz``: tables sized (vocabularies) from the decompressed sample, the same batches as the
    plain TSV."""
    monkeypatch.setattr(compression, "STREAM_CHUNK_BYTES", 16_000)  # ~75 lines a chunk: a file of 6
    write_criteo_tsv(str(tmp_path / "day_0"), 400, seed=3)
    compressed(tmp_path / "day_0", (tmp_path / "day_0").read_bytes(), "gzip")
    args = {"batch_size": 64, "shuffle": False, "eval_fraction": 0.25}
    ours = CriteoData(make(CriteoDataConfig, path=str(tmp_path / "day_0.gz"), **args))
    theirs = CriteoData(make(CriteoDataConfig, path=str(tmp_path / "day_0"), **args))
    assert ours.schema == theirs.schema and any(c.encoding == "vocab" for c in ours.schema.sparse)
    assert everything(ours.train_batches(0, 0, 1)) == everything(theirs.train_batches(0, 0, 1))
    assert everything(ours.eval_batches(0, 1)) == everything(theirs.eval_batches(0, 1))


def test_compressed_objects_in_a_store_stream_beside_read_ahead_plain_ones(tmp_path: Path) -> None:
    """A store's prefix with a bz2 object and a plain one (read ahead in blocks): the batches of the same files on disk."""
    store, prefix = fsspec.filesystem("memory"), f"/bucket-{uuid.uuid4().hex}"
    store.pipe(f"{prefix}/a.csv.bz2", bz2.compress(text_rows(0, 500)))
    store.pipe(f"{prefix}/b.csv", text_rows(500, 300))
    compressed(tmp_path / "a.csv", text_rows(0, 500), "bz2")
    (tmp_path / "b.csv").write_bytes(text_rows(500, 300))
    args = {"batch_size": 32, "eval_fraction": 0.2, "block_rows": 60, **COLUMNS}
    remote = CsvData(make(CsvDataConfig, path=f"memory://{prefix}/", **args))
    disk = CsvData(make(CsvDataConfig, path=str(tmp_path), **args))
    for rank in range(2):
        assert rids(remote.train_batches(1, rank, 2)) == rids(disk.train_batches(1, rank, 2))
        assert rids(remote.eval_batches(rank, 2)) == rids(disk.eval_batches(rank, 2))


@pytest.mark.parametrize("codec", CODECS)
def test_a_truncated_compressed_file_is_named_with_its_compression(tmp_path: Path, codec: str) -> None:
    whole = compressed(tmp_path / "full.csv", text_rows(0, 3000), codec).read_bytes()
    cut = tmp_path / f"day.csv{CODECS[codec]}"
    cut.write_bytes(whole[: len(whole) * 2 // 3])
    with pytest.raises(DataError, match=rf"{cut} cannot be decompressed as {codec} \(.*\): the file is truncated or corrupt\. "
                                        rf"Fix: check it \(\w+ -t {cut}\)"):
        CsvData(make(CsvDataConfig, path=str(cut), batch_size=8, **COLUMNS))


def test_damaged_or_unread_compressions_say_what_they_are(tmp_path: Path) -> None:
    args = {"batch_size": 8, **COLUMNS}
    (tmp_path / "bad.csv.gz").write_bytes(b"\x00\x01" * 300)
    with pytest.raises(DataError, match=r"bad.csv.gz: its name says gzip-compressed, but it does not begin as a gzip file does"):
        CsvData(make(CsvDataConfig, path=str(tmp_path / "bad.csv.gz"), **args))
    (tmp_path / "x.csv.xz").write_bytes(b"\xfd7zXZ\x00" + b"\x00" * 100)
    with pytest.raises(DataError, match=r"x.csv.xz is xz-compressed, which is not read. Fix: recompress it with zstd or gzip"):
        CsvData(make(CsvDataConfig, path=str(tmp_path / "x.csv.xz"), **args))
    (tmp_path / "rows.tar.gz").write_bytes(gzip.compress(b"rows.csv\x00\x00\x00" * 50))
    with pytest.raises(DataError, match=r"rows.tar.gz is not a text file \(NUL bytes in its first 550 bytes, decompressed \(gzip\)\)"):
        CsvData(make(CsvDataConfig, path=str(tmp_path / "rows.tar.gz"), **args))
    (tmp_path / "empty.csv.gz").write_bytes(gzip.compress(b""))
    with pytest.raises(DataError, match=r"empty.csv.gz is an empty file \(once decompressed, gzip\)"):
        CsvData(make(CsvDataConfig, path=str(tmp_path / "empty.csv.gz"), **args))


def test_an_eval_file_without_the_training_header_is_a_header_mismatch(tmp_path: Path) -> None:
    """Avazu's layout: ``train.csv`` with a header, ``dev.csv`` (here gzipped) without. Refused naming the mismatch and
    ``data.eval_header=false``; with it, every dev line is an eval row under the training header's names."""
    (tmp_path / "train.csv").write_bytes(text_rows(0, 200))
    dev = compressed(tmp_path / "dev.csv", text_rows(1000, 90, header=False), "gzip")
    args = {"path": str(tmp_path / "train.csv"), "eval_path": str(dev), "batch_size": 16, **COLUMNS}
    first = text_rows(1000, 1, header=False).decode().strip()
    with pytest.raises(DataError, match=rf"dev.csv.gz has no column 'label': its first line '{first}' looks like data, "
                                        r"not a header.*the training files \(data.path\) have a header line, this eval file has "
                                        r"none: a header mismatch. Fix: data.eval_header=false"):
        CsvData(make(CsvDataConfig, **args))
    data = CsvData(make(CsvDataConfig, eval_header=False, **args))
    batches = list(data.eval_batches(0, 1))
    assert rids(batches) == list(range(1000, 1090))
    assert [b for batch in batches for b in batch.labels.tolist()] == [float((i * 7) % 3 == 0) for i in range(1000, 1090)]
    train = rids(data.train_batches(0, 0, 1))
    assert len(train) == 192 and set(train) <= set(range(200)), "the training file is read with its header"


def test_an_eval_file_with_a_header_the_training_files_lack_is_a_header_mismatch(tmp_path: Path) -> None:
    (tmp_path / "train.csv").write_bytes(text_rows(0, 200, header=False))
    (tmp_path / "dev.csv").write_bytes(text_rows(1000, 90))
    args = {"path": str(tmp_path / "train.csv"), "eval_path": str(tmp_path / "dev.csv"), "batch_size": 16, "header": False,
            "column_names": ["label", "price", "rid", "user", "item"], **COLUMNS}
    with pytest.raises(DataError, match=r"dev.csv begins with a header line \('label,price,rid,user,item'\), but the training files "
                                        r"\(data.path\) have none.*a header mismatch. Fix: data.eval_header=true"):
        CsvData(make(CsvDataConfig, **args))
    data = CsvData(make(CsvDataConfig, eval_header=True, **args))
    assert rids(data.eval_batches(0, 1)) == list(range(1000, 1090))


def test_eval_header_needs_an_eval_path(make_cfg) -> None:
    cfg = make_cfg("data=csv", "data.path=train.csv", "data.eval_header=false", "tracking=none", tiny=False)
    with pytest.raises(ConfigError, match=r"data.eval_header=false says how data.eval_path's files are laid out, but data.eval_path "
                                          r"is null.*Fix: set data.eval_path, or data.eval_header=null"):
        validate(cfg)
    data = validate(make_cfg("data=csv", "data.path=t.csv", "data.eval_path=d.csv", "data.eval_header=false", "tracking=none", tiny=False)).data
    assert isinstance(data, CsvDataConfig) and data.eval_header is False


def test_an_epoch_of_few_steps_is_said_once_with_a_batch_size_that_fits(make_cfg, tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """A gzipped CSV through the runner's own build: 1000 rows, ~900 trained, batch 64 → 14 steps an epoch."""
    data = compressed(tmp_path / "rows.csv", text_rows(0, 1000), "gzip")
    overrides = ["data=csv", f"data.path={data}", "data.label=label", "data.batch_size=64", "distributed.device=cpu", "tracking=none"]
    cfg = make_cfg(*overrides, "train.eval_every_steps=null", "checkpoint=none", tiny=False)
    with caplog.at_level(logging.WARNING, logger="recsys_runner"):
        c = build(validate(cfg))
        try:
            per_epoch = c.loop.steps_per_epoch
        finally:
            c.close()
    said = [r.getMessage() for r in caplog.records if "optimizer steps" in r.getMessage()]
    assert per_epoch == 14 and said == [
        "an epoch of this data is only 14 optimizer steps: 896 rows trained an epoch, 14 steps x data.batch_size=64 x 1 rank(s). "
        "So few updates leave a model barely trained. Fix: a smaller batch, e.g. data.batch_size=16 (>= 56 steps an epoch), "
        "or more epochs (train.num_epochs)"]
    run = validate(cfg)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="recsys_runner"):
        _total_steps(run, FEW_EPOCH_STEPS, log_choice=True)  # enough steps
        _total_steps(run, 14, log_choice=False)  # ranks other than 0 say nothing
        _total_steps(validate(make_cfg("tracking=none")), 3, log_choice=True)  # generated data: its epoch is no file's
        # train.num_steps=50 makes 50 updates, however short an epoch: "so few updates" and "more epochs" would be wrong
        _total_steps(validate(make_cfg(*overrides, "train.num_steps=50", tiny=False)), 14, log_choice=True)
    assert "optimizer steps" not in caplog.text
    with caplog.at_level(logging.WARNING, logger="recsys_runner"):
        _total_steps(validate(make_cfg(*overrides, "train.grad_accum_steps=2", tiny=False)), 7, log_choice=True, world_size=2)
    assert ("1792 rows trained an epoch, 7 steps x data.batch_size=64 x 2 rank(s) x train.grad_accum_steps=2" in caplog.text
            and "data.batch_size=8 (>= 56 steps an epoch)" in caplog.text)


def test_stream_chunks_cut_nowhere_but_hand_on_every_byte(tmp_path: Path) -> None:
    text = text_rows(0, 250)
    path = compressed(tmp_path / "x.csv", text, "zstd")
    codec = compression.detect(str(path), path.read_bytes()[:16])
    assert codec is not None and codec.name == "zstd"
    got = list(compression.chunks(str(path), codec, start=26))
    assert b"".join(got) == text[26:] and {len(c) for c in got[:-1]} == {333}
    assert compression.detect("plain.csv", text[:100]) is None
