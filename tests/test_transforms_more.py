"""More sparse-column transforms (issue 29, "Feature transforms", point 2): crossed ids (``cross``), weighted multi-hot
(``weighted: true`` ``id:weight`` values, or a parallel ``weights`` column) and a fixed vocabulary from a file
(``vocab_file``).

Each is a field of a ``data.sparse`` entry (or of a schema file), checked when the column is declared or when the schema
is completed against the files, stored in ``encoders.json`` with every checkpoint, and reloaded by ``evaluate`` with the
same rows. Weighted bags reach TorchRec as ``KeyedJaggedTensor`` weights and pool to ``Σ w_i · e[id_i]``: checked on the
unsharded arch, on fbgemm's kernel (all-ones weights pool exactly as none) and on the sharded model a training built.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner import evaluate
from recsys_runner.__main__ import run as train
from recsys_runner.build import build
from recsys_runner.config import validate
from recsys_runner.data.encoding.encoded_rows import Rows
from recsys_runner.data.encoding.fit import InferConfig, complete_schema
from recsys_runner.data.encoding.keys import cross_keys, fnv1a64, splitmix64
from recsys_runner.data.encoding.rows import Encoder, Location
from recsys_runner.data.encoding.stored import ENCODERS_FILE, from_json, to_json
from recsys_runner.data.encoding.vocabulary import Vocabulary
from recsys_runner.data.schema import Schema, SparseColumn
from recsys_runner.data.schema_files import read_schema_file
from recsys_runner.errors import ConfigError, DataError
from recsys_runner.models.common import SparseArch
from recsys_runner.models.deepfm import DeepFM
from tests.test_evaluate import compose_entry


def _encode(schema: Schema, table: pa.Table, on_bad_rows: str = "fail", text: bool = True) -> Rows:
    """``table`` encoded by ``schema``: a CSV block (``text``: messages name lines from 2) or a Parquet one."""
    where = Location("t.csv" if text else "t.parquet", "lines 2-" if text else "row group 0", np.arange(table.num_rows), 2 if text else None)
    return Encoder(schema, on_bad_rows, DataError).encode(table, where)


def _complete(table: pa.Table, sparse: list[SparseColumn], oov_buckets: int = 16) -> Schema:
    return complete_schema(label="label", labels=None, label_kinds=None, label_threshold=None, dense=[], sparse=sparse,
                           sample=lambda: table, config=InferConfig(oov_buckets=oov_buckets), where="the sample").schema


def _text(**columns: list[str | None]) -> pa.Table:
    n = len(next(iter(columns.values())))
    return pa.table({"label": ["0"] * n, **{k: pa.array(v, pa.string()) for k, v in columns.items()}})


# -- crossed ids ---------------------------------------------------------------------------------------


def test_a_cross_hashes_each_rows_raw_values_in_order_and_a_missing_value_gives_an_empty_bag() -> None:
    cross = SparseColumn(name="user_x_cat", cross=["user", "cat"], num_embeddings=1000)
    assert cross.encoding == "hash"
    schema = Schema(label="label", sparse=[SparseColumn(name="item", num_embeddings=5), cross])
    assert schema.columns == ["label", "item", "user", "cat"]  # the crossed columns are read, though no feature
    table = _text(item=["1", "2", "3", "4"], user=["u1", "u1", "u2", None], cat=["c1", "c1", "c1", "c3"])
    ids, lengths = _encode(schema, table).sparse[1]
    assert lengths.tolist() == [1, 1, 1, 0]
    keys = cross_keys([fnv1a64(pa.array(["u1", "u1", "u2"])), fnv1a64(pa.array(["c1", "c1", "c1"]))])
    assert ids.tolist() == (keys % np.uint64(1000)).astype(np.int64).tolist()
    assert ids[0] == ids[1] != ids[2]
    swapped = Schema(label="label", sparse=[SparseColumn(name="cat_x_user", cross=["cat", "user"], num_embeddings=1000)])
    assert _encode(swapped, table).sparse[0][0][0] != ids[0]  # (a, b) and (b, a) are different crosses

    # Parquet values by their type: an integer by its value, a float by its bits, NaN missing
    typed = pa.table({"label": [0, 1], "user": pa.array([7, 7], pa.int64()), "cat": pa.array([1.5, float("nan")])})
    ids, lengths = _encode(Schema(label="label", sparse=[cross]), typed, text=False).sparse[0]
    seven, one_and_a_half = np.array([7], np.int64).view(np.uint64), np.array([1.5]).view(np.uint64)
    assert lengths.tolist() == [1, 0]
    assert ids.tolist() == [int(cross_keys([splitmix64(seven), splitmix64(one_and_a_half)])[0] % np.uint64(1000))]


def test_a_crossed_list_column_stops_the_run_naming_it() -> None:
    schema = Schema(label="label", sparse=[SparseColumn(name="x", cross=["a", "b"], num_embeddings=10)])
    table = pa.table({"label": [0], "a": pa.array([[1, 2]]), "b": pa.array([3])})
    with pytest.raises(DataError, match=r"column 'a', crossed by data.sparse\[x\], is a list column .* Fix: cross single-valued columns"):
        _encode(schema, table, text=False)


@pytest.mark.parametrize(("fields", "message"), [
    ({"cross": ["a"]}, r"data.sparse\[x\].cross=\['a'\] crosses fewer than 2 columns"),
    ({"cross": "a"}, r"data.sparse\[x\].cross='a' must be a list of column names"),
    ({"cross": ["a", "a"]}, r"names a column twice"),
    ({"cross": ["x", "a"]}, r"includes the entry's own name"),
    ({"cross": ["a", "b"]}, r"data.sparse\[x\].cross needs data.sparse\[x\].num_embeddings"),
    ({"cross": ["a", "b"], "num_embeddings": 9, "encoding": "vocab"}, r"encoding='vocab': a cross is hashed"),
    ({"cross": ["a", "b"], "num_embeddings": 9, "separator": "|"}, r"drop data.sparse\[x\].separator"),
    ({"cross": ["a", "b"], "num_embeddings": 9, "weighted": True}, r"\['weighted'\] would change"),
])
def test_cross_config_errors(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SparseColumn(name="x", **fields)


def test_a_cross_of_a_column_the_files_lack_is_refused_when_the_schema_is_completed() -> None:
    table = _text(user=["u1"], cat=["c"])
    with pytest.raises(ConfigError, match=r"data.sparse\[ux\].cross=\['user', 'kat'\] names \['kat'\], not column\(s\) of the sample"):
        _complete(table, [SparseColumn(name="user"), SparseColumn(name="ux", cross=["user", "kat"], num_embeddings=10)])
    with pytest.raises(ConfigError, match=r"data.sparse\[ux\].cross=\['label', 'cat'\] reads \['label'\]"):
        Schema(label="label", sparse=[SparseColumn(name="ux", cross=["label", "cat"], num_embeddings=10)])


# -- weighted multi-hot --------------------------------------------------------------------------------


def test_id_weight_pairs_and_a_weights_column_give_each_id_its_weight() -> None:
    pairs = SparseColumn(name="tags", separator="|", weighted=True, num_embeddings=100)
    listed = SparseColumn(name="genres", separator="|", weights="genre_w", num_embeddings=100)
    schema = Schema(label="label", sparse=[SparseColumn(name="item", num_embeddings=9), pairs, listed])
    assert schema.columns == ["label", "item", "tags", "genres", "genre_w"] and schema.features().weighted_names == ["tags", "genres"]
    table = _text(item=["1", "2", "3"], tags=["12:0.5|7:2", None, "3:1e-1"], genres=["4|5", "6", None], genre_w=["1.5|-1", "3", None])
    rows = _encode(schema, table)
    assert rows.sparse[1][0].tolist() == [12, 7, 3] and rows.sparse[1][1].tolist() == [2, 0, 1]
    assert rows.sparse[2][0].tolist() == [4, 5, 6] and rows.sparse[2][1].tolist() == [2, 1, 0]
    assert rows.weights is not None and rows.weights[0] is None
    np.testing.assert_allclose(rows.weights[1], [0.5, 2.0, 0.1], rtol=1e-6)
    np.testing.assert_allclose(rows.weights[2], [1.5, -1.0, 3.0])
    np.testing.assert_allclose(rows.key_weights(), [1, 1, 1, 0.5, 2, 0.1, 1.5, -1, 3], rtol=1e-6)  # 1.0 for the unweighted item
    # weights stay with their ids when rows are reordered, cut and joined (shuffle buffer, batches)
    again = Rows.concat([rows.take(np.array([2, 0])), rows.slice(1, 2)])
    assert again.sparse[1][0].tolist() == [3, 12, 7] and again.sparse[2][0].tolist() == [4, 5, 6]
    np.testing.assert_allclose(again.key_weights(), [1, 1, 1, 0.1, 0.5, 2, 1.5, -1, 3], rtol=1e-6)

    # Parquet: a list<string> of pairs, and a list<float> of weights beside a list<int64> of ids
    typed = pa.table({"label": [1, 0], "item": [1, 2], "tags": pa.array([["1:2.5"], []]), "genres": pa.array([[4, 5], [6]]),
                      "genre_w": pa.array([[0.25, 4.0], [1.0]], pa.list_(pa.float32()))})
    rows = _encode(schema, typed, text=False)
    np.testing.assert_allclose(rows.key_weights(), [1, 1, 2.5, 0.25, 4, 1])


@pytest.mark.parametrize(("column", "value", "message"), [
    ("tags", "12:x", r"line 3, column 'tags': '12:x' has a weight that is not a finite number; data.sparse\[tags\].weighted=true reads"),
    ("tags", "12", r"line 3, column 'tags': '12' is not an 'id:weight' pair \(it has no ':'\)"),
    ("tags", "12:inf", r"line 3, column 'tags': '12:inf' has a weight that is not a finite number"),
    ("genre_w", "1|2|3", r"line 3, column 'genre_w': it has 3 weight\(s\) but 'genres' has 2 value\(s\)"),
    ("genre_w", "1|abc", r"line 3, column 'genre_w': the weight 'abc' is not a finite number"),
])
def test_bad_weights_are_bad_rows_naming_file_line_and_column(column: str, value: str, message: str) -> None:
    schema = Schema(label="label", sparse=[SparseColumn(name="tags", separator="|", weighted=True, num_embeddings=100),
                                           SparseColumn(name="genres", separator="|", weights="genre_w", num_embeddings=100)])
    good = {"tags": ["1:1", "2:2", "3:3"], "genres": ["1|2", "1|2", "1|2"], "genre_w": ["1|1", "2|2", "3|3"]}
    good[column][1] = value
    with pytest.raises(DataError, match=message):
        _encode(schema, _text(**good))
    rows = _encode(schema, _text(**good), on_bad_rows="skip")
    assert len(rows) == 2 and rows.sparse[0][0].tolist() == [1, 3]
    np.testing.assert_allclose(rows.key_weights(), [1, 3, 1, 1, 3, 3])


@pytest.mark.parametrize(("fields", "message"), [
    ({"weighted": True, "weights": "w"}, r"choose one"),
    ({"weighted": True, "pooling": "mean"}, r"pooling='mean': a weighted bag is pooled as the weighted sum"),
    ({"weights": "t"}, r"data.sparse\[t\].weights='t' must name another column"),
    ({"weighted": True, "num_embeddings": 8, "managed_collision": {"input_hash_size": 100}}, r"managed-collision"),
])
def test_weighted_config_errors(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SparseColumn(name="t", **fields)


def test_a_weights_column_the_files_lack_is_refused_when_the_schema_is_completed() -> None:
    with pytest.raises(ConfigError, match=r"data.sparse\[tags\].weights='tag_w' is not a column of the sample"):
        _complete(_text(tags=["1"]), [SparseColumn(name="tags", weights="tag_w", num_embeddings=10)])


def test_weighted_pooling_is_the_weighted_sum_of_the_rows() -> None:
    features = Schema(label="label", sparse=[SparseColumn(name="user", num_embeddings=6),
                                             SparseColumn(name="tags", num_embeddings=8, separator="|", weighted=True)]).features()
    arch = SparseArch(features, 4, DeepFM)
    assert arch.ebc is not None and arch.ebc.is_weighted()
    arch.ebc.to_empty(device="cpu")
    torch.manual_seed(0)
    for p in arch.ebc.parameters():
        torch.nn.init.normal_(p)
    users, tags = (arch.ebc.embedding_bags[t].weight.detach() for t in ("t_user", "t_tags"))
    kjt = KeyedJaggedTensor(keys=["user", "tags"], values=torch.tensor([1, 5, 2, 7, 7]), lengths=torch.tensor([1, 1, 2, 1], dtype=torch.int32),
                            weights=torch.tensor([1.0, 1.0, 0.5, 2.0, 3.0]))
    expected = torch.stack([torch.cat([users[1], 0.5 * tags[2] + 2.0 * tags[7]]), torch.cat([users[5], 3.0 * tags[7]])])
    torch.testing.assert_close(arch(kjt), expected)
    with pytest.raises(ConfigError, match=r"the features \['tags'\] are weighted .* but this batch carries no weights"):
        arch(KeyedJaggedTensor(keys=["user", "tags"], values=kjt.values(), lengths=kjt.lengths()))


@pytest.mark.parametrize("mode", ["SUM", "MEAN"])
def test_all_ones_weights_pool_exactly_as_no_weights_in_the_sharded_tables_kernel(mode: str) -> None:
    """fbgemm's TBE (the kernel of TorchRec's sharded tables, CPU and GPU): an unweighted feature rides in a weighted
    ``KeyedJaggedTensor`` with weights 1.0, which must pool bit for bit as without weights (``sum`` and ``mean``)."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen

    tbe = SplitTableBatchedEmbeddingBagsCodegen([(50, 8, EmbeddingLocation.HOST, ComputeDevice.CPU)], pooling_mode=getattr(PoolingMode, mode))
    with torch.no_grad():
        tbe.split_embedding_weights()[0].copy_(torch.randn(50, 8, generator=torch.Generator().manual_seed(1)))
    ids, offsets = torch.randint(0, 50, (40,), generator=torch.Generator().manual_seed(2)), torch.tensor([0, 3, 3, 10, 25, 40])
    assert torch.equal(tbe(ids, offsets), tbe(ids, offsets, per_sample_weights=torch.ones(40)))


