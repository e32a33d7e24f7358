"""Checkpoints: ``policy`` (when to save, what to keep, NaN ``guard``, ``lock``) over ``storage`` (DCP files), ``resume``, ``weights`` (the one loader), ``config``.
May import ``recsys_runner.distributed``, ``metrics``, ``errors``, ``configurable``, ``runtime``; never ``train``, ``tracking``, ``build``, ``config``, ``models``, ``data``.
"""
