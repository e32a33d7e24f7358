"""The served model's shortcuts for small requests (issue 29's serving latency) give exactly what the general path gives.

A request of up to ``STACKED_ROWS`` text rows is converted to Arrow in one piece, its single-valued vocabulary columns
are keyed and looked up together and its dense columns parsed together (``RequestColumns.text_columns``, ``SmallRequests.rows``,
``Vocabularies``); the program runs
without its runtime checks (``runnable``); inside ``mlflow models serve`` torch keeps one intra-op thread
(``serving_threads``). Each is compared here with the way it replaces: the row encoder column by column, each
``Vocabulary.lookup``, ``ExportedProgram.module()``, the process's setting. A program compiled by AOTInductor is run instead when there is one
that loads (``load_program``), and one that cannot be compiled or loaded leaves the program to run.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch

from recsys_runner.data.encoding import served_program, served_small
from recsys_runner.data.encoding.served import ServedModel
from recsys_runner.data.encoding.vocabulary import Vocabulary
from recsys_runner.serving.program import compile_program
from tests.test_mlflow_model import _trained


def test_vocabularies_looked_up_together_read_each_vocabularys_rows() -> None:
    rng = np.random.default_rng(0)
    vocabularies = [Vocabulary.build(rng.integers(0, 50, 400).astype(np.uint64), capacity, buckets)
                    for capacity, buckets in ((30, 4), (5, 1), (60, 16))]
    vocabularies.append(Vocabulary(np.zeros(0, np.uint64), np.zeros(0, np.int64), 0, 3))  # nothing in it: every key is OOV
    together = served_small.Vocabularies(vocabularies)
    for counts in ([3, 0, 7, 2], [0, 0, 0, 0], [1, 1, 1, 1], [40, 25, 80, 9]):
        parts = [np.concatenate([rng.integers(0, 70, c).astype(np.uint64), rng.integers(0, 2**64 - 1, c, dtype=np.uint64)])[:c]
                 for c in counts]
        want = np.concatenate([v.lookup(p) for v, p in zip(vocabularies, parts, strict=True)])
        got = together.lookup(np.concatenate(parts).astype(np.uint64), np.asarray(counts))
        assert got.dtype == want.dtype and np.array_equal(got, want), counts


def test_program_without_runtime_checks_gives_the_same_outputs() -> None:
    class Bags(torch.nn.Module):
        """A KeyedJaggedTensor's pattern: the ids' count read from the lengths (``item``), checked, then bags pooled."""

        def __init__(self) -> None:
            super().__init__()
            self.table = torch.nn.EmbeddingBag(20, 4, mode="sum")

        def forward(self, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            total = lengths.sum().item()
            torch._check_is_size(total)
            torch._check(total <= values.shape[0])
            return self.table(values.narrow(0, 0, total), lengths.cumsum(0) - lengths).sum(dim=1)

    values, lengths = torch.tensor([1, 2, 3, 4, 5]), torch.tensor([2, 0, 3])
    shapes = {"values": {0: torch.export.Dim("ids")}, "lengths": {0: torch.export.Dim("batch")}}
    program = torch.export.export(Bags().eval(), (values, lengths), dynamic_shapes=shapes, strict=False)
    checked, module = program.module(), served_program.runnable(program)

    def called(m: torch.nn.Module) -> list[str]:
        return [str(n.target) for n in m.graph.nodes if n.op == "call_function"]

    assert "aten._assert_scalar.default" in called(checked) and not [t for t in called(module) if "_assert" in t]
    assert {"aten.item.default", "aten.narrow.default", "aten.embedding_bag.padding_idx"} <= set(called(module))
    for v, ln in ((torch.tensor([7]), torch.tensor([1])), (torch.tensor([3, 9, 9, 0]), torch.tensor([0, 4, 0, 0, 0])), (values, lengths)):
        assert torch.equal(module(v, ln), checked(v, ln))


def test_serving_threads_one_inside_mlflow_models_serve_else_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv(served_program.SERVER_MODEL_PATH_VARIABLE, raising=False)
        torch.set_num_threads(2)
        assert served_program.serving_threads(torch) == 2
        monkeypatch.setenv(served_program.SERVER_MODEL_PATH_VARIABLE, "/models/m")
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert served_program.serving_threads(torch) == 2  # the operator's choice is kept
        monkeypatch.delenv("OMP_NUM_THREADS")
        assert served_program.serving_threads(torch) == 1
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def hex_model(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A model over hex ids (vocabularies keyed by their parsed value), text ids, integer ids read as text, multi-hot tags
    and a price with gaps; and rows to score (unseen ids among them)."""
    root = tmp_path_factory.mktemp("hex")
    rng = np.random.default_rng(1)

    def rows(n: int, ids: int) -> list[str]:
        out = []
        for _ in range(n):
            k = int(rng.integers(ids))
            price = "" if rng.random() < 0.1 else f"{rng.random() * 10:.3f}"
            tags = "|".join(f"t{int(t)}" for t in rng.integers(0, 8, int(rng.integers(0, 3))))
            ad = "" if rng.random() < 0.05 else f"{(k * 2654435761) % 2**32:08x}"
            out.append(f"{int(k % 2 == 0)},{ad},u{k % 30},{int(rng.integers(40))},{price},{tags}")
        return out

    header = "click,ad,user,item,price,tags"
    (root / "train.csv").write_text("\n".join([header, *rows(2000, 60)]) + "\n")
    (root / "score.csv").write_text("\n".join([header, *rows(300, 90)]) + "\n")
    data = ["data=csv", f"data.path={root}/train.csv", "data.batch_size=128", "data.sparse=[{name: ad, hex: true}, {name: user}, "
            "{name: item}, {name: tags, separator: '|'}]", "data.dense=[{name: price, transform: log1p}]", "data.label=click",
            "model=deepfm", "distributed.device=cpu", "tracking=none"]
    return _trained(root, data, 10)


