"""``python -m recsys_runner.bench``: the benchmark table (:mod:`recsys_runner.bench.regimes`).

With the sequence regimes (:mod:`recsys_runner.bench.sequences`) handed in, so that they can build on the regimes'
helpers without the two modules importing each other.
"""

from recsys_runner.bench.regimes import main
from recsys_runner.bench.sequences import bench_sequences

if __name__ == "__main__":
    main(sequence_bench=bench_sequences)
