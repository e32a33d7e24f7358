"""``python -m recsys_runner.compare --repeats <key>``: runs that differ only in a seed are one row (mean ± std, ``n``,
best mean first), with Welch's p against the best and a note on whether the best two differ by more than their spread;
the ``sweeps/seeds.yaml`` preset makes such runs."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient

from recsys_runner import compare
from recsys_runner.compare_repeats import group_runs, spread_note, welch_p
from tests.conftest import REPO, TINY, run_in_process

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run(client: MlflowClient, exp: str, lr: float, seed: int, auc: float | None, status: str = "FINISHED",
         data_seed: int = 0) -> None:
    """A sweep child as the runner logs it: the flattened config, ``swept.*`` copies of the swept keys, final metrics."""
    rid = client.create_run(exp, run_name=f"lr={lr} seed={seed}").info.run_id
    params = {"optim.lr": lr, "seed": seed, "data.seed": data_seed, "model._target_": "recsys_runner.models.deepfm.DeepFM",
              "swept.optim.lr": lr, "swept.seed": seed, "tracking.run_name": f"lr={lr} seed={seed}"}
    metrics = [Metric("train/loss", 0.5 + lr, 0, 30)] + ([Metric("eval/auc", auc, 0, 30)] if auc is not None else [])
    client.log_batch(rid, metrics=metrics, params=[Param(k, str(v)) for k, v in params.items()])
    client.set_terminated(rid, status)


@pytest.fixture(scope="module")
def seeds(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One store (made once: a new sqlite store costs seconds of migrations) of two experiments. ``seeds``: lr=0.1 over
    3 seeds, lr=0.01 over 3 seeds and a 4th that failed before its eval, lr=0.5 once; interleaved as a sweep's jobs run.
    ``both``: one configuration whose ``seed`` and ``data.seed`` changed together."""
    uri = f"sqlite:///{tmp_path_factory.mktemp('repeats')}/seeds.db"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("seeds")
    for seed, (a, b) in enumerate([(0.7100, 0.7080), (0.7120, 0.7110), (0.7140, 0.7140)]):
        _run(client, exp, 0.1, seed, a)
        _run(client, exp, 0.01, seed, b)
    _run(client, exp, 0.01, 3, None, status="FAILED")
    _run(client, exp, 0.5, 0, 0.6900)
    both = client.create_experiment("both")
    for seed, auc in enumerate([0.70, 0.71]):
        _run(client, both, 0.1, seed, auc, data_seed=seed)
    return uri


def _rows(out: str) -> list[list[str]]:
    return [re.split(r"\s{2,}", line.strip()) for line in out.splitlines() if line and not line.startswith("-")]


