"""HSTU's attention on fbgemm's jagged kernels (``model.attention_kernel=fbgemm``, issue 32): the same numbers as the
PyTorch tiles (values and gradients; time biases, candidates, shared positions, empty rows), in one launch or in chunks
of rows, inside ``hstu_rank`` and ``sasrec``'s HSTU blocks, traced by the sparse-dist pipeline, and refused where no
jagged attention runs. fbgemm's Triton kernels (what runs on CUDA) are checked against the tiles in Triton's interpreter
on the CPU (tests/triton_interpreted.py); on a GPU, ``bench.hstu_kernels`` (in ``bench.gpu``'s list) and the probe of
``attention_kernel=auto`` compare them compiled."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recsys_runner.bench import hstu_kernels
from recsys_runner.config import validate
from recsys_runner.configurable import make
from recsys_runner.errors import ConfigError
from recsys_runner.models import jagged_kernels
from recsys_runner.models.hstu import HSTUBlock
from recsys_runner.models.jagged import tile
from recsys_runner.models.jagged_kernels import fbgemm_pointwise_attention
from recsys_runner.models.sasrec import SASRecConfig
from tests.conftest import LogWarnings, skip_unless_ci
from tests.test_hstu_rank import assert_paths_agree, build_model, tiny
from tests.test_models import small_sequences
from tests.test_pipelines import _train

LENGTHS = [5, 0, 1, 17, 8, 33]


def jagged_inputs(lengths: list[int], dim: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """One batch's flat tokens ``x [T, D]``, query and key times, candidate flags and shared positions."""
    g = torch.Generator().manual_seed(seed)
    tokens = sum(lengths)
    times = [torch.randint(1, 10**5, (tokens,), generator=g).cumsum(0) for _ in range(2)]
    values = {"x": torch.randn(tokens, dim, generator=g), "query_times": times[0], "key_times": times[1],
              "candidates": torch.rand(tokens, generator=g) < 0.3, "positions": torch.randint(0, 12, (tokens,), generator=g)}
    return values


def run_layer(layer: HSTUBlock, inputs: dict[str, torch.Tensor], lengths: list[int], options: set[str]) -> tuple[torch.Tensor, ...]:
    """The layer's output on the jagged tokens and the gradients of ``Σ out²`` in its input and parameters."""
    x = inputs["x"].clone().requires_grad_()
    out = layer.forward_jagged(x, tile(torch.tensor(lengths), 4),
                               (inputs["query_times"], inputs["key_times"]) if "times" in options else None,
                               inputs["candidates"] if "candidates" in options else None,
                               inputs["positions"] if "positions" in options else None)
    (out ** 2).sum().backward()
    grads = tuple(p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in layer.parameters())
    layer.zero_grad()
    return (out.detach(), x.grad, *grads)


@pytest.mark.parametrize("options", [set(), {"times"}, {"times", "candidates"}, {"times", "candidates", "positions"}],
                         ids=["positions-only", "times", "candidates", "shared-positions"])
def test_the_fbgemm_kernels_give_the_tiles_numbers(options: set[str]) -> None:
    torch.manual_seed(0)
    tiles_layer, fbgemm_layer = (HSTUBlock(8, num_heads=2, max_len=40, dropout=0.0, time_buckets=16 if "times" in options else 0,
                                           kernel=kernel) for kernel in ("tiles", "fbgemm"))
    fbgemm_layer.load_state_dict(tiles_layer.state_dict())
    inputs = jagged_inputs(LENGTHS, 8)
    expected, got = (run_layer(layer, inputs, LENGTHS, options) for layer in (tiles_layer, fbgemm_layer))
    torch.testing.assert_close(got[0], expected[0], atol=1e-5, rtol=1e-5)
    for name, a, b in zip(["input", *(n for n, _ in tiles_layer.named_parameters())], got[1:], expected[1:], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=name)


