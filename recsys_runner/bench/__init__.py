"""Benchmarks (``make bench``): the runner against a hand-written TorchRec loop, end to end and per step.

``regimes`` runs the regimes (a)-(d) and prints one table; ``data`` looks closer at the Parquet reader;
``summaries`` times what ``train.summary_every_steps`` costs.
May import anything in the package (it drives whole runs); nothing in the package imports it.
"""