def test_repeats_are_one_row_with_mean_std_n_best_mean_first(seeds: str, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert compare.main(["--uri", seeds, "--experiment", "seeds", "--repeats", "seed", "--metric", "eval/auc",
                         "--metric", "train/loss", "--out", str(tmp_path / "plots")]) == 0
    out = capsys.readouterr().out
    table, note = out.split("\neval/auc: ")
    header, *rows = _rows(table)
    # seed and its sweep copy swept.seed are no column; swept.optim.lr repeats optim.lr: one column of the two
    assert header == ["n", "status", "optim.lr", "eval/auc", "train/loss", "p_vs_first"]
    assert rows == [["3", "FINISHED", "0.1", "0.7120 ± 0.0020", "0.6000 ± 0.0000", "-"],
                    # the failed run counts in n and status, not in the mean of a metric it never logged ([3] of 4)
                    ["4", "FINISHED:3,FAILED:1", "0.01", "0.7110 ± 0.0030 [3]", "0.5100 ± 0.0000", "0.66"],
                    ["1", "FINISHED", "0.5", "0.6900", "1.0000", "-"]]
    assert note.startswith("the first, optim.lr=0.1 (0.7120 ± 0.0020, n=3), and the second, optim.lr=0.01 "
                           "(0.7110 ± 0.0030 [3], n=3): within one std of each other: the difference may be seed noise; "
                           "Welch's t-test p=0.66"), note
    for name in ("curves.png", "eval_auc_vs_params.png"):
        assert (tmp_path / "plots" / name).read_bytes().startswith(PNG_MAGIC), name


def test_seeds_names_every_seed_param_and_a_key_that_changes_with_others_still_groups(
        seeds: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``--repeats seeds``: ``seed`` and ``data.seed`` both; runs whose seeds changed together are still one row."""
    assert compare.main(["--uri", seeds, "--experiment", "both", "--repeats", "seeds", "--no-plots"]) == 0
    header, row = _rows(capsys.readouterr().out)
    assert header[:3] == ["n", "status", "eval/auc"] and row[:3] == ["2", "FINISHED", "0.7050 ± 0.0071"]


def test_a_repeat_key_no_run_has_names_the_closest_params(seeds: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        compare.main(["--uri", seeds, "--experiment", "seeds", "--repeats", "sed", "--no-plots"])
    out, err = capsys.readouterr()
    assert stopped.value.code == 2 and not out
    assert err.strip() == ("Config error: --repeats sed: none of the 8 runs selected has sed as a param; the closest: seed, "
                           "data.seed. Fix: --repeats seed")


def test_welch_p_is_scipys() -> None:
    """Welch's two-sided p from the t distribution computed with math (scipy 1.17's ``ttest_ind(equal_var=False)``)."""
    assert welch_p([0.7100, 0.7120, 0.7140], [0.7080, 0.7110, 0.7140]) == pytest.approx(0.6595297252735348, rel=1e-9)
    assert welch_p([0.70, 0.71], [0.60, 0.62, 0.61, 0.63]) == pytest.approx(0.0005865297420382313, rel=1e-9)
    assert welch_p([1.0, 2.0, 3.0, 4.0, 5.0], [2.0, 4.0, 6.0]) == pytest.approx(0.5062141716528481, rel=1e-9)
    assert welch_p([0.7], [0.6, 0.61]) is None and welch_p([0.7, 0.7], [0.6, 0.6]) is None


def _runs(*configs: tuple[str, list[float]]) -> list[SimpleNamespace]:
    return [SimpleNamespace(data=SimpleNamespace(params={"model._target_": model, "seed": str(i)}, metrics={"eval/auc": auc}),
                            info=SimpleNamespace(status="FINISHED", run_name=None, run_id=f"{model}{i}"))
            for model, aucs in configs for i, auc in enumerate(aucs)]


def test_the_note_says_when_the_best_two_differ_by_more_than_their_spread_and_when_one_run_cannot_tell() -> None:
    apart = group_runs(_runs(("x.DLRM", [0.60, 0.62, 0.61, 0.63]), ("x.DeepFM", [0.70, 0.71])), ["seed"])
    assert spread_note(apart, "eval/auc") == ("eval/auc: the first, model._target_=DeepFM (0.7050 ± 0.0071, n=2), and the "
                                              "second, model._target_=DLRM (0.6150 ± 0.0129, n=4): more than one std apart; "
                                              "Welch's t-test p=0.000587")
    alone = group_runs(_runs(("x.DLRM", [0.60]), ("x.DeepFM", [0.70, 0.71])), ["seed"])
    assert spread_note(alone, "eval/auc") == ("eval/auc: the first, model._target_=DeepFM (0.7050 ± 0.0071, n=2), and the "
                                              "second, model._target_=DLRM (0.6000, n=1): one run alone shows no spread; "
                                              "repeat each over seeds (e.g. -m seed=0,1,2) to tell a real difference from noise")
    assert spread_note(group_runs(_runs(("x.DLRM", [0.60, 0.61])), ["seed"]), "eval/auc") is None


@pytest.mark.slow
def test_the_seeds_sweep_is_one_row_in_compare(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``sweeps/seeds.yaml`` with the seeds cut to two on the command line: two jobs, one configuration."""
    uri = f"sqlite:///{tmp_path}/sweep.db"
    out = run_in_process([sys.executable, "-m", "recsys_runner", "-m", "--config-dir", str(REPO / "sweeps"), "--config-name",
                          "seeds", "seed=0,1", *TINY, "train.num_steps=5", f"tracking.uri={uri}"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert compare.main(["--uri", uri, "--experiment", "seeds", "--repeats", "seed", "--no-plots"]) == 0
    header, row = _rows(capsys.readouterr().out)
    assert header[:3] == ["n", "status", "eval/auc"] and row[:2] == ["2", "FINISHED"] and "±" in row[2], (header, row)
