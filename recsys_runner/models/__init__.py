"""Model zoo: one module per architecture, built from the named parts in ``common``; ``train_wrapper`` is how every
model is trained (its tasks' losses, ``(loss, output)`` for TorchRec's pipelines).

Each model has a config dataclass (a :class:`~recsys_runner.models.common.ModelConfig`, the schema of
``conf/model/<name>.yaml``) that declares its hyperparameters once. The model's constructor takes that
config first plus two runtime arguments the runner supplies: ``features`` (the data's
:class:`~recsys_runner.features.FeatureSpec`) and ``dense_device``; ``config.build(features=…,
dense_device=…)`` calls it. Its embedding tables are created on the ``meta`` device; TorchRec's
DistributedModelParallel materializes them sharded. ``forward(dense, sparse)`` returns logits ``[B]``.

May import ``task_specs``, ``tasks``, ``features``, ``configurable`` and ``errors``; never ``metrics``, ``data``, ``train`` or ``build``.
"""
