"""Model zoo: one module per architecture, built from the named parts in ``common``.

A model's constructor takes its hyperparameters (from ``conf/model/<name>.yaml``) plus two runtime
arguments the runner supplies: ``features`` (the data's :class:`~recsys_runner.features.FeatureSpec`)
and ``dense_device``. Its embedding tables are created on the ``meta`` device; TorchRec's
DistributedModelParallel materializes them sharded. ``forward(dense, sparse)`` returns logits ``[B]``.
"""
