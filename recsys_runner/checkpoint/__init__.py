"""Checkpoints: ``policy`` (when to save, what to keep, NaN ``guard``, ``lock``) over ``storage`` (DCP files; ``object_storage``: DCP's fsspec storage in an object store), ``resume`` (what a resume may change: ``resume_changes``), ``weights`` (the one loader; ``carried_rows``: rows carried by id to their new rows), ``config``.
May import ``recsys_runner.distributed``, ``metrics``, ``errors``, ``configurable``, ``runtime``, ``stores``, ``store_settings``, ``uris``; never ``train``, ``tracking``, ``build``, ``config``, ``models``, ``data``.
"""
