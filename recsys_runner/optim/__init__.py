"""Optimizers and lr schedules: ``sparse`` (the fused embedding optimizers fbgemm runs), ``optimizers`` (dense and
per-part optimizers, ``GroupedOptimizer``), ``schedulers`` (per-group ``step -> multiplier`` schedules in one ``ScheduledLR``), ``compat`` (fbgemm versions), ``config`` (the ``optim`` group's schema, where
optimizers and schedules meet). Schedulers and sparse import optimizers, never the reverse; the room may import ``configurable`` and ``errors`` only.
"""
