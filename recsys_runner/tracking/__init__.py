"""Experiment tracking: ``store`` (where the MLflow store is, opened or refused early), ``tracker`` (rank 0's MLflow run),
``outbox`` (what the store has not taken yet: held through an outage, re-sent, else a replay file), ``lineage`` (the manifest of what ran and the checkpoint a run id names), ``sweep``
(a multirun's parent run), ``sweep_jobs`` (how a sweep's jobs ended: SLURM's account, the runs dead jobs left open), ``tensorboard`` (every metric also to TensorBoard event files, ``tracking.tensorboard``), ``folders`` (the local folders a run writes, checked when it is built), ``datasets`` (the data a run read, as MLflow
dataset inputs). May import ``checkpoint`` (to list a run's checkpoints), ``metrics`` (a metric's direction) and ``data``
(the files a split reads, the stored encoders' schema), never ``train`` or ``build``.
"""
