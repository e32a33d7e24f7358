"""What a model config alone decides: ``model.embedding_dim`` sets every width by itself, and DeepFM's first-order term
(one weight per id, in the logit, trained)."""

from __future__ import annotations

import math

import pytest
import torch

from recsys_runner.__main__ import run
from recsys_runner.build import build
from recsys_runner.config import validate
from recsys_runner.configurable import make
from recsys_runner.errors import ConfigError
from recsys_runner.models.common import materialize
from recsys_runner.models.deepfm import DeepFM, DeepFMConfig
from recsys_runner.train.loop import train
from tests.test_checkpoint import local
from tests.test_models import CPU, MODELS, small_data


@pytest.mark.parametrize("name", [m for m in MODELS if m != "lr"])  # logistic regression has no embeddings
def test_embedding_dim_alone_changes_the_width(make_cfg, name: str) -> None:
    """Also every model's 3 steps in bf16: the NaN guard (``train.nan_guard``) stops the run if the loss is not finite at
    step 3."""
    cfg = make_cfg(f"model={name}", "model.embedding_dim=8", "train.num_steps=3", "train.log_every_steps=3", "tracking=none",
                   "data.num_train_rows=4096", "data.num_eval_rows=1024", "precision=bf16")
    spec = validate(cfg)
    assert spec.model.embedding_dim == 8
    if name in ("deepfm", "dlrm"):
        assert spec.model.dense_layer_sizes() == [64, 8]
    assert math.isfinite(run(cfg))


def test_an_explicit_projection_that_does_not_end_in_the_width_is_refused(make_cfg) -> None:
    with pytest.raises(ConfigError, match=r"ends in 16 but model.embedding_dim=8: DeepFM's FM term .* Fix: end "
                                          r"model.dense_arch_layer_sizes in null .* model.dense_arch_layer_sizes=\[64,null\]"):
        validate(make_cfg("model.embedding_dim=8", "model.dense_arch_layer_sizes=[64,16]", "tracking=none"))


# --- DeepFM's first-order term ---


def test_deepfm_first_order_term_is_per_id_and_in_the_logit() -> None:
    data = small_data()
    torch.manual_seed(0)
    model = materialize(DeepFM(make(DeepFMConfig, embedding_dim=8, dense_arch_layer_sizes=[None], deep_layer_sizes=[16]),
                               features=data.features, dense_device=CPU))
    tables = model.first_order.ebc.embedding_bags
    assert sorted(tables) == [f"first_order_t_{f.name}" for f in data.features.sparse]
    batch = next(iter(data.train_batches(0, 0, 1)))
    ids = batch.sparse_features.to_dict()
    expected = model.first_order.dense(batch.dense_features).squeeze(1)
    for f in data.features.sparse:
        expected = expected + tables[f"first_order_t_{f.name}"].weight[ids[f.name].values()].sum(dim=1)
    with torch.no_grad():
        assert torch.allclose(model.first_order(batch.dense_features, batch.sparse_features), expected, atol=1e-6)
        before = model(batch.dense_features, batch.sparse_features)
        hit = ids[data.features.sparse[0].name].values()[0]
        tables[f"first_order_t_{data.features.sparse[0].name}"].weight[hit] += 0.25  # one id's weight, 4 floats summed: +1
        after = model(batch.dense_features, batch.sparse_features)
    assert torch.allclose(after[0] - before[0], torch.tensor(1.0), atol=1e-5)


def test_deepfm_first_order_weights_are_trained(make_cfg) -> None:
    cfg = make_cfg("train.num_steps=5", "train.log_every_steps=5", "tracking=none", "checkpoint=none")
    c = build(validate(cfg))
    try:
        model = c.loop.evaluator.model
        first = {k: local(v).detach().clone() for k, v in model.state_dict().items() if "first_order_t_" in k}
        assert len(first) == 26
        train(c.loop)
        after = {k: local(v) for k, v in model.state_dict().items() if "first_order_t_" in k}
        changed = [k for k in first if not torch.equal(first[k], after[k])]
        assert len(changed) == 26, f"first-order tables not trained: {sorted(set(first) - set(changed))}"
    finally:
        c.loop.tracker.finish("FINISHED")
        c.close()
