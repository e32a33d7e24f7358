"""Optimizers and lr schedules: ``optimizers`` (sparse fused + dense + per-part optimizers, ``GroupedOptimizer``),
``schedulers`` (per-group ``step -> multiplier`` schedules in one ``ScheduledLR``), ``compat`` (fbgemm versions), ``config`` (the ``optim`` group's schema, where
optimizers and schedules meet). Schedulers import optimizers, never the reverse; the room may import ``configurable`` and ``errors`` only.
"""