# -- a vocabulary from a file --------------------------------------------------------------------------


def test_a_vocab_file_gives_its_lines_rows_in_order_and_other_values_oov_rows(tmp_path: Path) -> None:
    path = tmp_path / "items.txt"
    path.write_text("b\na\r\nc\n")  # a Windows line end is not part of the value
    table = _text(item=["a", "b", "zzz", "c", None])
    schema = _complete(table, [SparseColumn(name="item", vocab_file=str(path), oov_buckets=2)])
    col = schema.sparse[0]
    assert (col.encoding, col.num_embeddings, col.oov_buckets, col.vocab_file) == ("vocab", 5, 2, str(path))
    ids, lengths = _encode(schema, table).sparse[0]
    assert ids.tolist()[:2] == [1, 0] and ids[2] in (3, 4) and ids[3] == 2 and lengths.tolist() == [1, 1, 1, 1, 0]
    assert _complete(table, [SparseColumn(name="item", vocab_file=str(path))], oov_buckets=7).sparse[0].num_embeddings == 3 + 7


def test_a_vocab_file_keys_lines_as_the_training_files_type_integers_in_parquet_text_in_csv(tmp_path: Path) -> None:
    path = tmp_path / "items.txt"
    path.write_text("7\n3\n12\n")
    parquet = pa.table({"label": [0, 1, 0, 1], "item": pa.array([3, 12, 7, 8], pa.int64())})
    csv = _text(item=["3", "12", "7", "007"])
    for table, text, expected in ((parquet, False, [1, 2, 0]), (csv, True, [1, 2, 0])):
        schema = _complete(table, [SparseColumn(name="item", vocab_file=str(path), oov_buckets=1)])
        ids, _ = _encode(schema, table, text=text).sparse[0]
        assert ids.tolist() == [*expected, 3]  # 8 is not listed; nor is the text "007" (text keys are exact)
    path.write_text("7\n007\n")
    with pytest.raises(ConfigError, match=r"vocab_file=.*: the value '007' on line 2 repeats line 1 \('7': the same integer\)"):
        _complete(parquet, [SparseColumn(name="item", vocab_file=str(path))])
    assert _complete(csv, [SparseColumn(name="item", vocab_file=str(path))]).sparse[0].num_embeddings == 2 + 16  # two texts
    path.write_text("7\nseven\n")
    with pytest.raises(ConfigError, match=r"line 2 \('seven'\) is not an integer, but the column holds integers"):
        _complete(parquet, [SparseColumn(name="item", vocab_file=str(path))])


