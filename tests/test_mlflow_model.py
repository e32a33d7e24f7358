"""The MLflow model ``export`` writes (issue 29): raw rows in, exactly ``predict``'s scores out, without recsys_runner.

Models are trained for a few steps on generated CSV files whose id columns get inferred vocabularies; the rows scored
hold ids never seen in training (they read OOV rows) and missing numbers (they take the fill). ``predict`` on those
rows is the reference: the pyfunc model in-process, the pyfunc model in a process where recsys_runner, TorchRec and
fbgemm_gpu cannot be imported, and a real ``mlflow models serve`` process on loopback must all give its scores.
"""

from __future__ import annotations

import importlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import yaml

from recsys_runner import export, predict, provenance
from recsys_runner.__main__ import run as train
from recsys_runner.data.encoding import served as served_module
from recsys_runner.data.encoding import served_program
from recsys_runner.data.encoding.served import ServedModel
from recsys_runner.serving import mlflow_model, served_topk
from tests.conftest import free_port
from tests.test_evaluate import compose_entry
from tests.test_sequence_files import columns, histories, write_csv

ATOL = 1e-5


def _click_rows(rng: np.random.Generator, n: int, users: list[str], two_labels: bool = False) -> list[str]:
    """``click[,buy],user,item,price,tags`` rows: the label follows the user and the price; some prices are missing."""
    out = []
    for _ in range(n):
        k = int(rng.integers(len(users)))
        price = "" if rng.random() < 0.1 else f"{rng.random() * 10:.3f}"
        click = int((k % 2 == 0) == (rng.random() < 0.85))
        tags = "|".join(f"t{int(t)}" for t in rng.integers(0, 8, int(rng.integers(0, 4))))
        buy = f"{int(click and rng.random() < 0.5)}," if two_labels else ""
        out.append(f"{click},{buy}{users[k]},{int(rng.integers(40))},{price},{tags}")
    return out


def _scores(data: list[str], checkpoint: Path, rows: Path, out: Path) -> pd.DataFrame:
    """What ``predict`` writes for the file ``rows`` (the reference)."""
    predict.run(compose_entry("predict", *data, f"load={checkpoint}", f"predict.input={rows}", f"predict.output={out}"))
    return pd.concat([pq.read_table(p).to_pandas() for p in sorted(out.rglob("*.parquet"))], ignore_index=True)


def _trained(root: Path, data: list[str], steps: int = 20, *exporting: str) -> dict[str, Any]:
    train(compose_entry("config", *data, f"train.num_steps={steps}", f"checkpoint.dir={root}/ck"))
    checkpoint = root / "ck" / f"step_{steps:08d}"
    out = export.run(compose_entry("export", *data, f"load={checkpoint}", f"export.dir={root}/export", *exporting))
    return {"root": root, "data": data, "checkpoint": checkpoint, "model": out / mlflow_model.MODEL_DIR}


