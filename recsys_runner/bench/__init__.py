"""Benchmarks (``make bench``): the runner against a hand-written TorchRec loop, end to end and per step.

``regimes`` runs the regimes (a)-(d) and prints one table; ``data`` looks closer at the Parquet reader;
``summaries`` times what ``train.summary_every_steps`` costs; ``step_options``, ``breakdown`` and ``caching`` measure
the GPU step (its options, where its time goes, tables larger than the GPU), and ``gpu`` runs every GPU measurement.
May import anything in the package (it drives whole runs); nothing in the package imports it.
"""
