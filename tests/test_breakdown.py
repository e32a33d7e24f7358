"""Where a step's time goes: the breakdown of a profiler trace (``recsys_runner.bench.breakdown``).

A handcrafted GPU-style trace checks each category's attribution (kernels linked to their launches by correlation id,
the launch's innermost range deciding); a real tiny run on the CPU checks the ``--run`` path end to end: the config
composed as the CLI does, ``train.profile`` on, the ``profile/breakdown.txt`` artifact logged, the table and JSON.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from recsys_runner.bench.breakdown import CATEGORIES, breakdown, main

TINY_DEEPFM = ["distributed.device=cpu", "model=deepfm", "model.embedding_dim=4", "model.dense_arch_layer_sizes=[4]",
               "model.deep_layer_sizes=[8]", "data.batch_size=64", "data.num_sparse=4", "data.num_embeddings=1000"]


class _Trace:
    """Builds a Chrome trace as torch.profiler writes it: CPU events on threads, kernels on streams, correlation ids."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self._correlation = 0

    def cpu(self, name: str, ts: float, dur: float, tid: int = 1, cat: str = "cpu_op") -> None:
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur})

    def kernel(self, name: str, launch_ts: float, ts: float, dur: float, tid: int = 1, stream: int = 7,
               cat: str = "kernel", launched: bool = True) -> None:
        """A kernel on ``stream`` and, when ``launched``, its runtime launch event on thread ``tid``."""
        self._correlation += 1
        if launched:
            runtime = "cudaMemcpyAsync" if cat == "gpu_memcpy" else "cudaLaunchKernel"
            self.events.append({"ph": "X", "cat": "cuda_runtime", "name": runtime, "pid": 1, "tid": tid, "ts": launch_ts,
                                "dur": 2, "args": {"correlation": self._correlation}})
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
                            "args": {"correlation": self._correlation, "stream": stream}})

    def step(self, number: int, o: float) -> None:
        """One 1000 µs step at offset ``o``; per step 500 µs of kernels (530 summed: two overlap by 30 µs)."""
        self.cpu(f"ProfilerStep#{number}", o, 1000, cat="user_annotation")
        self.cpu("## copy_batch_to_gpu 5 ##", o + 10, 50, cat="user_annotation")
        self.kernel("Memcpy HtoD (Pinned -> Device)", o + 20, o + 100, 50, stream=8, cat="gpu_memcpy")
        self.cpu("## forward 3 ##", o + 100, 300, cat="user_annotation")
        self.cpu("[lookup]_[model.sparse_arch.ebc]_[table_wise]", o + 110, 90, cat="user_annotation")
        self.cpu("fbgemm::split_embedding_codegen_lookup_adagrad_function_pt2", o + 120, 70)
        self.kernel("void split_embedding_codegen_forward_unweighted_kernel<float>", o + 130, o + 200, 100)
        self.cpu("[output_dist]_[model.sparse_arch.ebc]_[table_wise]", o + 210, 50, cat="user_annotation")
        self.kernel("ncclDevKernel_SendRecv(ncclDevComm*)", o + 220, o + 300, 60, stream=20)
        self.cpu("aten::addmm", o + 300, 50)
        self.kernel("sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n", o + 310, o + 330, 60)  # overlaps the nccl kernel 30 µs
        # backward: the main thread waits in the range, the autograd engine's thread (tid 2) launches the kernels
        self.cpu("## backward 3 ##", o + 400, 300, cat="user_annotation")
        self.cpu("autograd::engine::evaluate_function: AddmmBackward0", o + 420, 50, tid=2)
        self.kernel("sm90_xmma_gemm_bwd", o + 430, o + 450, 80, tid=2)
        self.cpu("autograd::engine::evaluate_function: torch::autograd::CppNode<SplitLookupFunction_adagrad_Op_pt2>",
                 o + 480, 120, tid=2)
        self.kernel("void cub::DeviceRadixSortOnesweepKernel<int>", o + 490, o + 530, 10, tid=2)
        self.kernel("split_embedding_backward_codegen_adagrad_unweighted_kernel_cta_per_row_1", o + 500, o + 540, 110, tid=2)
        self.cpu("## optimizer 3 ##", o + 700, 100, cat="user_annotation")
        self.cpu("Optimizer.step#Adagrad.step", o + 710, 80, cat="user_annotation")
        self.kernel("void at::native::multi_tensor_apply_kernel<Adagrad>", o + 720, o + 730, 40)
        self.cpu("aten::sigmoid", o + 850, 20)  # the train metrics, outside every pipeline range
        self.kernel("sigmoid_kernel", o + 855, o + 860, 10)
        self.kernel("mystery_kernel", 0, o + 900, 10, launched=False)  # no launch in the trace: other

    def trace(self) -> dict[str, Any]:
        return {"schemaVersion": 1, "traceEvents": self.events}