@pytest.mark.parametrize(("content", "fields", "message"), [
    (None, {}, r"data.sparse\[item\].vocab_file='.*items.txt': no such file. Fix: point it at a text file with one value per line"),
    ("", {}, r"items.txt' is empty. Fix: write one value per line"),
    ("a\nb\nc\nb\n", {}, r"the value 'b' on line 4 repeats line 2; each value gets one row"),
    ("a\n\nb\n", {}, r"line 2 is empty"),
    ("a\nb\n", {"num_embeddings": 10, "oov_buckets": 3}, r"num_embeddings=10, but vocab_file=.* has 2 values and oov_buckets=3: 5 rows"),
])
def test_vocab_file_errors(tmp_path: Path, content: str | None, fields: dict[str, Any], message: str) -> None:
    path = tmp_path / "items.txt"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=message):
        _complete(_text(item=["a"]), [SparseColumn(name="item", vocab_file=str(path), **fields)])


def test_vocab_file_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"data.sparse\[item\].encoding='hash': vocab_file gives each listed value a row"):
        SparseColumn(name="item", vocab_file="items.txt", encoding="hash")


# -- schema files and the stored document -------------------------------------------------------------


def test_schema_file_fields_round_trip_through_the_stored_document(tmp_path: Path) -> None:
    (tmp_path / "items.txt").write_text("x\ny\n")
    (tmp_path / "schema.yaml").write_text(
        "label: label\nsparse:\n"
        f"- {{name: item, vocab_file: {tmp_path}/items.txt, oov_buckets: 1}}\n"
        "- {name: tags, separator: '|', weighted: true, num_embeddings: 50, encoding: hash}\n"
        "- {name: genres, separator: '|', weights: genre_w, num_embeddings: 50, encoding: hash}\n"
        "- {name: item_x_tags, cross: [item, user], num_embeddings: 100}\n")
    parts, _ = read_schema_file(str(tmp_path / "schema.yaml"))
    sample = _text(item=["x"], tags=["a:1"], genres=["g"], genre_w=["1"], user=["u"])
    schema = complete_schema(**parts, sample=lambda: sample, config=InferConfig(), where="the sample").schema
    (tmp_path / "items.txt").unlink()  # stored: never read again
    again, _ = from_json(to_json(schema, {}), ENCODERS_FILE)
    assert again.sparse == schema.sparse and again.columns == ["label", "item", "tags", "genres", "genre_w", "user"]
    assert again.sparse[0].num_embeddings == 3 and again.sparse[3].cross == ["item", "user"]
    vocabulary = again.vocabularies["item"]
    np.testing.assert_array_equal(vocabulary.keys, schema.vocabularies["item"].keys)
    assert vocabulary.lookup(fnv1a64(pa.array(["y", "x"]))).tolist() == [1, 0]