@pytest.fixture(scope="module")
def deepfm(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """DeepFM on a CSV (text users, integer items, a price with gaps, multi-hot tags); rows to score with unseen ids."""
    root = tmp_path_factory.mktemp("deepfm")
    rng = np.random.default_rng(0)
    header = "click,user,item,price,tags"
    (root / "train.csv").write_text("\n".join([header, *_click_rows(rng, 3000, [f"u{k}" for k in range(50)])]) + "\n")
    (root / "score.csv").write_text("\n".join([header, *_click_rows(rng, 300, [f"u{k}" for k in range(40, 70)])]) + "\n")
    data = ["data=csv", f"data.path={root}/train.csv", "data.batch_size=128", "data.sparse=[{name: user}, {name: item}, "
            "{name: tags, separator: '|'}]", "data.dense=[{name: price, normalize: zscore}]", "data.label=click", "model=deepfm",
            "distributed.device=cpu", "tracking=none"]
    uri = f"sqlite:///{root}/mlflow.db"  # the export logs to MLflow and registers the model (the others: tracking=none)
    import mlflow

    process_uri = (os.environ.get("MLFLOW_TRACKING_URI"), mlflow.get_tracking_uri())
    trained = _trained(root, data, 20, "tracking=mlflow", f"tracking.uri={uri}", "export.register_as=ctr-deepfm")
    trained["process_uri"] = (process_uri, (os.environ.get("MLFLOW_TRACKING_URI"), mlflow.get_tracking_uri()))
    trained["reference"] = _scores(data, trained["checkpoint"], root / "score.csv", root / "predicted")
    return trained | {"uri": uri}


def test_an_export_leaves_the_processs_tracking_uri_as_it_found_it(deepfm: dict[str, Any]) -> None:
    """The export logs its model through MLflow's fluent API at ``tracking.uri``; MLflow's ``set_tracking_uri`` also sets
    ``$MLFLOW_TRACKING_URI``, which ``tracking.uri``'s default reads: left set, every later job of the process (a sweep,
    a notebook) and its subprocesses logged to the export's store."""
    before, after = deepfm["process_uri"]
    assert after == before


def test_pyfunc_model_scores_raw_rows_as_predict_does(deepfm: dict[str, Any]) -> None:
    import mlflow.pyfunc

    model = mlflow.pyfunc.load_model(str(deepfm["model"]))
    reference = deepfm["reference"]["score"].to_numpy()
    as_text = pd.read_csv(deepfm["root"] / "score.csv", dtype=str)  # the CSV as training read it: every field text
    assert as_text["user"].isin([f"u{k}" for k in range(50, 70)]).sum() > 50, "unseen users must be scored too"
    np.testing.assert_allclose(model.predict(as_text)["score"].to_numpy(), reference, atol=ATOL)
    listed = as_text.assign(tags=[t.split("|") if isinstance(t, str) else [] for t in as_text["tags"]])  # multi-hot as lists
    np.testing.assert_allclose(model.predict(listed)["score"].to_numpy(), reference, atol=ATOL)
    # a shuffled frame (its index not 0..n-1, as after sorting, sampling or filtering) and its columns in another order: the
    # scores come back on the request's index, so pandas' assignment puts each on its own row
    shuffled = as_text.sample(frac=1, random_state=0)[list(reversed(as_text.columns))]
    np.testing.assert_allclose(shuffled.assign(score=model.predict(shuffled)["score"]).sort_index()["score"].to_numpy(), reference, atol=ATOL)
    # Past MLflow's signature check (JSON requests are converted to its types; a Python caller may skip it): ids as numbers,
    # prices as floats with NaN, are cast to what training read — the text of the CSV — and score the same.
    typed = pd.read_csv(deepfm["root"] / "score.csv")
    assert typed["item"].dtype == np.int64 and typed["price"].isna().any()
    np.testing.assert_allclose(ServedModel(str(deepfm["model"] / "data" / "data")).predict(typed)["score"].to_numpy(), reference, atol=ATOL)

    spec = json.loads((deepfm["model"] / "data" / "data" / "serving.json").read_text())
    assert spec["input_columns"] == ["price", "user", "item", "tags"] and spec["outputs"] == [{"column": "score", "task": None, "kind": "binary"}]
    assert spec[provenance.KEY] == provenance.written_by()  # which code exported it: version, commit, dirty
    signature = mlflow.models.Model.load(str(deepfm["model"])).signature
    assert [(c.name, c.type.name) for c in signature.inputs.inputs] == [(n, "string") for n in spec["input_columns"]]
    with pytest.raises(Exception, match=r"Model is missing inputs \['item'\]"):  # MLflow's signature check names it
        model.predict(as_text.drop(columns=["item"]))
    with pytest.raises(Exception, match=r"the request has no column 'item'.*Fix: send every one of them"):  # and so does the model
        ServedModel(str(deepfm["model"] / "data" / "data")).predict(as_text.drop(columns=["item"]))
    with pytest.raises(Exception, match=r"request row 1, column 'price': 'cheap' is not a number.*Fix the request"):
        model.predict(as_text.head(3).assign(price=["1.0", "cheap", "2"]))



def test_a_list_in_a_column_of_one_value_per_row_is_refused_naming_it(deepfm: dict[str, Any]) -> None:
    """A list sent where training read one value per row: in an id column the encoder would pool its ids into one bag (two
    users scored as one row training never saw), in a dense column Arrow cannot cast it — both a named 400, while a
    multi-hot column (``tags``) still takes lists."""
    import mlflow.pyfunc

    model = mlflow.pyfunc.load_model(str(deepfm["model"]))
    rows = pd.read_csv(deepfm["root"] / "score.csv", dtype=str).head(3)
    with pytest.raises(Exception, match=r"request row 1, column 'user' holds a list \(\['u1', 'u2'\]\), but the model reads one value per "
                                        r"row in it\. Fix: send one value per row in 'user' \(a list per row only in \['tags'\]\)"):
        model.predict(rows.assign(user=[None, ["u1", "u2"], None]))
    with pytest.raises(Exception, match=r"request row 0, column 'price' holds a list \(\['1.5'\]\).*Fix: send one value per row in 'price'"):
        model.predict(rows.assign(price=[["1.5"], ["2"], ["3"]]))
    listed = rows.assign(tags=[t.split("|") if isinstance(t, str) else [] for t in rows["tags"]])
    np.testing.assert_allclose(model.predict(listed)["score"].to_numpy(), deepfm["reference"]["score"].to_numpy()[:3], atol=ATOL)


@pytest.fixture(scope="module")
def served(deepfm: dict[str, Any]) -> Any:
    """The DeepFM's MLflow model, loaded once through MLflow (its signature checked on every call, as a caller's is)."""
    import mlflow.pyfunc

    return mlflow.pyfunc.load_model(str(deepfm["model"]))


def _objects(*values: object) -> pd.Series:
    return pd.Series(values, dtype=object)


# Typed columns as pandas holds them (read_csv without dtype=str, read_parquet, JSON-made frames): MLflow's check of the text
# signature refuses each before the model runs, naming the column; the documented fix, ``frame.astype(object)``, scores them as
# the text a CSV held (docs/export.md, "A bad request").
TYPED = {
    "int ids": lambda rows: rows.assign(item=rows["item"].astype("int64")),
    "whole float ids": lambda rows: rows.assign(item=rows["item"].astype("float64")),
    "float ids with a gap": lambda rows: rows.assign(item=rows["item"].astype("float64").where(rows.index != 1)),
    "nullable Int64 ids": lambda rows: rows.assign(item=rows["item"].astype("Int64").where(rows.index != 1)),
    "category ids": lambda rows: rows.assign(item=rows["item"].astype("category")),
    "float prices": lambda rows: rows.assign(price=rows["price"].astype("float64")),
    "int prices": lambda rows: rows.assign(price=rows["price"].astype("float64").round().astype("int64")),
}


@pytest.mark.parametrize("case", list(TYPED))
def test_a_typed_column_is_named_before_the_model_runs_and_scores_as_text_once_objects(deepfm: dict[str, Any], served: Any,
                                                                                      case: str) -> None:
    rows = pd.read_csv(deepfm["root"] / "score.csv", dtype=str).head(3).drop(columns=["click"]).assign(price=["2", "3.5", "4"])
    typed = TYPED[case](rows)
    column = "price" if "price" in case else "item"
    with pytest.raises(Exception, match=rf"Incompatible input types for column {column}\. Can not safely convert"):
        served.predict(typed)  # MLflow's own check, before our code: docs/export.md quotes it with the fix
    same_text = rows.astype(object).where(typed.notna(), None).assign(price=typed["price"].astype(str))  # what the CSV held
    np.testing.assert_allclose(served.predict(typed.astype(object))["score"].to_numpy(), served.predict(same_text)["score"].to_numpy(), atol=0)


# Requests that pass MLflow's check and reach the model: each refused naming the row, the column, what it reads and the fix,
# where each was scored silently (a boolean read as an id or a tag), refused by Arrow unnamed (a dict) or named as a list in its
# first column only (a dict of lists, which MLflow reads as one row).
REFUSED = {
    "a boolean id": (lambda rows: rows.assign(item=_objects(True, False, True)),
                     r"request row 0, column 'item' holds the boolean True, but the model reads text in it: read as such, it would "
                     r"silently become the text 'true'\. Fix: send text in 'item', as the training files held it \(e\.g\. the text 'True'\)"),
    "a boolean price": (lambda rows: rows.assign(price=_objects(None, False, True)),
                        r"request row 1, column 'price' holds the boolean False, but the model reads numbers \(or their text\) in it: "
                        r"read as such, it would silently become 0\. Fix: send numbers \(or their text\) in 'price'$"),
    "booleans as tags": (lambda rows: rows.assign(tags=_objects([], [False], [True, True])),
                         r"request row 1, column 'tags' holds the boolean False, but the model reads text in it"),
    "a dict as a price": (lambda rows: rows.assign(price=_objects({"eur": 1.5}, None, None)),
                          r"request row 0, column 'price' holds \{'eur': 1\.5\} \(struct<eur: double>\), but the model reads numbers "
                          r"\(or their text\) in it\. Fix: send numbers \(or their text\) in 'price'"),
    "a dict of lists": (lambda rows: rows.fillna("").to_dict(orient="list"),
                        r"the request is one row holding a list in every column of one value per row \(\['price', 'user', 'item'\]\): "
                        r"MLflow reads a dict of columns .* as ONE row of lists.*Fix: send .*pd\.DataFrame\(request\)"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_request_the_model_cannot_read_is_refused_naming_its_column_and_the_fix(deepfm: dict[str, Any], served: Any, case: str) -> None:
    rows = pd.read_csv(deepfm["root"] / "score.csv", dtype=str).head(3).drop(columns=["click"])
    change, message = REFUSED[case]
    with pytest.raises(Exception, match=message) as refused:
        served.predict(change(rows))
    assert type(refused.value).__name__ == "BadRequest"  # MLflow's BAD_REQUEST: `mlflow models serve` answers 400


def test_a_dict_of_one_row_and_a_twice_named_column_past_the_signature(deepfm: dict[str, Any]) -> None:
    """Called past MLflow (``ServedModel`` itself, as MLflow's own conversion of a dict is not there): a dict of one value
    per column is one row, as MLflow reads it; a column named twice is named, not an AttributeError from pandas."""
    unit = ServedModel(str(deepfm["model"] / "data" / "data"))
    rows = pd.read_csv(deepfm["root"] / "score.csv", dtype=str).head(2)
    one = {k: (None if pd.isna(v) else v) for k, v in rows.iloc[0].items()}
    np.testing.assert_allclose(unit.predict(one)["score"].to_numpy(), unit.predict(rows.head(1))["score"].to_numpy(), atol=0)
    with pytest.raises(Exception, match=r"the request has the column 'item' more than once: the model cannot tell which to read\. "
                                        r"Fix: send each column once"):
        unit.predict(pd.concat([rows, rows[["item"]]], axis=1))


BLOCKER = """
import importlib.abc, sys
BLOCKED = ("recsys_runner", "torchrec", "fbgemm_gpu")
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is blocked: the served model must not need it")
sys.meta_path.insert(0, Block())
import mlflow.pyfunc, pandas as pd
model = mlflow.pyfunc.load_model(sys.argv[1])
scores = model.predict(pd.read_csv(sys.argv[2], dtype=str))["score"].tolist()
assert not [m for m in sys.modules if m.split(".")[0] in BLOCKED]
print("SCORES", __import__("json").dumps(scores))
"""


def test_pyfunc_model_runs_where_recsys_runner_torchrec_and_fbgemm_cannot_be_imported(deepfm: dict[str, Any], tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # -W always: the user's process has no recsys_runner.noise, so loading and calling the model must warn of nothing
    # (Python's default filters would hide a DeprecationWarning such as pandas' Pandas4Warning; a notebook or pytest not)
    proc = subprocess.run([sys.executable, "-W", "always", "-c", BLOCKER, str(deepfm["model"]), str(deepfm["root"] / "score.csv")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Warning" not in proc.stderr, proc.stderr[-3000:]
    scores = json.loads(proc.stdout.split("SCORES", 1)[1])
    np.testing.assert_allclose(scores, deepfm["reference"]["score"].to_numpy(), atol=ATOL)


SHIPPED_STEMS = (*served_module.SHIPPED.values(), served_topk.LOADER_MODULE, served_topk.TOP_K_MODULE)
"""The stems of every module an MLflow model carries in code/ (hashed or, exported before the hashes, not)."""


@contextmanager
def _fresh_code() -> Iterator[None]:
    """This process as if it had loaded no MLflow model: its models' code modules taken out of ``sys.modules`` for the
    block (and ``sys.path``, which MLflow prepends each model's code/ to, as it was), then put back as they were."""
    def shipped(name: str) -> bool:
        return any(name == stem or name.startswith(f"{stem}_") for stem in SHIPPED_STEMS)

    hidden, path = {n: m for n, m in sys.modules.items() if shipped(n)}, list(sys.path)
    for name in hidden:
        del sys.modules[name]
    try:
        yield
    finally:
        for name in [n for n in sys.modules if shipped(n)]:
            del sys.modules[name]
        sys.modules.update(hidden)
        sys.path[:] = path


def _another_version(model: Path, out: Path, times: int, hashed: bool = True) -> Path:
    """A copy at ``out`` of the MLflow model ``model`` as another recsys_runner version would have exported it: its served
    program's logits multiplied by ``times`` (a change to ``served_program``, a module the loader imports), its code named
    by the hash of that set as ``export`` names it, or (``hashed=False``) under the fixed names models exported before the
    hashes carried, without the check of their code those added on 2026-12-01 (such a model cannot refuse anything)."""
    shutil.copytree(model, out, ignore=shutil.ignore_patterns("code"))
    code = out / "code"
    code.mkdir()
    change = (f"\n\n_exported_load_program = load_program\n\n\ndef load_program(directory):  # another version's serving\n"
              f"    program = _exported_load_program(directory)\n    return lambda *inputs: program(*inputs) * {times}\n")
    program = out.parent / f"{out.name}_served_program.py"
    program.write_text(Path(str(served_program.__file__)).read_text() + change)
    if hashed:
        loader = mlflow_model.copy_shipped(code, {served_module.SHIPPED["served_program"]: str(program)})[served_module.LOADER_MODULE]
    else:
        for name, stem in served_module.SHIPPED.items():
            source = program if name == "served_program" else Path(str(importlib.import_module(f"{served_module.__package__}.{name}").__file__))
            text = source.read_text().replace("    _program.check_own_code(data_path)\n", "")
            (code / f"{stem}.py").write_text(text)
        loader = served_module.LOADER_MODULE
    meta = yaml.safe_load((out / "MLmodel").read_text())
    meta["flavors"]["python_function"]["loader_module"] = loader
    (out / "MLmodel").write_text(yaml.safe_dump(meta))
    return out


def _sharpened(score: np.ndarray, times: int) -> np.ndarray:
    """The binary score of ``times`` x the logit of ``score``."""
    return np.asarray(score**times / (score**times + (1 - score) ** times))


def test_models_of_other_code_run_side_by_side_each_its_own_whichever_loads_first(deepfm: dict[str, Any], tmp_path: Path) -> None:
    """Two MLflow models of other code in one process (a notebook comparing the models of two recsys_runner versions, one
    server hosting both): MLflow imports a model's code/ by module name, which Python imports once per process, so under
    fixed names the second model ran the first one's code on its own data — unsaid when the first was exported before the
    check of 2026-12-01, refused (so never both) when it had it. A model's modules are now named by the hash of its code,
    so each of two models, in either order, answers with its own; beside a model of the fixed names too."""
    import mlflow.pyfunc

    rows = pd.read_csv(deepfm["root"] / "score.csv", dtype=str)
    reference = deepfm["reference"]["score"].to_numpy()
    models = {"this": (deepfm["model"], reference),
              "doubled": (_another_version(deepfm["model"], tmp_path / "doubled", 2), _sharpened(reference, 2)),
              "fixed names": (_another_version(deepfm["model"], tmp_path / "fixed", 3, hashed=False), _sharpened(reference, 3))}
    loaders = {k: mlflow.models.Model.load(str(path)).flavors["python_function"]["loader_module"] for k, (path, _) in models.items()}
    assert loaders["this"] != loaders["doubled"] and loaders["fixed names"] == served_module.LOADER_MODULE
    assert np.abs(models["doubled"][1] - reference).max() > 0.05  # the change shows in the scores
    for order in (("fixed names", "this"), ("this", "fixed names"), ("this", "doubled"), ("doubled", "this")):
        with _fresh_code():
            loaded = [mlflow.pyfunc.load_model(str(models[k][0])) for k in order]
            for k, model in zip(order, loaded, strict=True):  # each asked after both were loaded
                np.testing.assert_allclose(model.predict(rows)["score"].to_numpy(), models[k][1], atol=3 * ATOL, err_msg=f"{order}: {k}")


def test_a_model_whose_code_was_edited_after_export_is_refused_beside_the_unedited_one(deepfm: dict[str, Any], tmp_path: Path) -> None:
    """A model's code/ edited by hand keeps its names, which then no longer say what its files hold: loaded beside a model of
    the unedited files (either first), one would run the other's code. Its load names the clash and the fix; an unedited
    copy of the model (another export of this version) loads beside it."""
    import mlflow.pyfunc

    edited = tmp_path / "edited"
    shutil.copytree(deepfm["model"], edited)
    (values,) = (edited / "code").glob(f"{served_module.SHIPPED['values']}_*.py")
    with values.open("a") as f:
        f.write("\n# patched by hand\n")
    same = tmp_path / "same"
    shutil.copytree(deepfm["model"], same)
    for first, second in ((edited, deepfm["model"]), (deepfm["model"], edited)):
        with _fresh_code():
            mlflow.pyfunc.load_model(str(first))  # the first model of the process: its code is what the process imports
            # the class of the first model's copy (recsys_served_program_<hash>.CodeClash), not of recsys_runner's module
            with pytest.raises(RuntimeError, match=rf"the MLflow model {second} cannot be loaded into this process: it "
                                                   rf"already runs the code of another model \({first}\), whose {values.name} "
                                                   r"differs .*Fix: load each of the two in its own process") as clash:
                mlflow.pyfunc.load_model(str(second))
            assert type(clash.value).__name__ == served_program.CodeClash.__name__
    with _fresh_code():
        mlflow.pyfunc.load_model(str(deepfm["model"]))
        mlflow.pyfunc.load_model(str(same))


@pytest.fixture(scope="module")
def din(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """DIN on a CSV whose history cells hold ``|``-separated events; the rows to score hold unseen items."""
    root = tmp_path_factory.mktemp("din")
    write_csv(root / "train.csv", histories(0, 600))
    scored = histories(1, 120)
    for r, row in enumerate(scored[:40]):  # items (candidates and history events) never seen in training
        row["item"] = f"new{r}"
        if row["hist_item"]:
            row["hist_item"] = [*row["hist_item"][:-1], f"gone{r}"]
    write_csv(root / "score.csv", scored)
    (root / "schema.yaml").write_text(yaml.safe_dump(columns("|")))
    data = ["data=csv", f"data.path={root}/train.csv", f"data.schema={root}/schema.yaml", "data.batch_size=64", "model=din",
            "distributed.device=cpu", "tracking=none"]
    trained = _trained(root, data, steps=10)
    trained["reference"] = _scores(data, trained["checkpoint"], root / "score.csv", root / "predicted")
    return trained


def _post(port: int, body: str, content_type: str = "text/csv") -> tuple[int, str]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", data=body.encode(), headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.mark.slow
def test_mlflow_models_serve_answers_raw_csv_rows_with_predicts_scores(din: dict[str, Any], tmp_path: Path) -> None:
    port = free_port()
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115 - closed below, after the server is stopped
    bin_dir = os.path.dirname(sys.executable)  # the server execs uvicorn from the environment's bin/
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "models", "serve", "-m", str(din["model"]), "--env-manager", "local",
                               "--host", "127.0.0.1", "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                              env=env)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=5):
                    break
            except OSError:
                assert time.monotonic() < deadline, "mlflow models serve did not answer /ping in 180 s"
                time.sleep(0.5)
        body = (din["root"] / "score.csv").read_text()
        status, answer = _post(port, body)
        assert status == 200, answer
        served = pd.DataFrame(json.loads(answer)["predictions"])
        np.testing.assert_allclose(served["score"].to_numpy(), din["reference"]["score"].to_numpy(), atol=ATOL)

        frame = pd.read_csv(io.StringIO(body), dtype=str, keep_default_na=False)
        split = {"columns": list(frame.columns), "data": [[int(v) if c in ("user", "category") else v for c, v in zip(frame.columns, row, strict=True)]
                                                         for row in frame.head(20).itertuples(index=False)]}
        status, answer = _post(port, json.dumps({"dataframe_split": split}), "application/json")  # ids as JSON numbers
        assert status == 200, answer
        served = pd.DataFrame(json.loads(answer)["predictions"])
        np.testing.assert_allclose(served["score"].to_numpy(), din["reference"]["score"].to_numpy()[:20], atol=ATOL)
        status, answer = _post(port, json.dumps({"dataframe_split": {"columns": split["columns"], "data": []}}), "application/json")
        assert (status, json.loads(answer)) == (200, {"predictions": []}), answer  # no rows: no scores, not a traceback
        status, answer = _post(port, frame.drop(columns=["hist_item"]).head(3).to_csv(index=False))
        assert 400 <= status < 500 and "hist_item" in answer, answer
        status, answer = _post(port, frame.head(3).assign(category=["1", "two", "3"]).to_csv(index=False))
        assert 400 <= status < 500 and "column 'category'" in answer and "'two'" in answer, answer
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
        log.close()


def test_multi_task_model_serves_one_column_per_task(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Also ``export.compile=true`` reaching the MLflow model's writer: the compiler is replaced by one that cannot compile
    (what a machine without a C++ compiler gives; the real compile is tests/test_served_fast_paths.py's), so the model is
    served as torch.export's program and scores as predict does."""
    import mlflow.pyfunc

    asked: list[str] = []

    def cannot_compile(program: object, path: str) -> bool:
        asked.append(path)
        return False

    monkeypatch.setattr(mlflow_model, "compile_program", cannot_compile)

    rng = np.random.default_rng(1)
    header = "click,buy,user,item,price,tags"
    users = [f"u{k}" for k in range(30)]
    (tmp_path / "train.csv").write_text("\n".join([header, *_click_rows(rng, 1500, users, two_labels=True)]) + "\n")
    (tmp_path / "score.csv").write_text("\n".join([header, *_click_rows(rng, 100, [*users, "newcomer"], two_labels=True)]) + "\n")
    data = ["data=csv", f"data.path={tmp_path}/train.csv", "data.batch_size=128", "data.labels={ctr: click, cvr: buy}", "data.label=null",
            "data.sparse=[{name: user}, {name: item}, {name: tags, separator: '|'}]", "data.dense=[{name: price}]", "model=mmoe",
            "distributed.device=cpu", "tracking=none"]
    trained = _trained(tmp_path, data, 8, "export.compile=true")
    assert [Path(p).name for p in asked] == [served_program.COMPILED_FILE]
    reference = _scores(data, trained["checkpoint"], tmp_path / "score.csv", tmp_path / "predicted")
    served = mlflow.pyfunc.load_model(str(trained["model"])).predict(pd.read_csv(tmp_path / "score.csv", dtype=str))
    assert list(served.columns) == ["score_ctr", "score_cvr"] == [c for c in reference.columns if c.startswith("score")]
    for column in served.columns:
        np.testing.assert_allclose(served[column].to_numpy(), reference[column].to_numpy(), atol=ATOL)


def test_register_as_logs_the_model_to_the_export_run_and_registers_a_version(deepfm: dict[str, Any]) -> None:
    from mlflow.tracking import MlflowClient

    uri = deepfm["uri"]
    client = MlflowClient(tracking_uri=uri)
    (version,) = client.search_model_versions("name='ctr-deepfm'")
    run = client.get_run(version.run_id)
    assert run.data.tags.get("entry") == "export"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "export")}
    assert "export/mlflow_model" in artifacts and "export/model.pt2" in artifacts
    (logged,) = client.search_logged_models(experiment_ids=[run.info.experiment_id])  # the run's model, as the UI lists it
    assert logged.source_run_id == run.info.run_id and logged.name == "model"
    import mlflow
    import mlflow.pyfunc

    before = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    try:
        registered = mlflow.pyfunc.load_model(f"models:/ctr-deepfm/{version.version}")
    finally:
        mlflow.set_tracking_uri(before)
    scores = registered.predict(pd.read_csv(deepfm["root"] / "score.csv", dtype=str))["score"].to_numpy()
    np.testing.assert_allclose(scores, deepfm["reference"]["score"].to_numpy(), atol=ATOL)


def test_two_tower_model_serves_each_tower_apart(tmp_path: Path) -> None:
    """DSSM: a user model and an item model, each reading only its tower's raw columns; their vectors score as the
    whole exported model does (``scores = user · item / temperature``)."""
    import mlflow.pyfunc
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import torch

    from recsys_runner.data.encoding.rows import Encoder, Location
    from recsys_runner.data.encoding.stored import read_stored
    from recsys_runner.errors import DataError

    rng = np.random.default_rng(2)
    lines = ["click,user,age,item,tags"]
    for _ in range(1200):
        u, i = int(rng.integers(30)), int(rng.integers(25))
        tags = "|".join(f"t{(i + k) % 6}" for k in range(int(rng.integers(1, 3))))
        lines.append(f"1,u{u},{20 + u % 40},{i},{tags}")
    (tmp_path / "train.csv").write_text("\n".join(lines) + "\n")
    (tmp_path / "score.csv").write_text("\n".join([lines[0], *lines[1:40], "1,stranger,33,999,t1|t9"]) + "\n")
    data = ["data=csv", f"data.path={tmp_path}/train.csv", "data.batch_size=64", "data.label=click",
            "data.sparse=[{name: user}, {name: item}, {name: tags, separator: '|'}]", "data.dense=[{name: age}]", "model=dssm",
            "model.user_features=[user,age]", "model.item_features=[item,tags]", "model.logq_correction=false", "distributed.device=cpu",
            "tracking=none"]
    trained = _trained(tmp_path, data, steps=6)
    out = trained["model"].parent
    assert not (out / mlflow_model.MODEL_DIR).exists()  # in-batch softmax scores rows against rows: served as its towers
    rows = pd.read_csv(tmp_path / "score.csv", dtype=str)
    user = mlflow.pyfunc.load_model(str(out / "mlflow_user_tower")).predict(rows[["user", "age"]])
    item = mlflow.pyfunc.load_model(str(out / "mlflow_item_tower")).predict(rows[["item", "tags"]])
    assert list(mlflow.pyfunc.load_model(str(out / "mlflow_user_tower")).predict(rows[["user", "age"]].head(0)).columns) == ["vector"]
    temperature = json.loads((out / export.FEATURE_SPEC_FILE).read_text())["towers"]["temperature"]
    served = np.stack(user["vector"].to_numpy()) @ np.stack(item["vector"].to_numpy()).T / temperature

    stored = read_stored(trained["checkpoint"])
    assert stored is not None
    table = pacsv.read_csv(tmp_path / "score.csv", convert_options=pacsv.ConvertOptions(column_types=dict.fromkeys(rows.columns, pa.string())))
    encoded = Encoder(stored.schema, "fail", DataError).encode(table, Location("score.csv", "rows", np.arange(table.num_rows), 2))
    program = torch.export.load(str(out / export.MODEL_FILE)).module()
    with torch.no_grad():
        whole = program(torch.as_tensor(encoded.dense), torch.as_tensor(np.concatenate([v for v, _ in encoded.sparse]).astype(np.int64)),
                        torch.as_tensor(np.stack([ln for _, ln in encoded.sparse]).astype(np.int64)))
    np.testing.assert_allclose(served, whole.numpy(), atol=1e-4)


def test_every_transform_is_served_as_predict_scores_it(tmp_path: Path) -> None:
    """Clip, log1p and zscore; numbers bucketized by fitted quantiles; a vocabulary from a file; a cross; weighted tags:
    each fitted (or read) when training starts, stored, and applied alike by predict and the served model — on rows with
    unseen users, items outside the vocab file, missing numbers."""
    import mlflow.pyfunc

    rng = np.random.default_rng(3)

    def rows(n: int, users: int) -> list[str]:
        out = []
        for _ in range(n):
            u, i = int(rng.integers(users)), int(rng.integers(30))
            tags = "|".join(f"t{int(t)}:{rng.random() * 3:.2f}" for t in rng.integers(0, 6, int(rng.integers(0, 4))))
            price = "" if rng.random() < 0.1 else f"{rng.random() * 80:.2f}"
            out.append(f"{int((u + i) % 3 == 0)},u{u},{i},{price},{int(rng.integers(18, 70))},{tags}")
        return out

    header = "click,user,item,price,age,tags"
    (tmp_path / "train.csv").write_text("\n".join([header, *rows(2000, 40)]) + "\n")
    (tmp_path / "score.csv").write_text("\n".join([header, *rows(200, 60)]) + "\n")
    (tmp_path / "items.txt").write_text("\n".join(str(i) for i in range(25)) + "\n")  # items 25-29: OOV rows
    (tmp_path / "schema.yaml").write_text(yaml.safe_dump({
        "label": "click",
        "dense": [{"name": "price", "clip": [0, 60], "transform": "log1p", "normalize": "zscore"}],
        "sparse": [{"name": "user"}, {"name": "item", "vocab_file": str(tmp_path / "items.txt")}, {"name": "age", "quantiles": 4},
                   {"name": "user_x_item", "cross": ["user", "item"], "num_embeddings": 500},
                   {"name": "tags", "separator": "|", "weighted": True}]}))
    data = ["data=csv", f"data.path={tmp_path}/train.csv", f"data.schema={tmp_path}/schema.yaml", "data.batch_size=128", "model=deepfm",
            "distributed.device=cpu", "tracking=none"]
    trained = _trained(tmp_path, data, steps=10)
    stored = json.loads((trained["checkpoint"] / "encoders.json").read_text())
    fitted = {c["name"]: c for c in stored["sparse"]}
    assert len(fitted["age"]["boundaries"]) == 3 and fitted["tags"]["weighted"] and fitted["user_x_item"]["cross"] == ["user", "item"]
    assert stored["dense"][0]["mean"] is not None and set(stored["vocabularies"]) >= {"user", "item", "tags"}
    reference = _scores(data, trained["checkpoint"], tmp_path / "score.csv", tmp_path / "predicted")
    served = mlflow.pyfunc.load_model(str(trained["model"])).predict(pd.read_csv(tmp_path / "score.csv", dtype=str))
    np.testing.assert_allclose(served["score"].to_numpy(), reference["score"].to_numpy(), atol=ATOL)
    unit = ServedModel(str(trained["model"] / "data" / "data"))
    with pytest.raises(Exception, match=r"request row 0, column 'tags': .*weight"):
        unit.predict(pd.read_csv(tmp_path / "score.csv", dtype=str).head(2).assign(tags=["t1:heavy", "t2:1"]))


def test_a_request_of_no_rows_gets_every_output_column_of_its_dtype() -> None:
    """What a served model answers a request of no rows (its program's batch is at least one row): the columns, in their
    order and dtypes, that one row gets — for each output kind (a multi-class task's class and probability, a tower's
    vectors)."""
    import torch

    outputs = [{"column": "score_ctr", "task": "ctr", "kind": "binary"}, {"column": "score_genre", "task": "genre", "kind": "multiclass"},
               {"column": "score_time", "task": "time", "kind": "regression"}]
    one = pd.DataFrame(served_module.scores({"ctr": torch.zeros(1), "genre": torch.zeros(1, 4), "time": torch.zeros(1)}, outputs))
    none = pd.DataFrame(served_module.empty_scores(outputs))
    assert len(none) == 0 and list(none.columns) == list(one.columns) == ["score_ctr", "class_genre", "score_genre", "score_time"]
    assert list(none.dtypes) == list(one.dtypes)
    vector = [{"column": "vector", "task": None, "kind": "vector"}]
    one, none = (pd.DataFrame(f(*a)) for f, a in ((served_module.scores, (torch.zeros(1, 3), vector)), (served_module.empty_scores, (vector,))))
    assert list(none.columns) == list(one.columns) == ["vector"] and list(none.dtypes) == list(one.dtypes)


def test_parquet_ids_with_gaps_are_served_from_text(tmp_path: Path) -> None:
    """A Parquet-trained model: integer ids with missing values (pandas would make floats of them), float prices with
    gaps, a list column with missing and empty cells. The signature is text (the list an optional array: MLflow refuses a
    missing cell in a required one); the served model casts each column back to the type training read, and reads what a
    request holds for a missing number as missing."""
    import mlflow.pyfunc
    import pyarrow as pa

    rng = np.random.default_rng(4)

    def table(n: int) -> pa.Table:
        users = [None if rng.random() < 0.1 else int(u) for u in rng.integers(0, 2**40, n) % 37 + 10**12]
        price = [None if rng.random() < 0.1 else float(p) for p in rng.random(n) * 9]
        tags = [None if r % 9 == 0 else [f"t{int(t)}" for t in rng.integers(0, 6, int(rng.integers(0, 3)))] for r in range(n)]
        click = [int((u or 0) % 2) for u in users]
        return pa.table({"click": pa.array(click, pa.int8()), "user": pa.array(users, pa.int64()), "price": pa.array(price, pa.float64()),
                         "tags": pa.array(tags, pa.list_(pa.string()))})

    pq.write_table(table(1500), tmp_path / "train.parquet")
    pq.write_table(table(100), tmp_path / "score.parquet")
    data = ["data=parquet", f"data.path={tmp_path}/train.parquet", "data.batch_size=128", "data.label=click", "model=deepfm",
            "distributed.device=cpu", "tracking=none"]
    trained = _trained(tmp_path, data, steps=6)
    reference = _scores(data, trained["checkpoint"], tmp_path / "score.parquet", tmp_path / "predicted")
    rows = pq.read_table(tmp_path / "score.parquet").select(["user", "price", "tags"])
    assert rows.column("user").null_count > 0 and rows.column("tags").null_count > 0
    model = mlflow.pyfunc.load_model(str(trained["model"]))
    request = mlflow_model.as_request(rows)
    served = model.predict(request)
    np.testing.assert_allclose(served["score"].to_numpy(), reference["score"].to_numpy(), atol=ATOL)
    unit = ServedModel(str(trained["model"] / "data" / "data"))
    with pytest.raises(Exception, match=r"column 'user' cannot be read as int64"):
        unit.predict(request.assign(user="someone"))
    # What other senders hold for a missing number: "" (a CSV body), "None" and "nan" (MLflow's `inputs` form makes them of a
    # JSON null and NaN, pandas' astype(str) of a NaN), and an integer column with gaps as pandas writes it ("1000000000012.0"),
    # and list cells as MLflow's `inputs` form hands them over (NumPy arrays, an empty one float64 beside text ones)
    for absent in ("", "None", "nan"):
        texts = request.assign(user=[absent if pd.isna(u) else f"{u}.0" for u in request["user"]],
                               price=[absent if pd.isna(p) else p for p in request["price"]],
                               tags=[np.array(t, dtype=object) if t is not None and len(t) else np.array([]) for t in request["tags"]])
        np.testing.assert_allclose(model.predict(texts)["score"].to_numpy(), reference["score"].to_numpy(), atol=ATOL)
    as_str = pq.read_table(tmp_path / "score.parquet").to_pandas().astype({"user": str, "price": str})  # "nan", "1000000000012.0"
    np.testing.assert_allclose(model.predict(as_str)["score"].to_numpy(), reference["score"].to_numpy(), atol=ATOL)
    empty = model.predict(request.head(0))  # no rows: no scores (the program's batch is at least one row)
    assert list(empty.columns) == ["score"] and len(empty) == 0 and empty["score"].dtype == np.float32
    # the list column is ``any`` in the signature (MLflow's array check names no column): the served model names it, and
    # reads numbers in a list of text ids as their text, as it reads them in a single-valued column
    with pytest.raises(Exception, match=r"column 'tags' cannot be read .*Fix: send one kind of value in it"):
        model.predict(request.head(2).assign(tags=[["t1"], "t2"]))
    np.testing.assert_allclose(model.predict(request.head(2).assign(tags=[[1, 2], []]))["score"].to_numpy(),
                               model.predict(request.head(2).assign(tags=[["1", "2"], []]))["score"].to_numpy(), atol=0)
    assert [c.type.to_dict() for c in model.metadata.get_input_schema().inputs if c.name == "tags"] == [{"type": "any"}]
    # ids as floats (what pandas makes of a JSON request's integers beside a null) beyond 2**53 may have lost digits already
    np.testing.assert_allclose(unit.predict(request.head(2).assign(user=[1000000000012.0, np.nan]))["score"].to_numpy(),
                               unit.predict(request.head(2).assign(user=["1000000000012", None]))["score"].to_numpy(), atol=ATOL)
    with pytest.raises(Exception, match=r"column 'user' holds the id 9007199254740994 as a floating-point number.*Fix: send the ids as text"):
        unit.predict(request.head(2).assign(user=[float(2**53 + 2), np.nan]))
    # an id that is not whole is not cut to another id, and a boolean is not the id 1 (both reach the model through MLflow's
    # check as Python objects: a JSON request's numbers and booleans)
    with pytest.raises(Exception, match=r"request row 1, column 'user' holds 1\.5, which is not a whole number, but the model reads whole "
                                        r"numbers \(int64\) or their text in it.*Fix: send the ids of 'user' as whole numbers"):
        model.predict(request.head(2).assign(user=pd.Series([7.0, 1.5], dtype=object)))
    with pytest.raises(Exception, match=r"request row 0, column 'user' holds the boolean True.*it would silently become 1\."):
        model.predict(request.head(2).assign(user=pd.Series([True, None], dtype=object)))


def test_a_criteo_model_serves_raw_lines_whose_empty_fields_are_missing_values(tmp_path: Path) -> None:
    """``data=criteo`` reads an empty field as missing (a count takes its fill, a categorical is an empty bag); the served
    model was told no missing-value text (``null_values`` came only from ``data=csv``), so a raw Criteo line, as
    ``pd.read_csv(..., dtype=str, keep_default_na=False)`` or a CSV request body gives it, was refused: ``'' is not a
    number``."""
    import mlflow.pyfunc

    from recsys_runner.data.files.criteo_config import CRITEO_COLUMNS
    from recsys_runner.data.generated.generate import write_criteo_tsv

    write_criteo_tsv(str(tmp_path / "train.txt"), 400, cardinality=30)
    data = ["data=criteo", f"data.path={tmp_path}/train.txt", "data.batch_size=64", "model=deepfm", "distributed.device=cpu",
            "tracking=none"]
    trained = _trained(tmp_path, data, 3)
    raw = pd.read_csv(tmp_path / "train.txt", sep="\t", header=None, names=CRITEO_COLUMNS, dtype=str, keep_default_na=False)
    assert (raw[["int_0", "cat_0"]] == "").any().all(), "the rows must hold empty counts and categoricals"
    reference = _scores(data, trained["checkpoint"], tmp_path / "train.txt", tmp_path / "predicted")["score"].to_numpy()
    served = mlflow.pyfunc.load_model(str(trained["model"])).predict(raw.drop(columns=["label"]))
    np.testing.assert_allclose(served["score"].to_numpy(), reference, atol=ATOL)