def _gpu_trace() -> dict[str, Any]:
    t = _Trace()
    t.kernel("warmup_kernel", -150, -100, 50)  # before the profiled steps: left out
    t.step(1, 0)
    t.step(2, 1000)
    return t.trace()


def test_gpu_trace_attributes_each_kernel_by_its_launch() -> None:
    b = breakdown(_gpu_trace())
    assert b.mode == "gpu" and b.steps == 2
    assert b.step_ms == pytest.approx(1.0)
    assert b.busy_ms == pytest.approx(0.5) and b.kernel_ms == pytest.approx(0.53)
    assert b.python_host_ms == pytest.approx(0.5) and b.step_per_kernel == pytest.approx(2.0)
    # the nccl kernel and the gemm overlap 30 µs: each gets half of it, so the categories sum to the busy time
    expected = {"input_copy": 0.05, "embedding_fwd": 0.1, "embedding_bwd": 0.12, "all_to_all": 0.045, "dense_fwd": 0.045,
                "dense_bwd": 0.08, "optimizer": 0.04, "metrics": 0.01, "other": 0.01}
    assert b.categories == pytest.approx(expected)
    assert b.kernel_categories == pytest.approx(expected | {"all_to_all": 0.06, "dense_fwd": 0.06})
    assert sum(b.categories.values()) == pytest.approx(b.busy_ms)
    # the main thread's own time: the copy range, and the backward it waits in
    assert b.host["input_copy"] == pytest.approx(0.05) and b.host["dense_bwd"] == pytest.approx(0.3)
    assert sum(b.host.values()) == pytest.approx(b.step_ms)
    # the last step alone gives the same per-step figures
    assert breakdown(_gpu_trace(), steps=1).categories == pytest.approx(expected)
    table = b.table()
    assert "| embedding_bwd | 0.120 | 12.0% |" in table and "step/kernel = 2.00" in table


def test_trace_without_step_markers_is_one_window_and_kernel_names_attribute_unlinked_kernels() -> None:
    t = _Trace()
    t.cpu("aten::mul", 0, 100)
    t.kernel("split_embedding_backward_codegen_adagrad_unweighted_kernel_warp_per_row_1", 0, 50, 40, launched=False)
    b = breakdown(t.trace(), steps=2)
    assert b.steps == 2 and b.step_ms == pytest.approx(0.05) and b.busy_ms == pytest.approx(0.02)
    assert b.categories["embedding_bwd"] == pytest.approx(0.02)
    assert b.host["other"] == pytest.approx(0.0) and b.host["metrics"] == pytest.approx(0.05)


def test_cpu_run_breakdown_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, saved = tmp_path / "b.json", tmp_path / "trace.json"
    main(["--run", "--wait", "1", "--warmup", "1", "--steps", "3", "--json", str(out), "--save-trace", str(saved), *TINY_DEEPFM])
    result = json.loads(out.read_text())
    assert result["mode"] == "cpu" and result["steps"] == 3
    assert {"profile/trace_rank0.json", "profile/key_averages.txt", "profile/breakdown.txt"} <= set(result["artifacts"])
    cats, step = result["categories"], result["step_ms"]
    assert set(cats) == set(CATEGORIES) and all(v >= 0 for v in cats.values()) and result["python_host_ms"] >= -1e-6
    assert sum(cats.values()) <= step * 1.001 and sum(cats.values()) + result["python_host_ms"] == pytest.approx(step)
    for category in ("embedding_fwd", "embedding_bwd", "dense_fwd", "dense_bwd", "optimizer"):
        assert cats[category] > 0, (category, cats)
    assert "| category | ms per step | share of step |" in capsys.readouterr().out
    # the trace the run captured, read back by the command line: the same figures
    again = main([str(saved), "--json", str(tmp_path / "again.json")])
    assert again.categories == pytest.approx(cats) and again.step_ms == pytest.approx(step)
