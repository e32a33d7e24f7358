"""The served MLflow model's speed: ``python -m recsys_runner.bench.serving [--quick] [flags]``.

DeepFM is trained briefly on generated Criteo-format rows written as CSV (:func:`recsys_runner.data.generated.generate.write_criteo_csv`:
label, 13 integer counts ``int_*`` with ``log1p``, 26 hex categoricals ``cat_*`` with vocabularies sized from the file) and
exported with its MLflow model (``export.dir/mlflow_model``, :mod:`recsys_runner.serving.mlflow_model`) by
``python -m recsys_runner`` and ``python -m recsys_runner.export``, run as a user runs them. Then:

* ``http`` — a real ``mlflow models serve --env-manager local`` process on loopback (``--workers``, default MLflow's:
  one uvicorn worker; ``--server-threads``, default the model's own: one intra-op thread inside a server,
  :func:`recsys_runner.data.encoding.served_program.serving_threads`); one client
  sends CSV bodies over a kept-alive connection, one request at a time: p50 and p99 of the request's wall time for a
  1-row and a 1,000-row body (``--requests`` each, after ``--warmup``). Targets on 2 cores: 1 row p50 <= 20 ms,
  1,000 rows p50 <= 150 ms (:data:`TARGETS_MS`).
* ``profile`` — where a request's time goes, the same bodies in this process (medians of wall and CPU time, the parts
  interleaved, in a worker thread as the server runs them, one intra-op thread): MLflow's CSV parsing
  (``parse_csv_input`` with the model's signature, as the server does), MLflow's signature enforcement (pyfunc
  ``predict`` minus the model's own), the served model's request casting and row encoding, the ``torch.export``
  program, and MLflow's JSON answer (``predictions_to_json``); the rest of the HTTP p50 is the server's (HTTP, uvicorn,
  Flask/FastAPI, the process hop).
* ``throughput`` — rows/s of ``mlflow.pyfunc`` ``predict`` on ``--rows`` rows in one call (the frame parsed beforehand,
  and with the parsing counted; with torch's default threads and with ``distributed.num_threads=auto``'s), next to ``python -m recsys_runner.predict`` on the same CSV file (the rows/s its last
  line reports: reading, encoding, scoring in batches of ``--batch-size`` and writing Parquet, the model's build not
  counted).

``--compiled`` exports with ``export.compile=true``, as a user asks for the 1-row latency: the MLflow model then carries
its program compiled by AOTInductor (``data/model_aoti.pt2``), and every figure is the compiled model's. ``make bench``
runs both.

Writes ``bench_results/serving.json`` (``serving_compiled.json`` with ``--compiled``; ``--json``); docs/performance.md quotes the numbers.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import http.client
import io
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from recsys_runner.bench import write_results
from recsys_runner.data.encoding.served_program import COMPILED_FILE
from recsys_runner.data.files.criteo_config import CRITEO_NUM_DENSE, CRITEO_NUM_SPARSE
from recsys_runner.data.generated.generate import write_criteo_csv
from recsys_runner.distributed.env import auto_num_threads
from recsys_runner.serving.mlflow_model import MODEL_DIR

PREDICT_LINE = re.compile(r"predict: wrote (?P<rows>\d+) rows to .* in (?P<seconds>[\d.]+) s \((?P<rate>\d+) rows/s\)")
"""``python -m recsys_runner.predict``'s last line: its rows, seconds and rows/s (reading, encoding, scoring, writing; the
build not counted)."""
TARGETS_MS = {"rows_1": 20.0, "rows_1000": 150.0}
"""p50 latency targets over loopback HTTP on 2 cores (issue 29), per body size."""
BODY_ROWS = {"rows_1": 1, "rows_1000": 1000}


def run_entry(module: str, overrides: Sequence[str], cwd: Path) -> str:
    """``python -m <module> <overrides>`` in ``cwd`` (Hydra's outputs land there), as a user runs it; its output (stdout and
    stderr). The commands run as processes: the bench is an entry itself and imports none of the others."""
    proc = subprocess.run([sys.executable, "-m", module, *overrides], cwd=cwd, capture_output=True, text=True, env=dict(os.environ))
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"python -m {module} failed ({proc.returncode}):\n{output[-4000:]}")
    return output


def criteo_csv_overrides(path: str, batch_size: int) -> list[str]:
    """``data=csv`` reading a :func:`write_criteo_csv` file: ``int_*`` dense with ``log1p``, ``cat_*`` hex ids whose tables
    (vocabularies with OOV rows) are sized from the file — the Criteo preset's preprocessing on a CSV with a header."""
    dense = ", ".join(f"{{name: int_{i}, transform: log1p}}" for i in range(CRITEO_NUM_DENSE))
    sparse = ", ".join(f"{{name: cat_{i}, hex: true}}" for i in range(CRITEO_NUM_SPARSE))
    return ["data=csv", f"data.path={path}", "data.label=label", f"data.dense=[{dense}]", f"data.sparse=[{sparse}]",
            f"data.batch_size={batch_size}"]


