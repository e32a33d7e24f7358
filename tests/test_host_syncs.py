"""Every host sync of a steady-state training step, found and named (issue 34, point 3).

A real run of each model (composed as the CLI does, tiny) records, with :class:`tests.host_syncs.HostSyncs`, the syncs
made through Python in one step that is neither the first, a log, eval nor checkpoint step. Its syncs must be exactly
the named allow-list below, each with its reason: a sync added to the step fails here with its call site. The tasks'
label checks (a class index, a sample weight, ESMM's funnel) must be seen on the host side, in batch assembly
(``train/batch_checks.py``), not in the step. docs/performance.md ("Host syncs per step") is this list as a table.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from omegaconf import DictConfig

from recsys_runner.build import build
from recsys_runner.config import validate
from recsys_runner.train.loop import train
from tests.host_syncs import HostSyncs

RECORDED = 3
"""The step recorded: after the first (lazy state), before the last (a log step); logging, eval and checkpoints are off."""
STEPS = ["data.batch_size=64", "data.num_train_rows=4096", "data.num_eval_rows=256", "train.eval_every_steps=null",
         "train.log_every_steps=1000", f"train.num_steps={RECORDED + 1}", "checkpoint=none", "tracking=none", "distributed.device=cpu"]

TBE = "fbgemm_gpu/split_table_batched_embeddings_ops_training.py _generate_vbe_metadata cpu"
ALLOWED: dict[str, str] = {
    f"recsys_runner/models/lookup.py pooled_lookup → {TBE}":
        "fbgemm's TBE forward moves its feature_dims buffer to the host in every call: a CPU tensor from the first step on, "
        "so a copy of nothing, no sync",
    "recsys_runner/train/stepping.py _step → torch/optim/optimizer.py _get_value item":
        "torch's dense optimizer reads each parameter's step count: a CPU tensor (torch keeps it on the host unless "
        "capturable or fused), no sync",
    f"recsys_runner/models/sequence.py forward → {TBE}": "the history lookups' TBE: as pooled_lookup's, no sync",
    "recsys_runner/train/stepping.py step → torch/optim/optimizer.py _get_value item":
        "the dense optimizer's step count as _step's, under TorchRec's sparse_dist pipeline (which steps it itself)",
    "recsys_runner/train/stepping.py step → torchrec/distributed/dist_data.py _safe_tolist_2d tolist":
        "TorchRec's sparse_dist input distribution: the splits of the ids all-to-all (docs/performance.md, section 3)",
    "recsys_runner/train/stepping.py step → torchrec/sparse/jagged_tensor.py _safe_tolist tolist":
        "TorchRec's sparse_dist input distribution: the distributed batch's per-key lengths",
}
"""Each sync a steady-state step may make, with why it is there (or why it is none on a GPU)."""

PLAIN = [f"recsys_runner/models/lookup.py pooled_lookup → {TBE}", "recsys_runner/train/stepping.py _step → torch/optim/optimizer.py _get_value item"]
SEQUENCE = [*PLAIN, *(k for k in ALLOWED if "/sequence.py" in k)]
SPARSE_DIST = [PLAIN[0], *(k for k in ALLOWED if "/sequence.py" in k or "stepping.py step →" in k)]
CASES: dict[str, tuple[list[str], list[str], str | None]] = {
    "deepfm": ([], PLAIN, None),
    "dlrm": (["model=dlrm"], PLAIN, None),
    "mmoe_sample_weights": (["model=mmoe", "model.tasks=[ctr,cvr]", "data.tasks=[ctr,cvr,w]", "data.label_kinds={w: regression}",
                             "+model.task_specs.cvr.sample_weight=w"], PLAIN, "recsys_runner/tasks.py checked_weights __bool__"),
    "esmm": (["model=esmm", "data=synthetic_esmm"], PLAIN, "recsys_runner/models/esmm.py checked_funnel __bool__"),
    "multiclass": (["model=mmoe", "model.tasks=[ctr,category]", "data.tasks=[ctr,category]", "data.label_kinds={category: multiclass}",
                    "data.label_classes={category: 3}", "+model.task_specs.category={kind: multiclass, num_classes: 3}"],
                   PLAIN, "recsys_runner/tasks.py checked_classes __bool__"),
    "sasrec": (["model=sasrec", "data=synthetic_sequences"], SEQUENCE, None),
    "sasrec_sparse_dist": (["model=sasrec", "data=synthetic_sequences", "distributed.pipeline=sparse_dist"], SPARSE_DIST, None),
    "sasrec_hstu_padded": (["model=sasrec", "model.block=hstu", "model.attention_block=0", "data=synthetic_sequences"], SEQUENCE, None),
    "din_padded": (["model=din", "model.attention=padded", "data=synthetic_sequences"], SEQUENCE, None),
    "din": (["model=din", "data=synthetic_sequences"], SEQUENCE, None),
    "bst_padded": (["model=bst", "model.attention=padded", "data=synthetic_sequences"], SEQUENCE, None),
    "hstu_rank_padded": (["model=hstu_rank", "model.attention=padded", "data=synthetic_sequences"], SEQUENCE, None),
    "bst": (["model=bst", "data=synthetic_sequences"], SEQUENCE, None),
    "hstu_rank": (["model=hstu_rank", "data=synthetic_sequences"], SEQUENCE, None),
    "sasrec_hstu": (["model=sasrec", "model.block=hstu", "data=synthetic_sequences"], SEQUENCE, None),
    "hstu_rank_fbgemm": (["model=hstu_rank", "model.attention_kernel=fbgemm", "data=synthetic_sequences"], SEQUENCE, None),
    "bst_sparse_dist": (["model=bst", "data=synthetic_sequences", "distributed.pipeline=sparse_dist"], SPARSE_DIST, None),
    "hstu_rank_sparse_dist": (["model=hstu_rank", "data=synthetic_sequences", "distributed.pipeline=sparse_dist"], SPARSE_DIST, None),
    "sasrec_hstu_sparse_dist": (["model=sasrec", "model.block=hstu", "data=synthetic_sequences", "distributed.pipeline=sparse_dist"],
                                SPARSE_DIST, None),
}
"""Per run: its overrides, the allow-list entries its step makes, and the label check it makes on the host (if any)."""


def test_the_recorder_sees_each_kind_of_sync() -> None:
    """Each call that reads a value back, or sizes an output by the values, is seen under the mode, and nothing else."""
    t = torch.tensor([1.0, 2.0])
    with HostSyncs() as syncs:
        t.sum().item(), bool(t.any()), t.tolist(), t.cpu(), t.numpy(), float(t[0]), int(t[1]), t[t > 1], torch.unique(t)
        t + 1, t[0], t.sum()  # no sync
    ops = sorted(key.rsplit(" ", 1)[1] for key in syncs.device)
    assert ops == ["__bool__", "__float__", "__getitem__", "__int__", "cpu", "item", "numpy", "tolist", "unique"], ops


def _recorded_step(cfg: DictConfig, monkeypatch: pytest.MonkeyPatch) -> HostSyncs:
    """The syncs of step :data:`RECORDED` of a real run of ``cfg``: from the start of its optimizer step to the next's."""
    c = build(validate(cfg))
    syncs, calls = HostSyncs(), [0]
    step: Callable[[Iterator[Any]], torch.Tensor | None] = c.loop.stepper.step

    def recording(batches: Iterator[Any]) -> torch.Tensor | None:
        calls[0] += 1
        if calls[0] == RECORDED:
            syncs.__enter__()
        elif calls[0] == RECORDED + 1:
            syncs.__exit__(None, None, None)
        return step(batches)

    monkeypatch.setattr(c.loop.stepper, "step", recording)
    try:
        train(c.loop)
    finally:
        c.close()
    assert calls[0] > RECORDED, "the run ended before the recorded step"
    return syncs


@pytest.mark.parametrize("case", list(CASES))
def test_a_steady_step_syncs_only_where_named(make_cfg: Callable[..., DictConfig], monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    overrides, allowed, host_check = CASES[case]
    syncs = _recorded_step(make_cfg(*STEPS, *overrides, tiny=False), monkeypatch)
    new = [syncs.where(k) for k in sorted(set(syncs.device) - set(allowed))]
    assert not new, (f"{case}: host syncs in a training step that ALLOWED does not name: {new}. Move the check to the host "
                     f"side (train/batch_checks.py, the data's batch assembly), or name it in ALLOWED with its reason")
    gone = sorted(set(allowed) - set(syncs.device))
    assert not gone, f"{case}: named syncs the step no longer makes (drop them from CASES / ALLOWED): {gone}"
    checks = {k for k in syncs.host if "checked_" in k}
    assert checks == ({host_check} if host_check else set()), f"{case}: label checks on the host side: {checks}"