def test_rows_in_chunks_of_launches_give_the_one_launch_numbers() -> None:
    """More rows than one CUDA launch takes (``H × B`` over ``max_rows``) go in chunks, with the same values and gradients;
    the lengths on the host (a batch's, through its tiles) cut the same launches as the lengths read from the device."""
    g = torch.Generator().manual_seed(1)
    lengths = torch.tensor(LENGTHS)
    q, k, v = (torch.randn(int(lengths.sum()), 2, 4, generator=g, requires_grad=True) for _ in range(3))
    position = torch.randn(40, generator=g)
    outputs = []
    for max_rows in (1_000, 5, 1):
        out = fbgemm_pointwise_attention(q, k, v, lengths, position, None, 0.1, max_rows=max_rows)
        sized = fbgemm_pointwise_attention(q, k, v, lengths, position, None, 0.1, max_rows=max_rows, host_lengths=lengths.numpy())
        assert torch.equal(sized, out)
        outputs.append((out, *torch.autograd.grad((out ** 2).sum(), (q, k, v))))
    for chunked in outputs[1:]:
        for a, b in zip(chunked, outputs[0], strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_a_batch_of_empty_rows_gives_an_empty_output() -> None:
    q = torch.zeros(0, 2, 4, requires_grad=True)
    out = fbgemm_pointwise_attention(q, q, q, torch.zeros(3, dtype=torch.long), torch.randn(8), None, 0.1)
    assert out.shape == (0, 2, 4)


def test_fbgemm_on_the_cpu_says_once_that_it_runs_reference_loops() -> None:
    jagged_kernels._note_cpu_loops.cache_clear()
    q, lengths = torch.randn(6, 2, 4), torch.tensor([2, 4])
    with LogWarnings() as logged:
        for _ in range(2):
            jagged_kernels.attention("fbgemm", q, q, q, tile(lengths, 4), torch.randn(8), None, 0.1)
    assert len(logged.messages) == 1 and "Fix: model.attention_kernel=tiles" in logged.messages[0], logged.messages


def test_the_fbgemm_kernel_never_plans_the_tiles_and_the_tiles_plan_once() -> None:
    """fbgemm's kernel reads the rows' lengths alone, so the tiling (host syncs and index work per batch) is not built for
    it; on the tiles, every layer of a batch shares one plan."""
    q, lengths = torch.randn(6, 2, 4), torch.tensor([2, 4])
    tiles = tile(lengths, 4)
    jagged_kernels.attention("fbgemm", q, q, q, tiles, torch.randn(8), None, 0.1)
    assert "_plan" not in tiles.__dict__
    jagged_kernels.attention("tiles", q, q, q, tiles, torch.randn(8), None, 0.1)
    plan = tiles.__dict__["_plan"]
    jagged_kernels.attention("tiles", q, q, q, tiles, torch.randn(8), None, 0.1)
    assert tiles.__dict__["_plan"] is plan


def test_the_layers_of_a_batch_share_its_pair_terms_and_only_for_the_same_inputs() -> None:
    """The bias indices and masks of a batch's pairs are made by its first layer and reused by the next (the same times):
    the numbers are those of fresh tiles; other times (or no times, or candidates) make their own, never a stale reuse."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([3, 0, 37, 9])
    q, k, v = (torch.randn(49, 2, 4, generator=g) for _ in range(3))
    position, time = torch.randn(64, generator=g), torch.randn(17, generator=g)
    times_a = (torch.randint(0, 10**6, (49,), generator=g), torch.randint(0, 10**6, (49,), generator=g))
    times_b = (times_a[0] + 10**5, times_a[1])
    candidates = torch.zeros(49, dtype=torch.bool).index_fill(0, torch.tensor([2, 48]), True)
    tiles = tile(lengths, 8)
    calls = [(times_a, None), (times_b, None), (times_a, None), (None, None), (times_b, candidates)]
    for times, seen_only in calls:
        shared = jagged_kernels.attention("tiles", q, k, v, tiles, position, time, 0.1, times, seen_only)
        fresh = jagged_kernels.attention("tiles", q, k, v, tile(lengths, 8), position, time, 0.1, times, seen_only)
        assert torch.equal(shared, fresh)
    assert len(tiles._shared) == 4  # times_a's terms were reused by the third call


def test_auto_runs_the_tiles_on_the_cpu() -> None:
    """``auto`` (the default) on the CPU is the tiles' computation itself, not fbgemm's loops: the same output bit for bit."""
    torch.manual_seed(0)
    layers = [HSTUBlock(8, num_heads=2, max_len=40, dropout=0.0, time_buckets=16, kernel=kernel) for kernel in ("auto", "tiles")]
    layers[1].load_state_dict(layers[0].state_dict())
    inputs = jagged_inputs(LENGTHS, 8)
    auto, tiles = (run_layer(layer, inputs, LENGTHS, {"times", "candidates"}) for layer in layers)
    assert all(torch.equal(a, b) for a, b in zip(auto, tiles, strict=True))
    assert HSTUBlock(8, 2, 40, 0.0, 0).kernel == "auto" and tiny().attention_kernel == "auto"


def test_the_probe_passes_fbgemms_kernels_that_match_the_tiles() -> None:
    """:func:`fbgemm_unusable` on the CPU (fbgemm's loops there): they run forward and backward and match, so ``None``."""
    jagged_kernels.fbgemm_unusable.cache_clear()
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):  # as a first forward may run
        assert jagged_kernels.fbgemm_unusable(torch.device("cpu")) is None
    jagged_kernels.fbgemm_unusable.cache_clear()


@pytest.mark.parametrize("fault", ["fails", "differs"])
def test_auto_falls_back_to_the_tiles_with_one_line_when_fbgemm_fails_its_probe(monkeypatch: pytest.MonkeyPatch, fault: str) -> None:
    """As on a GPU whose Triton cannot compile fbgemm's kernels (or whose kernels compute something else): ``auto`` says so
    once and runs the tiles; the run goes on."""
    real = jagged_kernels.products()

    def broken() -> tuple[jagged_kernels.Product, jagged_kernels.Product]:
        if fault == "fails":
            raise RuntimeError("PassManager::run failed")  # what a Triton that does not fit the GPU raises
        return real[0], lambda *args: real[1](*args) * 1.01

    monkeypatch.setattr(jagged_kernels, "products", broken)
    monkeypatch.setattr(jagged_kernels, "auto_picks_fbgemm", lambda device: True)
    jagged_kernels.fbgemm_unusable.cache_clear()
    jagged_kernels._note_fallback.cache_clear()
    torch.manual_seed(0)
    layers = [HSTUBlock(8, num_heads=2, max_len=40, dropout=0.0, time_buckets=16, kernel=kernel) for kernel in ("auto", "tiles")]
    layers[1].load_state_dict(layers[0].state_dict())
    inputs = jagged_inputs(LENGTHS, 8)
    with LogWarnings() as logged:
        auto = [run_layer(layers[0], inputs, LENGTHS, {"times"}) for _ in range(2)]
    tiles = run_layer(layers[1], inputs, LENGTHS, {"times"})
    assert all(torch.equal(a, b) for run in auto for a, b in zip(run, tiles, strict=True))
    (line,) = logged.messages
    assert "runs on the PyTorch tiles instead" in line
    assert ("PassManager::run failed" if fault == "fails" else "differ from the tiles' by up to") in line, line
    jagged_kernels.fbgemm_unusable.cache_clear()


def test_hstu_rank_scores_the_same_on_either_kernel() -> None:
    """Same weights, ``attention_kernel: fbgemm`` against ``tiles``: equal logits and gradients, on generated histories
    with event times and empty histories."""
    data = small_sequences(empty_fraction=0.3, max_len=9)
    batch = next(iter(data.train_batches(0, 0, 1)))
    assert_paths_agree(build_model(tiny(attention_kernel="fbgemm"), data.features), build_model(tiny(), data.features), batch)


def test_sasrec_hstu_blocks_score_the_same_on_either_kernel() -> None:
    data = small_sequences(negatives=0.0, empty_fraction=0.3, max_len=9)
    batch = next(iter(data.train_batches(0, 0, 1)))
    models = [build_model(make(SASRecConfig, embedding_dim=8, block="hstu", dropout=0.0, attention_block=4, attention_kernel=kernel),
                          data.features) for kernel in ("fbgemm", "tiles")]
    models[1].load_state_dict(models[0].state_dict())
    for mode in ("train", "eval"):
        (logits, targets), (expected, expected_targets) = (m.train(mode == "train")(batch.dense_features, batch.sparse_features)
                                                            for m in models)
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
        assert torch.equal(targets, expected_targets)


def test_hstu_rank_on_fbgemm_kernels_trains_under_the_sparse_dist_pipeline(make_cfg) -> None:
    final = _train(make_cfg, "model=hstu_rank", "model.attention_kernel=fbgemm")
    assert final and all(math.isfinite(v) for v in final.values()), final


@pytest.mark.parametrize(("overrides", "message"), [
    (["model=hstu_rank", "model.attention_kernel=triton"], "model.attention_kernel='triton' must be one of ['auto', 'tiles', 'fbgemm']"),
    (["model=hstu_rank", "model.attention=padded", "model.attention_kernel=fbgemm"], "model.attention=padded puts the layers on padded rows"),
    (["model=sasrec", "model.attention_kernel=fbgemm"], "model.block=sasrec puts the layers on padded rows"),
    (["model=sasrec", "model.block=hstu", "model.attention_block=0", "model.attention_kernel=fbgemm"], "model.attention_block=0 puts"),
])
def test_a_kernel_where_no_jagged_attention_runs_stops_validate(make_cfg, overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        validate(make_cfg(*overrides))


def test_the_kernel_bench_times_each_kernel_and_compares_it_with_the_tiles(tmp_path) -> None:
    """``recsys_runner.bench.hstu_kernels --quick`` (no timing assertions: the figures are the machine's)."""
    out = tmp_path / "hstu_kernels.json"
    assert hstu_kernels.main(["--quick", "--json", str(out), "distributed.device=cpu"]) == 0
    result = json.loads(out.read_text())
    assert list(result["kernels"]) == ["tiles", "fbgemm", "padded"] and result["tokens"] >= 256
    assert all(k["tokens_per_s"] > 0 for k in result["kernels"].values())
    for kernel in ("fbgemm", "padded"):
        assert result["kernels"][kernel]["matches_tiles"], result["kernels"][kernel]


TRITON_DIR = Path(__file__).resolve().parents[1] / ".venv-triton"


def test_fbgemms_triton_kernels_in_tritons_interpreter_give_the_tiles_numbers() -> None:
    """The Triton kernels ``attention_kernel=fbgemm`` runs on CUDA, interpreted on the CPU: one HSTU layer's output and
    gradients against the tiles' for each input it takes, and over several launches (tests/triton_interpreted.py)."""
    if not (TRITON_DIR / ".installed").exists():
        reason = "TRITON TEST SKIPPED — no .venv-triton; `.ci/install-triton` (run by `make test`) installs Triton there"
        skip_unless_ci(reason)
    root = TRITON_DIR.parent
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(TRITON_DIR), str(root), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "tests.triton_interpreted"], cwd=root, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert sorted(results) == ["candidates", "launches", "positions-only", "shared-positions", "times"]
    assert all(r["within"] for r in results.values()), results