MODEL = ["model=deepfm", "model.embedding_dim=8", "model.deep_layer_sizes=[128,64]", "optim=adagrad", "optim.lr=0.02",
         "distributed.device=cpu", "tracking=none"]
"""``experiment=criteo_tsv``'s model and optimizer, on the CPU, nothing logged."""


def train_and_export(root: Path, data: list[str], steps: int, compiled: bool = False) -> tuple[Path, Path, float]:
    """DeepFM trained ``steps`` steps on ``data`` (checkpoint in ``root/ck``) and exported to ``root/export``, with
    ``export.compile=true`` when ``compiled``; returns the checkpoint, the MLflow model's directory and the export's
    seconds.

    Raises:
        RuntimeError: ``compiled`` and the export wrote no compiled program (its warning says why).
    """
    run_entry("recsys_runner", [*data, *MODEL, f"train.num_steps={steps}", "train.eval_every_steps=null",
                                "train.eval_max_batches=1", f"checkpoint.dir={root}/ck"], root)
    checkpoint = root / "ck" / f"step_{steps:08d}"
    start = time.perf_counter()
    run_entry("recsys_runner.export", [*data, *MODEL, f"load={checkpoint}", f"export.dir={root}/export",
                                       f"export.compile={str(compiled).lower()}"], root)
    seconds = time.perf_counter() - start
    model_dir = root / "export" / MODEL_DIR
    if compiled and not (model_dir / "data" / "data" / COMPILED_FILE).is_file():
        raise RuntimeError("--compiled: export.compile=true wrote no compiled program (see its warning above)")
    return checkpoint, model_dir, seconds


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def mlflow_server(model: Path, log_dir: Path, workers: int | None = None, threads: int | None = None,
                  timeout_s: float = 300) -> Iterator[int]:
    """``mlflow models serve -m model --env-manager local`` on 127.0.0.1 at a free port until the block ends (its process
    group stopped by its PID); yields the port once ``/ping`` answers. ``workers``: its uvicorn workers
    (``MLFLOW_MODELS_WORKERS``; ``None``: MLflow's default, one); ``threads``: each worker's torch intra-op threads
    (``OMP_NUM_THREADS``; ``None``: the model's choice, one inside a server)."""
    port = _free_port()
    bin_dir = os.path.dirname(sys.executable)  # the server execs uvicorn from the environment's bin/
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    if workers is not None:
        env["MLFLOW_MODELS_WORKERS"] = str(workers)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    with open(log_dir / "serve.log", "wb") as log:
        server = subprocess.Popen([sys.executable, "-m", "mlflow", "models", "serve", "-m", str(model), "--env-manager", "local",
                                   "--host", "127.0.0.1", "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True, env=env)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"mlflow models serve exited ({server.returncode}): see {log_dir / 'serve.log'}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/ping")
                if conn.getresponse().status == 200:
                    conn.close()
                    break
                conn.close()
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"mlflow models serve did not answer /ping in {timeout_s:.0f} s: see {log_dir / 'serve.log'}")
            time.sleep(0.5)
        yield port
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=30)


class Client:
    """One kept-alive HTTP connection to the server's ``/invocations`` (reopened if the server closes it)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)

    def post(self, body: bytes) -> tuple[float, int, bytes]:
        """Seconds from sending the request to having read the whole answer, the status and the answer."""
        for attempt in range(2):
            try:
                start = time.perf_counter()
                self.conn.request("POST", "/invocations", body=body, headers={"Content-Type": "text/csv"})
                response = self.conn.getresponse()
                answer = response.read()
                return time.perf_counter() - start, response.status, answer
            except (http.client.HTTPException, ConnectionError):
                self.conn.close()
                self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        self.conn.close()


def percentiles(seconds: list[float]) -> dict[str, float]:
    """p50, p99, mean, min and max of ``seconds``, in milliseconds."""
    ms = np.asarray(seconds) * 1e3
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)), "mean_ms": float(ms.mean()),
            "min_ms": float(ms.min()), "max_ms": float(ms.max()), "requests": len(seconds)}


def measure_http(port: int, bodies: dict[str, bytes], requests: int, warmup: int) -> dict[str, dict[str, Any]]:
    """Per body: the request latencies' percentiles (bodies alternating request by request, after ``warmup`` of each)."""
    client = Client(port)
    try:
        for _ in range(warmup):
            for name, body in bodies.items():
                _, status, answer = client.post(body)
                if status != 200:
                    raise RuntimeError(f"the server answered {status} to the {name} body: {answer[:2000]!r}")
        times: dict[str, list[float]] = {name: [] for name in bodies}
        for _ in range(requests):
            for name, body in bodies.items():
                seconds, status, answer = client.post(body)
                assert status == 200, answer[:2000]
                times[name].append(seconds)
    finally:
        client.close()
    return {name: percentiles(t) | {"rows": BODY_ROWS.get(name, 0)} for name, t in times.items()}


