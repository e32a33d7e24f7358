"""The program a served model runs, and the server around it: what the pointwise model (:mod:`.served`) and the top-k
model (:mod:`recsys_runner.serving.served_topk`) load and run alike.

The ``torch.export`` program (or its AOTInductor package) loaded and made runnable without its runtime checks
(:func:`load_program`, :func:`runnable`), torch's intra-op threads inside ``mlflow models serve``
(:func:`serving_threads`), the error a request the model cannot read raises (:func:`error_class`), and the check that a
model loaded into a process that already imported modules of its code's names from another model's files runs its own
(:func:`check_own_code`).

**Standalone on purpose**, like :mod:`.served`: torch (imported when called), and MLflow when it is there, only; the MLflow
models ``export`` writes carry a copy of it (:data:`.served.SHIPPED`).
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

PROGRAM_FILE = "model.pt2"
COMPILED_FILE = "model_aoti.pt2"
"""The program compiled ahead of time by AOTInductor, when ``export`` was asked for it (:func:`load_program`)."""
SERVER_MODEL_PATH_VARIABLE = "__pyfunc_model_path__"
"""Set in the environment of ``mlflow models serve``'s processes (``mlflow.pyfunc.scoring_server._SERVER_MODEL_PATH``):
the model is being served (:func:`serving_threads`)."""


class RequestError(ValueError):
    """A request the model cannot score; raised as MLflow's ``BAD_REQUEST`` (HTTP 400) when MLflow is there."""


def error_class() -> type[Exception]:
    """MLflow's ``BAD_REQUEST`` exception (HTTP 400 from ``mlflow models serve``), or :class:`RequestError` without MLflow."""
    try:
        from mlflow.exceptions import MlflowException
        from mlflow.protos.databricks_pb2 import BAD_REQUEST
    except ImportError:  # used without MLflow (a plain Python server): a ValueError
        return RequestError

    class BadRequest(MlflowException):
        def __init__(self, message: str) -> None:
            super().__init__(message, error_code=BAD_REQUEST)

    return BadRequest


class CodeClash(RuntimeError):
    """An MLflow model loaded into a process whose modules of the same names are another model's, of other files."""


_IMPORTED: dict[str, bytes] = {}
"""The code file each module name of a model's ``code/`` was imported from in this process, as it was when the model was
loaded (an export loads its model back from a staging folder that is then renamed away)."""


def check_own_code(data_path: str) -> None:
    """Refuse to load the model whose ``data/`` is ``data_path`` when this process already imported a module of its
    ``code/`` from another model's directory, and that file differs from the model's own.

    Why, now that a model's code carries its hash in its module names (:data:`.served.SHIPPED`): two models of other
    code no longer share a name, so this refuses only a model whose ``code/`` was edited after ``export`` wrote it (a
    patch by hand: its names no longer say what its files hold) loaded beside a copy that was not, or the other way round
    — Python imports a name once per process, so the second would run the first one's files, unsaid. Models exported
    before the hashed names (fixed names, ``recsys_served``) are checked by their own copy of this function, which a
    model with hashed names never meets: their names differ from every hashed one.

    Raises:
        CodeClash: naming both directories, the first module that differs and the fix.
    """
    model = os.path.dirname(os.path.dirname(os.path.abspath(data_path)))
    code = os.path.join(model, "code")
    if not os.path.isdir(code):
        return
    for name in sorted(n for n in os.listdir(code) if n.endswith(".py")):
        loaded = getattr(sys.modules.get(name.removesuffix(".py")), "__file__", None)
        if loaded is None:
            continue
        with open(os.path.join(code, name), "rb") as f:
            ours = f.read()
        if os.path.realpath(os.path.dirname(loaded)) == os.path.realpath(code):
            _IMPORTED.setdefault(name, ours)
            continue
        theirs = _IMPORTED.get(name)
        if theirs is None and os.path.isfile(loaded):
            with open(loaded, "rb") as f:
                theirs = f.read()
        if theirs is None or theirs == ours:
            continue
        raise CodeClash(f"the MLflow model {model} cannot be loaded into this process: it already runs the code of another "
                        f"model ({os.path.dirname(os.path.dirname(loaded))}), whose {name} differs from this model's though "
                        f"its name says they are the same code (one of the two was edited after export wrote it), and "
                        f"Python imports a module name once per process, so this model would run that model's code. Fix: "
                        f"load each of the two in its own process, or export the model again from a recsys_runner that "
                        f"holds the change (an export names its code by the hash of its files)")


def load_program(directory: str) -> Any:
    """The program a request runs: the AOTInductor package (:data:`COMPILED_FILE`) when there is one and it loads here —
    compiled C++ kernels, ~0.8 instead of ~4 ms at one row — else the ``torch.export`` program (:func:`runnable`). A
    package that does not load (another torch, another CPU) is named in a warning and the program runs instead."""
    import torch

    compiled = os.path.join(directory, COMPILED_FILE)
    if os.path.exists(compiled):
        try:
            from torch._inductor import aoti_load_package

            return aoti_load_package(compiled)
        except Exception as e:  # noqa: BLE001 - whatever keeps it from loading, the program is there to run instead
            why = (str(e).strip().splitlines() or [type(e).__name__])[0]
            warnings.warn(f"{compiled} does not load here ({type(e).__name__}: {why}); running {PROGRAM_FILE} instead", stacklevel=2)
    return runnable(torch.export.load(os.path.join(directory, PROGRAM_FILE)))


RUNTIME_CHECKS = ("_assert_scalar", "_assert_tensor_metadata")
"""ATen ops of a ``torch.export`` program that only check what its inputs are (sizes that agree, dtypes, devices):
:func:`runnable` leaves them out."""


def runnable(program: Any) -> Any:
    """``program`` (a ``torch.export.ExportedProgram``) as the module a request runs: ``program.module()`` without the
    graph's runtime checks (:data:`RUNTIME_CHECKS`) and the arithmetic on sizes that only they read.

    Those checks, with what only they read, are over half of the graph's nodes and a quarter of its time at a few rows
    (~1.3 ms of 5 at one row). They guard against inputs the row encoder never builds (ids as many as the lengths' sum,
    the dtypes traced); the scores are the same (``check_served`` compares them when the model is written).
    """
    import torch

    module = program.module()
    checks = {getattr(torch.ops.aten, name).default for name in RUNTIME_CHECKS if hasattr(torch.ops.aten, name)}
    graph = module.graph
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in checks:
            graph.erase_node(node)
    graph.eliminate_dead_code()
    module.recompile()
    return module


def serving_threads(torch: Any) -> int:
    """Inside ``mlflow models serve``, one torch intra-op thread per server process (unless ``OMP_NUM_THREADS`` says
    otherwise); the intra-op threads it leaves, returned.

    A server runs each request in a thread of its own, and as many processes as ``--workers``: that is where its
    parallelism comes from. Torch's default, an intra-op thread per core in every process, only fights those threads and
    the client's for the cores: a 1-row request gains nothing from a parallel region, and OpenMP's helper threads keep
    spinning after one; on 2 cores one thread was faster for 1,000-row requests too (docs/performance.md, 'Serving').
    Loaded anywhere else (``mlflow.pyfunc.load_model`` in a script, a batch job), the process's setting is left alone.
    """
    if os.environ.get(SERVER_MODEL_PATH_VARIABLE) and not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(1)
    return int(torch.get_num_threads())
