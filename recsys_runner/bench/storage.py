"""Training from an object store vs the local disk: ``python -m recsys_runner.bench.storage [--quick] [overrides…]``.

* ``s_bucket_parquet`` — DeepFM through the runner (:func:`recsys_runner.train.loop.train`) on ``data=parquet`` whose
  files (:data:`PARTS` part files) are in a bucket of an S3-compatible server on loopback (moto's standalone server,
  ``moto[server]``, started here and stopped at the end), against the same files on the local disk: samples/s, the ratio the median of per-round
  ratios, the two data modules alternating within a round over one built model, after an untimed warm-up round of
  each. Target ≥ 0.90. The bucket is read through pyarrow's S3 client with ``storage.prefetch_units`` row groups read
  ahead in a background thread (docs/storage.md); the loopback server shares the machine's cores with training, as a
  remote store would not.

Writes ``bench_storage.json``; docs/performance.md quotes the measured numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, replace
from typing import Any

import fsspec
import torch

from recsys_runner import store_settings
from recsys_runner.bench.regimes import COMMON, Regime, build_for_bench, runner_round, window_steps, with_data
from recsys_runner.data.files.tabular_config import TabularDataConfig
from recsys_runner.data.generated.generate import write_criteo_parquet

TARGET = 0.90
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1",
               "AWS_EC2_METADATA_DISABLED": "true"}
"""What a loopback moto server takes (any keys): set in this process's environment, as a user sets theirs."""


@contextlib.contextmanager
def loopback_s3(log_dir: str) -> Iterator[str]:
    """A ``moto_server`` on 127.0.0.1 at a free port, until the block ends (stopped by its PID); yields its endpoint."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = os.path.join(os.path.dirname(sys.executable), "moto_server")
    command = [exe] if os.path.exists(exe) else [sys.executable, "-m", "moto.server"]
    with open(os.path.join(log_dir, "moto.log"), "wb") as log:
        proc = subprocess.Popen([*command, "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto_server did not start (is moto[server] installed? see {log_dir}/moto.log)") from None
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


PARTS = 10
"""The data is written as this many part files, as a Spark or ``convert`` job writes a data set: moto's server reads an
object whole for every ranged GET (a test-server cost S3 does not have), so one large file would measure moto."""


def _upload(endpoint: str, local: str, bucket: str) -> str:
    fs = fsspec.filesystem("s3", client_kwargs={"endpoint_url": endpoint, "region_name": "us-east-1"}, skip_instance_cache=True)
    fs.call_s3("create_bucket", Bucket=bucket)
    for name in sorted(os.listdir(local)):
        fs.put_file(os.path.join(local, name), f"{bucket}/train/{name}")
    return f"s3://{bucket}/train/"


def bench_storage(overrides: list[str], quick: bool, rounds: int | None, rows: int | None = None,
                  steps: int | None = None) -> tuple[Regime, dict[str, Any]]:
    """The regime and the raw per-round figures."""
    rows, steps, rounds = rows or (20_000 if quick else 300_000), steps or (20 if quick else 100), rounds or (1 if quick else 5)
    batch = 256 if quick else 2048
    tmp = tempfile.mkdtemp(prefix="bench-storage-")
    for key, value in CREDENTIALS.items():
        os.environ.setdefault(key, value)
    try:
        local = os.path.join(tmp, "train")
        os.mkdir(local)
        for part in range(PARTS):
            write_criteo_parquet(os.path.join(local, f"part-{part:05d}.parquet"), rows // PARTS, seed=part, num_embeddings=100_000,
                                 learnable=False, row_group_rows=16_384)
        with loopback_s3(tmp) as endpoint:  # the same files on disk and in the bucket
            uri = _upload(endpoint, local, "bench")
            c = build_for_bench(["model=deepfm", *COMMON, "data=parquet", f"data.path={local}", f"data.batch_size={batch}",
                                 f"storage.endpoint_url={endpoint}", *overrides], steps)
            try:
                disk = c.loop.data
                assert isinstance(c.run.data, TabularDataConfig)
                bucket = replace(c.run.data, path=uri).build(device=c.env.device)
                for data in (bucket, disk):  # warm-up, not timed: the model's first steps, the store client's first requests
                    runner_round(with_data(c.loop, data), 20)
                figures: dict[str, list[float]] = {"bucket": [], "disk": []}
                for r in range(rounds):
                    order = [("bucket", bucket), ("disk", disk)]
                    for name, data in order if r % 2 == 0 else reversed(order):
                        figures[name].append(runner_round(with_data(c.loop, data), steps))
                    print(f"s round {r + 1}: from the bucket {figures['bucket'][-1]:,.0f} samples/s   from the disk "
                          f"{figures['disk'][-1]:,.0f} samples/s", flush=True)
            finally:
                c.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        store_settings.configure(store_settings.StorageConfig())
    ratios = [b / d for b, d in zip(figures["bucket"], figures["disk"], strict=True)]
    regime = Regime("s_bucket_parquet", "DeepFM from Parquet in a loopback S3 bucket vs the same file on local disk, samples/s",
                    statistics.median(figures["bucket"]), statistics.median(figures["disk"]), statistics.median(ratios), TARGET,
                    min(ratios), max(ratios), figures)
    return regime, {"rows": rows, "batch_size": batch, "steps_per_round": steps, "rounds": rounds,
                    "prefetch_units": store_settings.settings().prefetch_units}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=None, help="rows of the Parquet file (default 300,000; --quick 20,000)")
    parser.add_argument("--steps", type=window_steps, default=None, help="steps per round, windows of 10 (default 100; --quick 20)")
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 5; --quick 1)")
    parser.add_argument("--json", default="bench_results/bench_storage.json", help="where to write the results")
    parser.add_argument("--quick", action="store_true", help="a small file and one round: checks that it runs, not how fast")
    parser.add_argument("overrides", nargs="*", help="extra config overrides (e.g. storage.prefetch_units=4)")
    args = parser.parse_args(argv)
    os.makedirs(os.path.dirname(str(args.json)) or ".", exist_ok=True)
    regime, info = bench_storage(args.overrides, args.quick, args.rounds, args.rows, args.steps)
    result = {"device": "cuda" if torch.cuda.is_available() else "cpu", "threads": torch.get_num_threads(), **info,
              "regimes": {regime.name: asdict(regime)}}
    print(f"{regime.name:<18} {regime.ratio:6.3f} (range {regime.ratio_min:.3f}-{regime.ratio_max:.3f}, target >= {regime.target:.2f})  "
          f"{regime.what}")
    print(f"bucket {regime.runner_samples_per_s:,.0f} samples/s, disk {regime.reference_samples_per_s:,.0f} samples/s; results in {args.json}")
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