def _general(model: ServedModel, frame: pd.DataFrame) -> Any:
    """``model.encode(frame)`` the general way: each column converted alone, every column by the row encoder."""
    all_text, small = model.request.all_text, model.small
    model.request.all_text, model.small = False, None
    try:
        return model.encode(frame)
    except Exception as e:  # noqa: BLE001 - the message is what is compared
        return str(e)
    finally:
        model.request.all_text, model.small = all_text, small


def test_small_requests_encode_as_the_row_encoder_does(hex_model: dict[str, Any]) -> None:
    model = ServedModel(str(hex_model["model"] / "data" / "data"))
    assert model.small is not None
    assert [n for _, names, _ in model.small.keyed.values() for n in names] == ["ad", "user", "item"]  # tags: a multi-hot column
    score = hex_model["root"] / "score.csv"
    text = pd.read_csv(score, dtype=object).drop(columns=["click"])
    frames = {f"{n} rows {dtype}": pd.read_csv(score, dtype=dtype).drop(columns=["click"]).head(n)
              for n in (1, 7, 300) for dtype in (object, str, "string")}
    frames["columns reordered, one extra"] = text.head(9).assign(extra="x")[["extra", *text.columns[::-1]]]
    frames["empty text and None"] = text.head(6).assign(ad=["", None, "0000abcd", "", "ffffffff", None], user=[None] * 6)
    frames["every id missing"] = text.head(4).assign(ad=[None] * 4, item=[""] * 4)
    frames["numbers beside text"] = text.head(5).assign(item=[3, 4, 5, 6, 7])
    frames["upper-case and short hex"] = text.head(3).assign(ad=["ABCDEF12", "1", "00000000"])
    frames["not hex"] = text.head(3).assign(ad=["12ab34cd", "xyz", "0"])
    frames["not a number"] = text.head(3).assign(price=["1.0", "cheap", "2"])
    frames["not finite"] = text.head(3).assign(price=["1.0", "nan", "2"])
    frames["price missing or empty"] = text.head(4).assign(price=[None, "", "0", "-3"])
    refused = {}
    for name, frame in frames.items():
        want = _general(model, frame)
        try:
            got: Any = model.encode(frame)
        except Exception as e:  # noqa: BLE001 - the message is what is compared
            got = str(e)
        if isinstance(want, str) or isinstance(got, str):
            assert got == want, name
            refused[name] = got
            continue
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), name
    # both paths refuse exactly the bad rows, each with the request's row, column and value (not a crash both share)
    expected = {"not hex": "row 1, column 'ad': 'xyz' is not a hexadecimal string",
                "not a number": "row 1, column 'price': 'cheap' is not a number",
                "not finite": "row 1, column 'price': the value is nan, not a finite number"}
    assert sorted(refused) == sorted(expected), refused
    for name, fragment in expected.items():
        assert refused[name].startswith(f"bad row in request {fragment}") and refused[name].endswith("Fix the request"), refused


