"""Optimizers and lr schedules: ``optimizers`` (sparse fused + dense + per-part optimizers, ``GroupedOptimizer``),
``schedulers`` (per-group ``step -> multiplier`` schedules in one ``ScheduledLR``), ``compat`` (fbgemm versions).
Schedulers import optimizers, never the reverse; the room may import ``configurable`` and ``errors`` only.
"""
