"""The GPU step options on a CPU, where they can run there: ``train.compile`` (dynamo's ``aot_eager`` backend: the
same tracing as inductor without the C++ compiler's minutes), and the refusals of what cannot run — CUDA graphs on
a CPU or on shapes that change, the CUDA-only pipelines, a GPU that is not there."""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest
import torch

from recsys_runner.bench import gpu
from recsys_runner.bench.step_options import losses
from recsys_runner.build import build
from recsys_runner.config import validate
from recsys_runner.errors import ConfigError
from recsys_runner.train.compile import dense_modules

FAST = ["tracking=none", "checkpoint=none", "train.num_steps=6", "data.batch_size=64", "data.num_train_rows=2048",
        "data.num_eval_rows=256", "distributed.pipeline=sparse_dist"]


def _curve(make_cfg, *overrides: str) -> tuple[list[float], list[str], list[str]]:
    """Six steps' losses on the first four training batches, the compiled modules, and the model's state-dict keys."""
    c = build(validate(make_cfg(*FAST, *overrides)))
    try:
        batches = list(itertools.islice(c.loop.data.train_batches(0, 0, 1), 4))
        compiled = sorted(n for n, m in dense_modules(c.loop.evaluator.model.module.model) if "_Compiled" in type(m.forward).__name__)
        return losses(c, batches, 6), compiled, sorted(c.loop.evaluator.model.state_dict())
    finally:
        c.close()


@pytest.mark.parametrize("model", ["deepfm", "dlrm"])
def test_compiled_dense_modules_train_exactly_as_the_plain_model(make_cfg, model: str) -> None:
    plain, none, keys = _curve(make_cfg, f"model={model}")
    compiled, names, compiled_keys = _curve(make_cfg, f"model={model}", "train.compile.enabled=true", "train.compile.backend=aot_eager")
    assert none == [] and names, "only the compiled run compiles, and it compiles something"
    assert all("sparse_arch" not in n and "ebc" not in n for n in names), f"embedding modules stay TorchRec's: {names}"
    assert compiled == pytest.approx(plain, abs=1e-6), "compiling the dense modules must not change the training"
    assert compiled_keys == keys, "parameter names (checkpoints) are unchanged by compiling"
    if model == "deepfm":
        assert {"dense_arch", "fm", "deep"} <= set(names)


def test_cuda_graphs_are_refused_on_a_cpu(make_cfg) -> None:
    with pytest.raises(ConfigError, match=r"cuda_graphs=true needs CUDA; this run is on cpu.*Fix"):
        validate(make_cfg("train.compile.cuda_graphs=true"))


def test_cuda_graphs_are_refused_for_histories(make_cfg, monkeypatch) -> None:
    # a run on CUDA as far as the checks can tell: the histories are refused when the data is built, before the model
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    with pytest.raises(ConfigError, match=r"has histories \(.*\), padded to each batch's longest row"):
        build(validate(make_cfg("data=synthetic_sequences", "model=din", "tracking=none", "checkpoint=none",
                                "distributed.device=cuda", "distributed.backend=gloo", "train.compile.cuda_graphs=true", tiny=False)))


@pytest.mark.parametrize(("overrides", "reason"), [
    (["data=synthetic_sequences", "model=din", "data.batch_tokens=4096"], "batch_tokens=4096"),
    (["data=parquet", "data.path=/nonexistent.parquet", "data.drop_remainder=false"], "drop_remainder=false"),
])
def test_cuda_graphs_are_refused_where_shapes_change(make_cfg, overrides: list[str], reason: str) -> None:
    # validation needs no GPU: the run's device is named, and the shapes are known from the config
    with pytest.raises(ConfigError, match=reason):
        validate(make_cfg(*overrides, "distributed.device=cuda", "train.compile.cuda_graphs=true", tiny=False))


def test_compile_settings_are_checked(make_cfg) -> None:
    with pytest.raises(ConfigError, match="train.compile.backend='tvm' must be one of"):
        validate(make_cfg("train.compile.backend=tvm"))
    with pytest.raises(ConfigError, match="reduce-overhead mode; train.compile.backend=aot_eager"):
        validate(make_cfg("train.compile.cuda_graphs=true", "train.compile.backend=aot_eager"))


@pytest.mark.parametrize("pipeline", ["semi_sync", "prefetch"])
def test_cuda_only_pipelines_are_refused_on_a_cpu(make_cfg, pipeline: str) -> None:
    with pytest.raises(ConfigError, match=f"pipeline={pipeline} .*CUDA only"):
        validate(make_cfg(f"distributed.pipeline={pipeline}"))
    # distributed.device=auto on a machine without a GPU: refused when the pipeline is made, before a step
    with pytest.raises(ConfigError, match=f"pipeline={pipeline} .*CUDA only"):
        build(validate(make_cfg(*FAST, f"distributed.pipeline={pipeline}", "distributed.device=auto")))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without a GPU")
def test_cuda_without_a_gpu_is_a_clear_error_before_anything_is_built(make_cfg) -> None:
    with pytest.raises(ConfigError, match=r"distributed.device=cuda but no CUDA device is visible.*Fix: distributed.device=auto"):
        build(validate(make_cfg(*FAST, "distributed.device=cuda")))


def test_the_gpu_measurement_list_names_every_command(tmp_path, capsys) -> None:
    assert gpu.main(["--out", str(tmp_path), "--list"]) == 0
    listed = capsys.readouterr().out
    for m in gpu.MEASUREMENTS:
        assert f"{m.name} -m {m.module}" in listed and "distributed.device=cuda" in listed


NOT_ON_THE_GPU_MACHINE = ("botocore", "boto3", "s3fs", "aiobotocore", "mlflow", "moto", "optuna", "sqlalchemy")
"""Packages the GPU machine's stack lacks (../shared/gpu/README.md: torch, numpy, pyarrow, pandas and what pack.sh carries)."""


def test_every_gpu_measurement_imports_without_the_cpu_only_packages() -> None:
    """A lease was lost to ``stores.py`` importing botocore at module level: each module of the list must import with
    the object-store client, MLflow and Optuna absent (a fresh interpreter, those names made unimportable)."""
    modules = sorted({m.module for m in gpu.MEASUREMENTS} | {"recsys_runner.bench.gpu", "recsys_runner.__main__"})
    code = ("import importlib, sys\n"
            f"for name in {NOT_ON_THE_GPU_MACHINE!r}:\n    sys.modules[name] = None\n"
            f"for module in {modules!r}:\n    importlib.import_module(module)\n"
            f"assert not [n for n in {NOT_ON_THE_GPU_MACHINE!r} if sys.modules.get(n) is not None]\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
