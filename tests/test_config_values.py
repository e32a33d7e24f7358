"""Bad values found by feeding every config field a wrong one (a zero or negative count, an out-of-range share, a name
nothing has): each is refused by :func:`~recsys_runner.config.validate` with a ``ConfigError`` naming the key, before
anything is built, never a traceback from inside the code that would use it."""

from __future__ import annotations

from pathlib import Path

import pytest

from recsys_runner.__main__ import run
from recsys_runner.config import validate
from recsys_runner.data.generated.generate import write_criteo_parquet
from recsys_runner.errors import ConfigError

BAD_VALUES = {
    "synthetic-no-sparse-columns": (["data.num_sparse=0"], "data.num_sparse must be positive, got 0"),
    "synthetic-negative-label-scale": (["data.label_noise=-1"], "data.label_noise must be >= 0"),
    "synthetic-negative-amount": (["data.conversion_amount=-5"], "data.conversion_amount must be positive"),
    "dense-adam-zero-eps": (["optim/dense=adam", "optim.dense.eps=0"], "optim.dense.eps must be positive, got 0.0"),
    "dense-adagrad-negative-eps": (["optim.dense.eps=-1e-8"], "optim.dense.eps must be positive"),
    "sparse-adagrad-zero-eps": (["optim.sparse.eps=0"], "optim.sparse.eps must be positive"),
    "dense-sgd-momentum-above-one": (["optim/dense=sgd", "optim.dense.momentum=1.5"], "optim.dense.momentum must lie in [0, 1)"),
    "no-sharding-type": (["distributed.sharding_types=[]"], "distributed.sharding_types=[] allows nothing"),
    "no-table-kernel": (["+distributed.tables={t_cat_0: {compute_kernels: []}}"],
                        "distributed.tables.t_cat_0.compute_kernels=[] allows nothing"),
    "infinite-lr": (["optim.lr=1e400"], "optim.lr=inf is not a finite number"),
    "nan-in-a-list": (["model=dlrm", "optim/dense=adam", "optim.dense.betas=[0.9,nan]"], "optim.dense.betas[1]=nan is not a finite number"),
    "negative-seed": (["seed=-1"], "seed=-1 must lie in [0, 2**32)"),
    "hard-column-without-sampled-negatives": (["model=dssm", "data.negatives.hard_column=hard_items"],
                                              "data.negatives.hard_column=hard_items would do nothing: data.negatives.num_negatives=0"),
    "mined-share-without-sampled-negatives": (["model=dssm", "data.negatives.mined_ratio=0.25"],
                                              "data.negatives.mined_ratio=0.25 would do nothing"),
    "dense-sgd-negative-momentum": (["optim/dense=sgd", "optim.dense.momentum=-0.1"], "optim.dense.momentum must lie in [0, 1)"),
    "negative-sanity-eval-batches": (["train.sanity_eval_batches=-1"],
                                     "train.sanity_eval_batches must be 0 (off) or a number of eval batches, got -1"),
}
"""Case → (overrides on the tiny default config, a fragment of the message)."""


@pytest.mark.parametrize("case", list(BAD_VALUES))
def test_a_bad_value_is_refused_naming_its_key(make_cfg, case: str) -> None:
    overrides, fragment = BAD_VALUES[case]
    with pytest.raises(ConfigError) as raised:
        validate(make_cfg(*overrides, "tracking=none"))
    assert fragment in str(raised.value), str(raised.value)


def test_file_data_settings_the_reader_would_fail_on_or_ignore_are_refused(make_cfg, tmp_path: Path) -> None:
    """A negative ``data.seed`` failed in numpy's generator once the files were read; an item catalogue described without
    its file was silently none. Files ``convert`` wrote carry their
    schema, which the reader takes whole when no columns are configured: a ``data.label`` naming another column was
    silently ignored (the run trained on the stored label)."""
    write_criteo_parquet(str(tmp_path / "train.parquet"), 256)
    files = ["data=parquet", f"data.path={tmp_path}/train.parquet", "distributed.device=cpu", "tracking=none"]
    with pytest.raises(ConfigError, match=r"data.seed=-1 must lie in \[0, 2\*\*32\)"):  # was numpy's ValueError in the first epoch
        validate(make_cfg(*files, "data.seed=-1", tiny=False))
    with pytest.raises(ConfigError, match=r"data.items.id, data.items.features describe\(s\) the item catalogue file, but "
                                          r"data.items.path is null"):
        validate(make_cfg(*files, "data.items.id=cat_0", "data.items.features=[cat_1]", tiny=False))
    with pytest.raises(ConfigError, match=r"data.label='int_0' would be ignored: .*train.parquet carries the schema .*"
                                          r"label\(s\) 'label'.*Fix: drop data.label"):
        validate(make_cfg(*files, "data.label=int_0", tiny=False)).served_data.build(device="cpu")
    data = validate(make_cfg(*files, "data.label=label", tiny=False)).served_data.build(device="cpu")  # the stored one: fine
    assert data.schema.label == "label"


def test_a_profile_window_past_the_run_is_refused_before_training(make_cfg) -> None:
    """torch.profiler records nothing before ``wait + warmup`` steps: a run shorter than that ended without a trace and
    without a word. Refused once the run's length is known, before the model is built."""
    with pytest.raises(ConfigError, match=r"train.profile.wait=5 \+ train.profile.warmup=2 skip 7 steps, but the run has 6"):
        run(make_cfg("debug=profile", "train.num_steps=6", "tracking=none"))
