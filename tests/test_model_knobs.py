"""A swept model key either takes effect or stops the run with one Config error naming the key and the fix: found by
trying each model's keys at unusual and wrong values (dogfood6). Config-only checks: nothing here trains."""

from __future__ import annotations

import pytest

from recsys_runner.configurable import make
from recsys_runner.errors import ConfigError
from recsys_runner.models.dssm import DSSMConfig
from recsys_runner.models.mind import MINDConfig
from recsys_runner.models.sasrec import SASRecConfig


@pytest.mark.parametrize("cls", [DSSMConfig, MINDConfig, SASRecConfig])
def test_an_empty_eval_metrics_list_is_refused(cls: type) -> None:
    """``model.eval_metrics=[]`` logged the task's default metrics (hr@10, ndcg@10, hr@50; inbatch_recall@10), silently."""
    with pytest.raises(ConfigError, match=r"model.eval_metrics=\[\] lists no metric.*Fix: list the metrics to log, e.g. "
                                          r"model.eval_metrics=\[\w+@10,"):
        make(cls, eval_metrics=[])
    assert make(cls, eval_metrics=["mrr"]).eval_metrics == ["mrr"]