def _medians_ms(calls: dict[str, Callable[[], Any]], repeats: int) -> tuple[dict[str, float], dict[str, float]]:
    """Each call's median milliseconds over ``repeats``, of wall time and of this thread's CPU time, the calls interleaved
    (one of each per repeat), so that a machine whose speed drifts moves them alike and their differences stay meaningful."""
    wall: dict[str, list[float]] = {key: [] for key in calls}
    cpu: dict[str, list[float]] = {key: [] for key in calls}
    for _ in range(repeats):
        for key, call in calls.items():
            start, start_cpu = time.perf_counter(), time.thread_time()
            call()
            cpu[key].append(time.thread_time() - start_cpu)
            wall[key].append(time.perf_counter() - start)
    return ({key: statistics.median(t) * 1e3 for key, t in wall.items()}, {key: statistics.median(t) * 1e3 for key, t in cpu.items()})


PARTS = ["parse_csv_ms", "mlflow_schema_ms", "encode_ms", "program_ms", "scores_ms", "json_answer_ms"]
"""A request's parts in the order the server runs them (:func:`profile`)."""


def profile(model_dir: Path, bodies: dict[str, bytes], repeats: int) -> dict[str, dict[str, Any]]:
    """Where a request's time goes, in this process: the parts of the server's ``invocations`` (module docstring), medians
    of wall and of CPU time, in a worker thread as the server runs them (``asyncio.to_thread``) and with one intra-op
    thread: on a 2-core machine whose cores are busy, a 2-thread OpenMP region waits for a core (the program then takes
    several times longer, by how busy the machine is), and one thread puts all of a part's CPU time on this thread's clock."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(_profile, model_dir, bodies, repeats).result()
    finally:
        torch.set_num_threads(threads)


def _profile(model_dir: Path, bodies: dict[str, bytes], repeats: int) -> dict[str, dict[str, Any]]:
    import mlflow.pyfunc
    from mlflow.pyfunc.scoring_server import parse_csv_input, predictions_to_json

    pyfunc = mlflow.pyfunc.load_model(str(model_dir))
    served: Any = pyfunc._model_impl  # the loader module's ServedModel (MLflow's get_raw_model serves python_model flavors only)
    schema = pyfunc.metadata.get_input_schema()
    out: dict[str, dict[str, Any]] = {}
    for name, body in bodies.items():
        text = body.decode()
        frame = parse_csv_input(io.StringIO(text), schema=schema)
        for _ in range(3):  # warm-up: the program's first calls, pandas' and Arrow's caches
            pyfunc.predict(frame)
        inputs = served.encode(frame)
        answer = served.predict(frame)
        calls: dict[str, Callable[[], Any]] = {
            "parse_csv_ms": partial(_parse, parse_csv_input, text, schema), "pyfunc_predict_ms": partial(pyfunc.predict, frame),
            "model_predict_ms": partial(served.predict, frame), "encode_ms": partial(served.encode, frame),
            "program_ms": partial(_run_program, served, inputs), "json_answer_ms": partial(_answer, predictions_to_json, answer),
        }
        out[name] = {clock: _derived(parts) for clock, parts in zip(("wall", "cpu"), _medians_ms(calls, repeats), strict=True)}
    return out


def _derived(parts: dict[str, float]) -> dict[str, float]:
    """``parts`` with MLflow's signature enforcement (pyfunc ``predict`` minus the model's), the model's turning outputs into
    a DataFrame (its ``predict`` minus encoding and program) and the in-process total."""
    parts["mlflow_schema_ms"] = max(parts["pyfunc_predict_ms"] - parts["model_predict_ms"], 0.0)
    parts["scores_ms"] = max(parts["model_predict_ms"] - parts["encode_ms"] - parts["program_ms"], 0.0)
    parts["in_process_total_ms"] = parts["parse_csv_ms"] + parts["pyfunc_predict_ms"] + parts["json_answer_ms"]
    return parts


def _parse(parse_csv_input: Callable[..., Any], text: str, schema: Any) -> Any:
    return parse_csv_input(io.StringIO(text), schema=schema)


def _answer(predictions_to_json: Callable[..., Any], answer: Any) -> None:
    predictions_to_json(answer, io.StringIO())


def _run_program(served: Any, inputs: tuple[Any, ...]) -> Any:
    with torch.inference_mode():
        return served.program(*inputs)


def throughput(model_dir: Path, data: list[str], checkpoint: Path, scored: Path, root: Path) -> dict[str, Any]:
    """Rows/s of pyfunc ``predict`` on the whole ``scored`` file in one call — with torch's default intra-op threads (every
    core) and with the runner's ``distributed.num_threads=auto`` (the idle cores' share, what ``predict`` runs with) —
    and of ``python -m recsys_runner.predict`` on it."""
    import mlflow.pyfunc
    from mlflow.pyfunc.scoring_server import parse_csv_input

    pyfunc = mlflow.pyfunc.load_model(str(model_dir))
    schema = pyfunc.metadata.get_input_schema()
    start = time.perf_counter()
    with open(scored) as f:
        frame = parse_csv_input(f, schema=schema)
    parse_s = time.perf_counter() - start
    rows = len(frame)
    default = torch.get_num_threads()
    seconds: dict[str, float] = {}
    for name, threads in (("default", default), ("auto", auto_num_threads()[0])):
        torch.set_num_threads(threads)
        pyfunc.predict(frame.head(1000))  # warm-up
        start = time.perf_counter()
        scores = pyfunc.predict(frame)
        seconds[name] = time.perf_counter() - start
        seconds[f"{name}_threads"] = threads
        assert len(scores) == rows
    torch.set_num_threads(default)
    output = run_entry("recsys_runner.predict", [*data, *MODEL, f"load={checkpoint}", f"predict.input={scored}",
                                                 f"predict.output={root}/predicted"], root)
    found = PREDICT_LINE.search(output)
    if found is None:
        raise RuntimeError(f"python -m recsys_runner.predict printed no 'wrote N rows … rows/s' line:\n{output[-3000:]}")
    if int(found["rows"]) != rows:
        raise RuntimeError(f"python -m recsys_runner.predict wrote {found['rows']} rows of {scored}'s {rows}:\n{output[-3000:]}")
    return {"rows": rows, "pyfunc_rows_per_s": rows / seconds["default"], "pyfunc_threads": seconds["default_threads"],
            "pyfunc_with_csv_parse_rows_per_s": rows / (seconds["default"] + parse_s),
            "pyfunc_auto_threads_rows_per_s": rows / seconds["auto"], "auto_threads": seconds["auto_threads"],
            "csv_parse_seconds": parse_s, "predict_cli_rows_per_s": float(found["rate"]), "predict_cli_seconds": float(found["seconds"])}


def bench_serving(args: argparse.Namespace) -> dict[str, Any]:
    """Train, export, serve and measure (module docstring); the JSON document."""
    root = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    try:
        train_file, scored = root / "train.csv", root / "score.csv"
        write_criteo_csv(str(train_file), args.train_rows, seed=0)
        write_criteo_csv(str(scored), max(args.rows, max(BODY_ROWS.values())), seed=1)
        data = criteo_csv_overrides(str(train_file), args.batch_size)
        start = time.perf_counter()
        checkpoint, model_dir, export_s = train_and_export(root, data, args.steps, args.compiled)
        print(f"trained {args.steps} steps and exported in {time.perf_counter() - start:.1f} s "
              f"(the export {export_s:.0f} s{', compiled' if args.compiled else ''}): {model_dir}", flush=True)
        lines = [line.split(",", 1)[1] for line in scored.read_text().splitlines(keepends=True)]  # a request has no label
        bodies = {name: "".join(lines[: n + 1]).encode() for name, n in BODY_ROWS.items()}
        start = time.perf_counter()
        with mlflow_server(model_dir, root, args.workers, args.server_threads) as port:
            print(f"mlflow models serve answered /ping after {time.perf_counter() - start:.1f} s", flush=True)
            load = [os.getloadavg()[0]]
            http_figures = measure_http(port, bodies, args.requests, args.warmup)
            load.append(os.getloadavg()[0])
        for name, figures in http_figures.items():
            figures["target_p50_ms"] = TARGETS_MS[name]
            figures["met"] = figures["p50_ms"] <= TARGETS_MS[name]
        parts = profile(model_dir, bodies, args.profile_repeats)
        for name, p in parts.items():
            p["server_rest_ms"] = max(http_figures[name]["p50_ms"] - p["wall"]["in_process_total_ms"], 0.0)
        scored_rows = root / "score_rows.csv"
        scored_rows.write_text("".join(lines[: args.rows + 1]))
        speed = throughput(model_dir, data, checkpoint, scored_rows, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"device": "cpu", "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "train_rows": args.train_rows,
            "steps": args.steps, "batch_size": args.batch_size, "requests": args.requests, "warmup": args.warmup,
            "server_workers": args.workers or int(os.environ.get("MLFLOW_MODELS_WORKERS") or 1),  # `mlflow models serve`'s default: 1
            "server_threads": args.server_threads or os.environ.get("OMP_NUM_THREADS") or "the model's (1 in a server)",
            "compiled": args.compiled, "export_seconds": export_s, "load_average": load, "http": http_figures, "profile": parts,
            "throughput": speed}


def print_table(result: dict[str, Any]) -> None:
    print(f"\nDeepFM, 13 dense + 26 categorical CSV columns; threads={result['threads']}, cpus={result['cpus']}; 1-minute load "
          f"average {result['load_average'][0]:.2f} before the requests, {result['load_average'][1]:.2f} after")
    print(f"{'body':<10} {'p50 ms':>8} {'p99 ms':>8} {'target p50':>11}  met")
    for name, f in result["http"].items():
        print(f"{name:<10} {f['p50_ms']:8.1f} {f['p99_ms']:8.1f} {f['target_p50_ms']:9.0f} ms  {'yes' if f['met'] else 'NO'}")
    print("\nwhere a request's time goes, in-process (ms, medians, one intra-op thread; CPU: this thread's clock)")
    print(f"{'body':<15} " + " ".join(f"{k.removesuffix('_ms'):>13}" for k in [*PARTS, "in_process_total"]))
    for name, p in result["profile"].items():
        for clock in ("cpu", "wall"):
            print(f"{name + ' ' + clock:<15} " + " ".join(f"{p[clock][k]:13.2f}" for k in [*PARTS, "in_process_total_ms"]))
        print(f"{name:<15} server_rest (HTTP p50 - in-process wall total): {p['server_rest_ms']:.2f}")
    s = result["throughput"]
    print(f"\nthroughput on {s['rows']:,} rows: pyfunc predict {s['pyfunc_rows_per_s']:,.0f} rows/s with {s['pyfunc_threads']} "
          f"thread(s) ({s['pyfunc_with_csv_parse_rows_per_s']:,.0f} with MLflow's CSV parsing), "
          f"{s['pyfunc_auto_threads_rows_per_s']:,.0f} with {s['auto_threads']} (auto); "
          f"python -m recsys_runner.predict {s['predict_cli_rows_per_s']:,.0f} rows/s")
    compiled = f"; exported with export.compile=true in {result['export_seconds']:.0f} s" if result["compiled"] else ""
    print(f"server: {result['server_workers']} worker(s), threads: {result['server_threads']}{compiled}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train-rows", type=int, default=None, help="rows of the training CSV (default 20,000; --quick 2,000)")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default 40; --quick 4)")
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--requests", type=int, default=None, help="timed requests per body (default 50; --quick 3)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed requests per body first (default 5; --quick 1)")
    parser.add_argument("--rows", type=int, default=None, help="rows scored for the throughput (default 50,000; --quick 1,000)")
    parser.add_argument("--profile-repeats", type=int, default=None, help="in-process repeats per part (default 30; --quick 2)")
    parser.add_argument("--workers", type=int, default=None, help="the server's uvicorn workers (default: MLflow's, one)")
    parser.add_argument("--server-threads", type=int, default=None,
                        help="each server worker's torch threads (OMP_NUM_THREADS; default: the model's, one in a server)")
    parser.add_argument("--compiled", action="store_true",
                        help="export with export.compile=true: the served program is compiled by AOTInductor")
    parser.add_argument("--json", default=None,
                        help="where to write the results (default bench_results/serving.json; serving_compiled.json with --compiled)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks that it runs, not how fast")
    args = parser.parse_args(argv)
    quick = args.quick
    for key, full, small in (("train_rows", 20_000, 2_000), ("steps", 40, 4), ("requests", 50, 3), ("warmup", 5, 1),
                             ("rows", 50_000, 1_000), ("profile_repeats", 30, 2)):
        if getattr(args, key) is None:
            setattr(args, key, small if quick else full)
    result = bench_serving(args)
    print_table(result)
    write_results(args.json or f"bench_results/serving{'_compiled' if args.compiled else ''}.json", result)
    return result


if __name__ == "__main__":
    main()