# -- end to end: one training on Parquet files, evaluated, the vocab file deleted ----------------------


def _parquet(rng: np.random.Generator, n: int) -> pa.Table:
    """Rows whose label follows the (user, cat) cross and the weighted tags and genres."""
    users, cats, items = rng.integers(30, size=n), rng.integers(5, size=n), rng.integers(40, size=n)
    tags, genres, genre_w, signal = [], [], [], 3.0 * (2 * ((users % 2) ^ (cats % 2)) - 1)
    for i in range(n):
        k = rng.integers(6, size=int(rng.integers(1, 4)))
        w = np.round(rng.uniform(0.1, 3.0, size=len(k)), 2)
        tags.append([f"t{t}:{v}" for t, v in zip(k, w, strict=True)])
        g = rng.integers(4, size=int(rng.integers(0, 3)))
        gw = np.round(rng.uniform(0.5, 2.0, size=len(g)), 2)
        genres.append(g.tolist())
        genre_w.append(gw.tolist())
        signal[i] += 1.5 * float(np.sum(w * np.where(k % 2 == 0, 1, -1))) + float(np.sum(gw * np.where(g < 2, 1, -1)))
    label = (rng.random(n) < 1 / (1 + np.exp(-signal))).astype(np.int64)
    return pa.table({"label": label, "user": [f"u{u}" for u in users], "cat": pa.array(cats, pa.int64()), "item": pa.array(items, pa.int64()),
                     "tags": pa.array(tags, pa.list_(pa.string())), "genres": pa.array(genres, pa.list_(pa.int64())),
                     "genre_w": pa.array(genre_w, pa.list_(pa.float32()))})


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("transforms_more")
    rng = np.random.default_rng(0)
    pq.write_table(_parquet(rng, 3000), root / "train.parquet")
    pq.write_table(_parquet(rng, 800), root / "eval.parquet")
    (root / "items.txt").write_text("".join(f"{i}\n" for i in rng.permutation(30)))  # items 30-39 read OOV rows
    sparse = ("[{name: user}, {name: item, vocab_file: " + str(root / "items.txt") + ", oov_buckets: 2}, {name: tags, weighted: true}, "
              "{name: genres, weights: genre_w}, {name: user_x_cat, cross: [user, cat], num_embeddings: 500}]")
    data = ["data=parquet", f"data.path={root}/train.parquet", f"data.eval_path={root}/eval.parquet", "data.batch_size=64",
            "data.shuffle=false", f"data.sparse={sparse}", "model=deepfm", "optim=adagrad", "optim.sparse.lr=0.1",
            "distributed.device=cpu", "tracking=none"]
    train(compose_entry("config", *data, "train.num_steps=40", "train.log_every_steps=40", f"checkpoint.dir={root}/ck"))
    return {"root": root, "data": data, "checkpoint": root / "ck" / "step_00000040"}


