"""``python -m recsys_runner.bench``: the benchmark table (:mod:`recsys_runner.bench.regimes`)."""

from recsys_runner.bench.regimes import main

if __name__ == "__main__":
    main()
