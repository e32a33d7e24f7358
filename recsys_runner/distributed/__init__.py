"""Process groups, where a rank sits, and TorchRec's sharding: ``config`` (``distributed.*``), ``env`` (rank, device,
threads, rank-0 decisions), ``sharding`` (process group, planning, DistributedModelParallel), ``planner`` (what TorchRec's
planner is told), ``plan_report`` (what a plan puts where), ``launch`` (submitit's env), ``local_tasks``
(``submitit_local``'s job controller: a failed task ends the others).

May import only ``errors`` and ``configurable``: the train pipeline that runs over the sharded model lives in ``train/``.
"""
