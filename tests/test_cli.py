"""The command line as a user meets it: help, --cfg job, bad configs, a multirun, torchrun. The commands whose process
is not the point (help, --cfg job, the multiruns, the default store) run in this process as ``python -m`` runs them
(:func:`tests.conftest.run_in_process`: the same exit status and output, without ~10 s of imports each); bad configs,
the full-error traceback and torchrun launch real processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hydra.errors import HydraException
from mlflow.tracking import MlflowClient

from recsys_runner.__main__ import run
from recsys_runner.checkpoint import resume_changes
from recsys_runner.errors import ConfigError
from recsys_runner.overrides import check_command_line, explain
from recsys_runner.tracking.store import mlflow_command
from tests.conftest import REPO, TINY, free_port, run_cli, run_in_process

TRAIN = [sys.executable, "-m", "recsys_runner"]


def test_help_lists_groups_and_options(tmp_path: Path) -> None:
    out = run_in_process([*TRAIN, "--help"], tmp_path)
    assert out.returncode == 0, out.stderr
    conf = REPO / "conf"
    groups = ["model", "optim", "optim/sparse", "optim/dense", "scheduler", "data", "distributed", "precision", "tracking",
              "checkpoint", "debug", "experiment"]
    for group in groups:
        options = sorted(p.stem for p in (conf / group).glob("*.yaml"))
        assert options, f"conf/{group} is empty"
        line = f"{group}: {', '.join(options)}"
        assert line in out.stdout, f"--help lacks {line!r}"
    assert {"deepfm", "dlrm"} <= {p.stem for p in (conf / "model").glob("*.yaml")}


@pytest.mark.parametrize(("command", "usage"), [("evaluate", "  python -m recsys_runner.evaluate load="),
                                               ("predict", "  python -m recsys_runner.predict load="),
                                               ("export", "  python -m recsys_runner.export load=")])
def test_each_command_helps_with_its_own_usage(tmp_path: Path, command: str, usage: str) -> None:
    """``python -m recsys_runner.evaluate --help`` printed training's usage ("Train a TorchRec recommender…"), nothing of
    ``load=``; each command now heads its help with its own, above the same groups and keys (its own keys among them)."""
    out = run_in_process([sys.executable, "-m", f"recsys_runner.{command}", "--help"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"== recsys_runner.{command} ==\n"), out.stdout[:300]
    assert "Train a TorchRec recommender" not in out.stdout and "load=<step_* checkpoint" in out.stdout
    assert usage in out.stdout and "== Configuration groups ==" in out.stdout
    assert f"\n{command}:\n" in out.stdout  # its own section in the keys (evaluate's: evaluate.importance and its settings)
    assert "\nload: null\n" in out.stdout


def test_cfg_job_prints_resolved_config(tmp_path: Path) -> None:
    out = run_in_process([*TRAIN, "model=dlrm", "optim.lr=0.3", "--cfg", "job", "--resolve"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert "_target_: recsys_runner.models.dlrm.DLRM" in out.stdout
    assert "lr: 0.3" in out.stdout and "${" not in out.stdout


BAD_CONFIGS = {
    "unknown-option": (["model=deepfn"], 1, ["Could not find 'model/deepfn'", "Available options in 'model'", "deepfm", "dlrm"]),
    "unknown-key": (["train.num_stepz=5"], 1, ["Key 'num_stepz' not in 'TrainConfig'"]),
    "steps-and-epochs": (["train.num_steps=5", "train.num_epochs=2"], 2,
                         ["train.num_steps=5 and train.num_epochs=2 are both set", "train.num_epochs=2 train.num_steps=null"]),
    "preset-steps-and-epochs": (["debug=fast", "train.num_epochs=2"], 2, ["are both set", "train.num_epochs=2 train.num_steps=null"]),
    # the file presets train one epoch: a step count given on top needs the epochs unset, which the old fix never said
    "preset-epochs-and-steps": (["experiment=movielens", "data.path=u.data", "train.num_steps=5"], 2,
                                ["train.num_steps=5 and train.num_epochs=1 are both set", "Fix: train.num_steps=5 train.num_epochs=null"]),
    "zero-batch": (["data.batch_size=0"], 2, ["data.batch_size must be positive"]),
    "negative-batch": (["data.batch_size=-8"], 2, ["data.batch_size must be positive"]),
    "zero-lr": (["optim.lr=0"], 2, ["lr must be positive"]),
    "negative-dense-lr": (["optim.dense.lr=-0.1"], 2, ["optim.dense.lr must be positive", "Fix: e.g. optim.dense.lr=0.01 where it is set"]),
    "dims-deepfm": (["model.embedding_dim=8", "model.dense_arch_layer_sizes=[64,16]"], 2,
                    ["model.dense_arch_layer_sizes ends in 16 but model.embedding_dim=8", "FM", "model.dense_arch_layer_sizes=[64,null]"]),
    "dims-dlrm": (["model=dlrm", "model.dense_arch_layer_sizes=[64,32]"], 2, ["ends in 32 but model.embedding_dim=16", "DLRM"]),
    "wrong-type": (["train.num_steps=many"], 1, ["train.num_steps", "many"]),
    "bad-enum": (["distributed.pipeline=turbo"], 2, ["distributed.pipeline='turbo' must be one of"]),
    "gpu-only-sharding": (["distributed.device=cpu", "distributed.sharding_types=[row_wise]"], 2,
                          ["['row_wise'] cannot shard embedding tables on cpu", "table_wise"]),
    "gpu-only-optimizer": (["optim=adam", "distributed.device=cpu"], 2, ["fbgemm implements only on GPU", "optim/sparse=rowwise_adagrad"]),
}


CLI_CASES = {
    "unknown-option": (["model=deepfn"], 2, ["Config error: model=deepfn: model has no option 'deepfn' (did you mean "
                                             "model=deepfm?); its options are autoint, ", "Fix: model=deepfm"]),
    "steps-and-epochs": BAD_CONFIGS["steps-and-epochs"],
}
"""One mistake composing the command line (checked before Hydra composes: recsys_runner/overrides.py) and one our
validation reports, through the command itself; every case of BAD_CONFIGS runs in-process below, through what the
command calls, and the typos in TYPOS."""


@pytest.mark.parametrize("case", list(CLI_CASES))
def test_bad_config_fails_early_with_a_clear_message(tmp_path: Path, case: str) -> None:
    overrides, code, expected = CLI_CASES[case]
    out = run_cli(*overrides, "tracking=none", cwd=tmp_path, timeout=120)
    text = out.stdout + out.stderr
    assert out.returncode == code, text
    for fragment in expected:
        assert fragment in text, f"{fragment!r} missing from:\n{text}"
    assert "Traceback" not in text
    # Nothing started: no training step logged, no MLflow store created.
    assert "step " not in out.stdout
    assert not (tmp_path / "mlflow.db").exists()


@pytest.mark.parametrize("case", list(BAD_CONFIGS), ids=list(BAD_CONFIGS))
def test_bad_config_is_refused_before_anything_starts(make_cfg, case: str) -> None:
    """What the command does in-process: Hydra's composition refuses the exit-1 cases (the command prints the error and
    its cause); ``recsys_runner.__main__.run`` (validate, then build) refuses the exit-2 cases with a :class:`ConfigError`,
    which the command prints as one line and exits 2 (the CLI cases above), before any step or MLflow run."""
    overrides, code, expected = BAD_CONFIGS[case]
    if code == 1:
        with pytest.raises(HydraException) as raised:
            make_cfg(*overrides, "tracking=none", tiny=False)
        text = f"{raised.value}\n{raised.value.__cause__}"
    else:
        with pytest.raises(ConfigError) as raised:
            run(make_cfg(*overrides, "tracking=none", tiny=False))
        text = str(raised.value)
    for fragment in expected:
        assert fragment in text, f"{fragment!r} missing from:\n{text}"


TYPOS = {
    "key": (["optim.lrr=0.1"], "optim.lrr=0.1: optim has no key 'lrr' (did you mean optim.lr?). Fix: optim.lr=0.1 ("),
    "key-of-the-chosen-option": (["model=dlrm", "data=parquet", "data.path=x", "model.over_arch_layer_size=[8]"],
                                 "model.over_arch_layer_size=[8]: model has no key 'over_arch_layer_size' (did you mean "
                                 "model.over_arch_layer_sizes?). Fix: model.over_arch_layer_sizes=[8] ("),
    "section": (["modell.embedding_dim=8"], "the config has no key 'modell' (did you mean model.embedding_dim?)"),
    "nested": (["optim.sparse.lrr=0.1"], "optim.sparse has no key 'lrr' (did you mean optim.sparse.lr?)"),
    "no-close-key": (["train.zzz=1"], "train has no key 'zzz'; its keys are num_steps, num_epochs, "),
    "option": (["data=parquett"], "data=parquett: data has no option 'parquett' (did you mean data=parquet?); its options are "
                                  "criteo, criteo_npy, csv, parquet, "),
    "option-of-a-subgroup": (["optim/sparse=adagradd"], "optim/sparse has no option 'adagradd' (did you mean optim/sparse=adagrad?)"),
    "command": (["evalute", "load=x"], "'evalute' is not an override (did you mean evaluate?): evaluate is a command of its "
                                       "own, python -m recsys_runner.evaluate [overrides]"),
    "training": (["train"], "'train' is not an override: training is this command itself, python -m recsys_runner [overrides]"),
    "word": (["deepfm"], "'deepfm' is not an override: python -m recsys_runner takes key=value or group=option"),
    "wrong-type": (["data.batch_size=abc"], "data.batch_size=abc: Value 'abc' of type 'str' could not be converted to Integer. "
                                            "Fix: give data.batch_size a value of its type, e.g. its default data.batch_size=512"),
    "wrong-type-of-the-chosen-option": (["model=dlrm", "model.embedding_dim=abc"],
                                        "model.embedding_dim=abc: Value 'abc' of type 'str' could not be converted to Integer. "
                                        "Fix: give model.embedding_dim a value of its type, e.g. its default model.embedding_dim=16"),
    "entries-given-bare": (["data=parquet", "data.path=x", "data.sparse=[user,item]"],
                           "data.sparse=[user,item]: each entry of data.sparse is a mapping (SparseColumn, with name), not a "
                           "bare value like 'user'. Fix: data.sparse=[{name: user}, {name: item}]"),
    "group-given-a-list": (["model=[deepfm,dlrm]"], "model=[deepfm,dlrm]: model takes one option, not a list. Fix: choose one, e.g. "
                                                   "model=deepfm, or train each in a sweep: python -m recsys_runner --multirun "
                                                   "model=deepfm,dlrm"),
    "list-without-brackets": (["model=dlrm", "metrics.eval=auc"], "metrics.eval=auc: metrics.eval is a list (Invalid value "
                                                                  "assigned: str is not a ListConfig, list or tuple). Fix: "
                                                                  "metrics.eval=[auc]"),
    "another-options-key": (["model.structure=parallel"], "model.structure=parallel: structure is a key of model=dcn_v2, "
                                                          "masknet, not of the model chosen (its keys: embedding_dim, "
                                                          "dense_arch_layer_sizes, deep_layer_sizes). Fix: choose one of those, "
                                                          "e.g. model=dcn_v2 model.structure=parallel, or drop it ("),
    "a-file-options-key": (["data.sparse=[{name: tag}]"], "data.sparse=[{name: tag}]: sparse is a key of data=parquet, csv, not "
                                                          "of the data chosen"),
    "one-level-down": (["optim.no_decay_1d=true"], "optim.no_decay_1d=true: optim has no key 'no_decay_1d', but "
                                                  "optim.dense.no_decay_1d is. Fix: optim.dense.no_decay_1d=true ("),
    "in-two-sections": (["optim.eps=1e-6"], "optim has no key 'eps', but optim.sparse.eps and optim.dense.eps are. Fix: "
                                            "optim.sparse.eps=1e-6 ("),
    # TorchEasyRec's BF16: the option equal but for case, where the closest spelling was fp16 (another precision)
    "option-in-capitals": (["precision=BF16"], "precision=BF16: precision has no option 'BF16' (did you mean precision=bf16?)"),
    # TorchEasyRec's names (config_keys.TORCHEASYREC_KEYS): the closest spelling was another setting (decay_factor ->
    # min_factor) or none at all (save_checkpoints_steps lives in another section here)
    "torcheasyrec-decay-factor": (["scheduler=exponential_decay", "scheduler.decay_factor=0.5"],
                                  "scheduler.decay_factor=0.5: decay_factor is TorchEasyRec's name; here it is "
                                  "scheduler.decay_rate. Fix: scheduler.decay_rate=0.5 ("),
    "torcheasyrec-before-the-option": (["scheduler.decay_factor=0.5"],
                                       "decay_factor is TorchEasyRec's name; here it is scheduler.decay_rate (a key of "
                                       "scheduler=exponential_decay). Fix: scheduler=exponential_decay scheduler.decay_rate=0.5 ("),
    "torcheasyrec-another-section": (["train.save_checkpoints_steps=10"], "save_checkpoints_steps is TorchEasyRec's name; here "
                                                                          "it is checkpoint.every_steps. Fix: checkpoint.every_steps=10 ("),
    "torcheasyrec-section": (["train.grad_scaler.init_scale=1024"], "here it is precision.grad_scaler.init_scale. Fix: "
                                                                     "precision.grad_scaler.init_scale=1024 ("),
    "torcheasyrec-group": (["train.mixed_precision=BF16"], "here it is precision, a config group. Fix: precision=bf16 ("),
    "torcheasyrec-lr-as-fraction": (["scheduler=exponential_decay", "scheduler.min_learning_rate=0.001"],
                                    "here it is scheduler.min_factor, a fraction of the base lr (optim.lr)"),
    "torcheasyrec-name-of-no-key-there": (["model.learning_rate=3"], "model.learning_rate=3: model has no key 'learning_rate'; its keys are"),
    # an option of a group placed elsewhere: the fix keeps the placement (it said scheduler=exponential_decay, the run's)
    "option-of-a-placed-group": (["+scheduler@optim.sparse_scheduler=exp_decay"],
                                 "scheduler has no option 'exp_decay' (did you mean +scheduler@optim.sparse_scheduler="
                                 "exponential_decay?); its options are constant, cosine, cosine_restarts, exponential_decay, "
                                 "manual_step. Fix: +scheduler@optim.sparse_scheduler=exponential_decay ("),
    # a key of a group's own schedule before one is chosen: OmegaConf's assert on the null slot, printed as a traceback
    "key-of-an-unchosen-schedule": (["+optim.sparse_scheduler.decay_rate=0.5"],
                                    "optim.sparse_scheduler is not set (the run's scheduler drives that lr), so it has no key "
                                    "'decay_rate' to set; a schedule of its own is chosen into it first. Fix: "
                                    "+scheduler@optim.sparse_scheduler=exponential_decay optim.sparse_scheduler.decay_rate=0.5, "
                                    "or scheduler.decay_rate=0.5 for the run's schedule"),
    "schedule-given-as-a-value": (["optim.sparse_scheduler=cosine"],
                                  "optim.sparse_scheduler=cosine: optim.sparse_scheduler takes a schedule chosen as an option of "
                                  "the scheduler group, not a name as its value. Fix: +scheduler@optim.sparse_scheduler=cosine"),
    # an option of one half of optim: the closest spelling among optim's own was another optimizer (optim=adam)
    "option-of-a-half": (["optim=adamw"], "optim=adamw: optim has no option 'adamw', but optim/dense=adamw is an option of one "
                                          "half of it. Fix: optim/dense=adamw ("),
    # TorchEasyRec's class names: no close spelling (LarsSGDOptimizer had none)
    "torcheasyrec-class-name": (["optim/sparse=LarsSGDOptimizer"], "(did you mean optim/sparse=lars_sgd?)"),
    "torcheasyrec-other-name": (["scheduler=CosineAnnealingLR"], "(did you mean scheduler=cosine?)"),
    "top-level": (["seedd=3"], "seedd=3: the config has no key 'seedd' (did you mean seed?). Fix: seed=3 ("),
    "map-without-plus": (["precision.embedding_data_type_by_feature={cat_0: fp16}"],
                         "precision.embedding_data_type_by_feature is a map whose entries a command line adds with a "
                         "leading + (Hydra merges a map given with = into the existing one, which has no key 'cat_0'). Fix: "
                         "+precision.embedding_data_type_by_feature={cat_0: fp16}"),
    "map-entry-without-plus": (["precision.embedding_data_type_by_feature.cat_0=fp16"],
                               "precision.embedding_data_type_by_feature.cat_0=fp16: precision.embedding_data_type_by_feature "
                               "is a map whose entries a command line adds with a leading + (it has no key 'cat_0' yet). Fix: "
                               "+precision.embedding_data_type_by_feature.cat_0=fp16"),
    "map-entry-of-another-type": (["+distributed.tables={t_cat_0: data_parallel}"],
                                  "+distributed.tables={t_cat_0: data_parallel}: Invalid type assigned: str is not a subclass of "
                                  "TableShardingConfig. value: data_parallel. Fix: give distributed.tables.t_cat_0 a value of its type"),
    "map-given-a-list": (["+precision.embedding_data_type_by_feature=[cat_0,cat_1]"],
                         "+precision.embedding_data_type_by_feature=[cat_0,cat_1]: precision.embedding_data_type_by_feature is "
                         "a map of name: value entries, not a list. Fix: +precision.embedding_data_type_by_feature={cat_0: "
                         "<value>, cat_1: <value>}"),
    "group-with-plus": (["+experiment=deepfm_criteo"], "+experiment=deepfm_criteo: experiment is a group of the config's "
                                                       "defaults list already (python -m recsys_runner --help lists its "
                                                       "options), so an option of it is chosen without a leading +. Fix: "
                                                       "experiment=deepfm_criteo"),
    "group-with-force-add": (["++model=dlrm"], "++model=dlrm: model is a group of the config's defaults list already"),
    "preset-key-of-another-option": (["debug=overfit", "data=parquet"],
                                     "debug=overfit sets data.num_train_rows, a key of data=synthetic, synthetic_sequences, "
                                     "not of data=parquet: the preset is written for those. Fix: debug=overfit with one of "
                                     "those, e.g. debug=overfit data=synthetic, or leave debug=overfit out and give its other "
                                     "settings on the command line (conf/debug/overfit.yaml lists them;"),
    # a Hive-partitioned day folder: Hydra said "mismatched input '=' expecting <EOF>", naming neither override nor fix
    "equals-in-value": (["data=parquet", "data.path=data/day=2026-11-01"],
                        "data.path=data/day=2026-11-01: Hydra's override grammar reads only the first '=' as the one "
                        "between key and value, and refuses another in an unquoted value (a Hive-style folder such as "
                        "day=2026-11-01). Fix: quote the value for Hydra, inside the shell's quotes: "
                        "\"data.path='data/day=2026-11-01'\""),
    "another-commands-key": (["load=outputs/x"], "load=outputs/x: load is a setting of python -m "
                                                 "recsys_runner.evaluate|predict|export, not of python -m recsys_runner."),
}


@pytest.mark.parametrize("case", list(TYPOS))
def test_a_typo_is_one_line_naming_the_closest_valid_name(case: str) -> None:
    """What the command line checks before Hydra composes (recsys_runner/overrides.py): Hydra's own words for these sent
    a newcomer astray (``optim.lrr=0.1``: "To append to your config use +optim.lrr=0.1", which is then refused;
    ``python -m recsys_runner evaluate``: "missing EQUAL at '<EOF>'")."""
    overrides, expected = TYPOS[case]
    with pytest.raises(ConfigError) as raised:
        explain("config", overrides)
    assert expected in str(raised.value), str(raised.value)
    assert "To append" not in str(raised.value)


@pytest.mark.parametrize("overrides", [["model=dlrm", "optim.lr=0.1", "+scheduler@optim.sparse_scheduler=cosine"],
                                       ["+train.num_step=5"],  # refused by validate(), which names the fix itself
                                       ["+distributed.tables={t_cat_0: {sharding_types: [table_wise]}}"],  # a map's fix
                                       ["metrics.eval=auc,logloss"],  # Hydra's message: brackets, quotes or --multirun
                                       ["model=dlrm", "hydra.run.dir=/tmp/x", "hydra/launcher=basic"]])
def test_what_composes_or_hydra_reports_well_is_left_alone(overrides: list[str]) -> None:
    explain("config", overrides)


def test_a_torcheasyrec_flag_names_our_key(capsys: pytest.CaptureFixture[str]) -> None:
    """``--model_dir=out`` (TorchEasyRec's train_eval flag) was Hydra's usage text and "unrecognized arguments"; it is one
    line naming our key, exit 2, before anything is composed."""
    with pytest.raises(SystemExit) as exited:
        check_command_line("config", ["recsys_runner", "--model_dir=out", "train.num_steps=5"])
    assert exited.value.code == 2
    assert ("--model_dir=out: model_dir is TorchEasyRec's name; here it is checkpoint.dir (the rest of a run, logs and config, "
            "goes to hydra.run.dir). Fix: checkpoint.dir=out (overrides are key=value, without --)") in capsys.readouterr().err


def test_a_renamed_key_names_its_new_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """An override of a key renamed since (a dummy rename in ``resume_changes.RENAMED_KEYS``), as a resume command printed before
    the rename has it: named with the new name as the fix, not with the closest spelling."""
    monkeypatch.setattr(resume_changes, "RENAMED_KEYS", {"train.steps": "train.num_steps"})
    with pytest.raises(ConfigError, match=r"^train.steps=5: train.steps was renamed train.num_steps. Fix: train.num_steps=5 \("):
        explain("config", ["train.steps=5"])


def test_a_sweep_is_checked_by_its_first_value(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"optim.lrr=0.1,0.2: optim has no key 'lrr' \(did you mean optim.lr\?\)"):
        explain("config", ["optim.lrr=0.1,0.2", "model=dlrm,deepfm"], multirun=True)
    explain("config", ["optim.lr=0.1,0.2", "model=dlrm,deepfm"], multirun=True)
    explain("config", ["optim.lr=interval(0.01,0.1)"], multirun=True)  # a search's interval: left to Hydra
    # a swept + keeps its one +: "+experiment=a" (refused with the plain form as the fix), not "++experiment=a"
    with pytest.raises(ConfigError, match=r"chosen without a leading \+. Fix: experiment=deepfm_criteo,dlrm_criteo$"):
        explain("config", ["+experiment=deepfm_criteo,dlrm_criteo"], multirun=True)


def test_every_command_checks_its_command_line(tmp_path: Path) -> None:
    """evaluate composes its own config (with the training's overrides carried in front): a typo there is one line too."""
    out = run_in_process([sys.executable, "-m", "recsys_runner.evaluate", "load=nowhere", "data.batchsize=8"], tmp_path)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == ("Config error: data.batchsize=8: data has no key 'batchsize' (did you mean data.batch_size?). "
                                  "Fix: data.batch_size=8 (python -m recsys_runner.evaluate --help lists every key with its default)")
    other = run_in_process([sys.executable, "-m", "recsys_runner.evaluate", "load=nowhere", "predict.output=x"], tmp_path)
    assert other.returncode == 2 and "predict is a setting of python -m recsys_runner.predict, not of python -m " \
        "recsys_runner.evaluate" in other.stderr, other.stderr
    word = run_in_process([*TRAIN, "evaluate", "load=nowhere"], tmp_path)
    assert word.returncode == 2 and "python -m recsys_runner.evaluate [overrides]" in word.stderr, word.stderr
    assert "Traceback" not in word.stderr + out.stderr


def test_full_error_shows_traceback(tmp_path: Path) -> None:
    out = run_cli("data.batch_size=0", "tracking=none", cwd=tmp_path, env={"HYDRA_FULL_ERROR": "1"}, timeout=120)
    assert out.returncode != 0 and "Traceback" in out.stderr and "ConfigError" in out.stderr


def test_default_store_is_mlflow_db_in_launch_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = run_in_process([*TRAIN, *TINY, "train.num_steps=10"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    db = tmp_path / "mlflow.db"
    assert db.exists()
    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    experiment = client.get_experiment_by_name("recsys_runner").experiment_id
    (run,) = client.search_runs([experiment])
    assert run.info.status == "FINISHED" and "eval/auc" in run.data.metrics
    # It ends by saying which run it was and how to see it: a local store has no UI until `mlflow ui` serves it.
    end = [line.split("] - ", 1)[-1] for line in out.stdout.splitlines()[-3:]]
    assert end == [f"MLflow run {run.info.run_id} FINISHED (experiment 'recsys_runner', store sqlite:///{db})",
                   f"MLflow UI: {mlflow_command()} ui --backend-store-uri sqlite:///{db} --port 5000",
                   f"  then open http://127.0.0.1:5000/#/experiments/{experiment}/runs/{run.info.run_id}"
                   "?workflowType=machine_learning"], out.stdout[-2000:]


def test_env_var_overrides_default_store(make_cfg, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process (the store is resolved from the environment when the run is built; the launch directory's part is the
    CLI test above): ``$MLFLOW_TRACKING_URI`` wins over ``mlflow.db`` in the current directory."""
    db = tmp_path / "elsewhere.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{db}")
    monkeypatch.chdir(tmp_path)
    run(make_cfg("train.num_steps=5", "tracking.uri=null", "tracking.experiment=env_uri"))
    assert db.exists() and not (tmp_path / "mlflow.db").exists()
    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    (mlrun,) = client.search_runs([client.get_experiment_by_name("env_uri").experiment_id])
    assert mlrun.info.status == "FINISHED"


def test_multirun_gives_one_finished_run_per_job(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path}/sweep.db"
    out = run_in_process([*TRAIN, "-m", "optim.lr=0.01,0.1", *TINY, "train.num_steps=20", f"tracking.uri={uri}",
                          "tracking.experiment=sweep"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("sweep").experiment_id], "tags.mlflow.parentRunId != ''")
    assert len(runs) == 2  # the jobs; the sweep's parent run is tested in test_sweeps.py
    assert all(r.info.status == "FINISHED" and "eval/auc" in r.data.metrics for r in runs)
    assert sorted(float(r.data.params["optim.sparse.lr"]) for r in runs) == [0.01, 0.1]
    names = sorted(r.info.run_name for r in runs)
    assert names == ["lr=0.01", "lr=0.1"], "a sweep's job is named by its swept values (test_sweeps.py)"
    assert all(r.data.tags["hydra.overrides"].startswith("optim.lr=") for r in runs)
    assert len(list((tmp_path / "multirun").glob("*/*/*/.hydra/config.yaml"))) == 2




@pytest.mark.slow
def test_torchrun_two_ranks_gloo(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path}/ddp.db"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", "-m", "recsys_runner", *TINY, "train.eval_every_steps=20",
           "distributed.sharding_types=[column_wise]", f"tracking.uri={uri}", "tracking.experiment=ddp"]
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("ddp").experiment_id])
    assert len(runs) == 1, "only rank 0 may log"
    (run,) = runs
    assert run.data.tags["world_size"] == "2"
    assert run.data.metrics["eval/auc"] > 0.6
    # Global batch = 2 ranks x 256 rows.
    plan = open(client.download_artifacts(run.info.run_id, "sharding_plan.txt")).read()
    assert "column_wise" in plan and "rank:1" in plan


def test_sweep_config_from_sweeps_dir(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path}/grid.db"
    out = run_in_process([*TRAIN, "-m", "--config-dir", str(REPO / "sweeps"), "--config-name", "lr_grid", *TINY,
                          "train.num_steps=10", "optim.lr=0.05", f"tracking.uri={uri}"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("lr_grid").experiment_id], "tags.mlflow.parentRunId != ''")
    assert sorted(r.data.params["model._target_"].rsplit(".", 1)[-1] for r in runs) == ["DLRM", "DeepFM"]
    assert all(r.info.status == "FINISHED" for r in runs)