def test_hex_model_serves_predicts_scores(hex_model: dict[str, Any], tmp_path: Path) -> None:
    import mlflow.pyfunc

    from tests.test_mlflow_model import ATOL, _scores

    reference = _scores(hex_model["data"], hex_model["checkpoint"], hex_model["root"] / "score.csv", tmp_path / "predicted")
    text = pd.read_csv(hex_model["root"] / "score.csv", dtype=str).drop(columns=["click"])
    model = mlflow.pyfunc.load_model(str(hex_model["model"]))
    np.testing.assert_allclose(model.predict(text)["score"].to_numpy(), reference["score"].to_numpy(), atol=ATOL)
    one = np.concatenate([model.predict(text.iloc[[i]])["score"].to_numpy() for i in range(0, 300, 37)])
    np.testing.assert_allclose(one, reference["score"].to_numpy()[::37], atol=ATOL)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="AOTInductor needs a C++ compiler")
def test_compiled_program_is_preferred_and_a_broken_one_falls_back(tmp_path: Path) -> None:
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bags, self.head = torch.nn.EmbeddingBag(30, 4, mode="sum"), torch.nn.Linear(6, 1)

        def forward(self, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            offsets = lengths.reshape(-1).cumsum(0) - lengths.reshape(-1)
            return self.head(torch.cat([dense, self.bags(values, offsets)], dim=1))

    dense, values, lengths = torch.rand(3, 2), torch.tensor([1, 5, 7, 29]), torch.tensor([[2, 1, 1]])
    shapes = {"dense": {0: torch.export.Dim("batch")}, "values": {0: torch.export.Dim("ids")}, "lengths": {1: torch.export.Dim("batch")}}
    program = torch.export.export(Net().eval(), (dense, values, lengths), dynamic_shapes=shapes, strict=False)
    torch.export.save(program, str(tmp_path / served_program.PROGRAM_FILE))
    assert not (tmp_path / served_program.COMPILED_FILE).exists()
    eager = served_program.load_program(str(tmp_path))
    assert isinstance(eager, torch.fx.GraphModule)

    assert compile_program(program, str(tmp_path / served_program.COMPILED_FILE))
    compiled = served_program.load_program(str(tmp_path))
    assert not isinstance(compiled, torch.fx.GraphModule)
    for d, v, ln in ((dense, values, lengths), (torch.rand(1, 2), torch.tensor([3]), torch.tensor([[1]])),
                     (torch.rand(5, 2), torch.tensor([0, 1, 2]), torch.tensor([[0, 3, 0, 0, 0]]))):
        with torch.inference_mode():
            torch.testing.assert_close(compiled(d, v, ln), eager(d, v, ln), rtol=1e-5, atol=1e-5)

    (tmp_path / served_program.COMPILED_FILE).write_bytes(b"not a package")  # another torch's, a truncated copy: the program runs
    with pytest.warns(UserWarning, match=r"model_aoti.pt2 does not load here .* running model.pt2 instead"):
        fallback = served_program.load_program(str(tmp_path))
    assert isinstance(fallback, torch.fx.GraphModule)


def test_a_program_that_cannot_be_compiled_is_served_as_it_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    import torch._inductor

    def no_compiler(*args: Any, **kwargs: Any) -> str:
        raise RuntimeError("no C++ compiler found\nmore")

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", no_compiler)
    program = torch.export.export(torch.nn.Linear(2, 1), (torch.rand(3, 2),))
    assert not compile_program(program, str(tmp_path / served_program.COMPILED_FILE))
    assert "could not be compiled with AOTInductor (RuntimeError: no C++ compiler found)" in caplog.text
    assert not (tmp_path / served_program.COMPILED_FILE).exists()