def _evaluate(trained: dict[str, Any]) -> dict[str, float]:
    return evaluate.run(compose_entry("evaluate", *trained["data"], f"load={trained['checkpoint']}"))


def test_the_transforms_are_stored_and_evaluate_reuses_them_without_the_vocab_file(trained: dict[str, Any]) -> None:
    stored = json.loads((trained["checkpoint"] / ENCODERS_FILE).read_text())
    by_name = {c["name"]: c for c in stored["sparse"]}
    assert by_name["user_x_cat"]["cross"] == ["user", "cat"] and by_name["user_x_cat"]["encoding"] == "hash"
    assert by_name["tags"]["weighted"] and by_name["genres"]["weights"] == "genre_w"
    item = by_name["item"]
    assert (item["encoding"], item["num_embeddings"], item["oov_buckets"]) == ("vocab", 32, 2)
    assert {"cat", "genre_w"} <= set(stored["column_kinds"])  # read from the files though no feature
    lines = [int(v) for v in (trained["root"] / "items.txt").read_text().split()]
    v = stored["vocabularies"]["item"]
    vocabulary = Vocabulary(np.asarray(v["keys"], np.uint64), np.asarray(v["rows"], np.int64), v["capacity"], v["oov_buckets"])
    assert vocabulary.lookup(splitmix64(np.asarray(lines, np.int64).view(np.uint64))).tolist() == list(range(30))  # int keys: Parquet

    before = _evaluate(trained)
    assert before["eval/auc"] > 0.8, f"the model must have learned the cross and the weights for the test to mean anything: {before}"
    (trained["root"] / "items.txt").unlink()
    after = _evaluate(trained)
    assert after["eval/auc"] == pytest.approx(before["eval/auc"], abs=1e-9)
    assert after["eval/logloss"] == pytest.approx(before["eval/logloss"], abs=1e-9)


