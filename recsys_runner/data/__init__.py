"""Data modules: each turns a ``data`` config into per-rank iterables of TorchRec ``Batch``es (:class:`~recsys_runner.data.base.DataModule`).
May import ``features``, ``errors``, ``configurable``, ``progress``, ``noise``; never ``models``, ``train``, ``build``, ``config``.
"""
