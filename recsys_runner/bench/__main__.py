"""``python -m recsys_runner.bench``: the benchmark table (:mod:`recsys_runner.bench.regimes`).

With the sequence regimes (:mod:`recsys_runner.bench.sequences`) handed in, so that they can build on the regimes'
helpers without the two modules importing each other; the managed-collision regime
(:mod:`recsys_runner.bench.collision`) runs after them. ``--corpus`` runs the full-corpus evaluation regime
(:mod:`recsys_runner.bench.corpus`) alone: it times scoring, not training, so it shares nothing with the table.
"""

import sys

from recsys_runner.bench import corpus
from recsys_runner.bench.collision import with_collision
from recsys_runner.bench.regimes import main
from recsys_runner.bench.sequences import bench_sequences

if __name__ == "__main__":
    if "--corpus" in sys.argv[1:]:
        corpus.main([a for a in sys.argv[1:] if a != "--corpus"])
    else:
        main(sequence_bench=with_collision(bench_sequences))