def _whole(t: Any) -> torch.Tensor:
    """A table's weights from a sharded model's state dict, whatever its sharding (one rank holds every shard)."""
    if isinstance(t, ShardedTensor):
        out = torch.zeros(t.size())
        for shard in t.local_shards():
            (r, c), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
            out[r:r + nr, c:c + nc] = shard.tensor
        return out
    return t.full_tensor() if hasattr(t, "full_tensor") else t


@pytest.mark.filterwarnings("ignore:Please use DTensor instead:FutureWarning")
def test_the_sharded_model_pools_weighted_bags_by_their_weights(trained: dict[str, Any]) -> None:
    c = build(validate(compose_entry("config", *trained["data"], f"checkpoint.init_from={trained['checkpoint']}",
                                     f"checkpoint.dir={trained['root']}/ft")))
    try:
        batch = next(iter(c.loop.data.eval_batches(0, 1)))
        ebc = next(m for n, m in c.loop.evaluator.model.named_modules() if n.endswith("sparse_arch.ebc"))
        pooled = ebc(batch.sparse_features).to_dict()
        tables = {k.split(".")[-2]: _whole(v) for k, v in ebc.state_dict().items()}
    finally:
        c.close()
    features = batch.sparse_features.to_dict()
    for name in ("tags", "genres", "user"):  # user: an unweighted feature, its ids weighing 1.0
        jagged, table = features[name], tables[f"t_{name}"]
        rows = torch.repeat_interleave(torch.arange(len(jagged.lengths())), jagged.lengths().long())
        expected = torch.zeros(len(jagged.lengths()), table.shape[1]).index_add_(0, rows, jagged.weights()[:, None] * table[jagged.values()])
        assert jagged.weights().ne(1).any() if name != "user" else jagged.weights().eq(1).all()
        torch.testing.assert_close(pooled[name].float(), expected, rtol=1e-5, atol=1e-6)
