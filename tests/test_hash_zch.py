"""Managed collision with TorchRec's HashZch module (``module: hash_zch``), the CUDA choice of ``data.managed_collision``.

HashZch trains on CUDA only (its CPU kernel is read-only), so here: the config's module choice and its checks, the
module built on ``meta`` and on CPU, the clear refusal of a CPU training lookup, the read-only lookups that do run on
CPU, and — with the CUDA kernel's insert/evict rules emulated in Python over the real CPU read-only kernel — the step
clock, the evicted slots handed to the embedding module, the counters and the checkpoint checks. The GPU itself is
checked by ``python -m recsys_runner.bench.collision --check distributed.device=cuda``, whose code runs here on the
emulated kernel (slow).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torchrec.modules.hash_mc_modules import HashZchManagedCollisionModule
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
from torchrec.sparse.jagged_tensor import JaggedTensor

import recsys_runner.models.collision as collision
from recsys_runner.configurable import make
from recsys_runner.data.collision import ManagedCollisionConfig, resolve_collision_modules
from recsys_runner.data.generated.synthetic_config import SyntheticDataConfig
from recsys_runner.data.schema import SparseColumn
from recsys_runner.errors import CheckpointError, ConfigError
from recsys_runner.features import FeatureSpec, ManagedCollision, SparseFeature
from recsys_runner.models.collision import (
    CountedHashZch,
    CountedMCH,
    collision_counters,
    managed_collision_module,
)
from recsys_runner.models.lookup import pooled_collections

EMULATED = "_zero_collision_hash" in HashZchManagedCollisionModule.__dict__
"""TorchRec 1.8 calls its kernel through this method, which the emulation replaces (1.6 calls the op directly)."""
needs_emulation = pytest.mark.skipif(not EMULATED, reason="this TorchRec calls the HashZch kernel directly: no hook to emulate it")


def emulated_zero_collision_hash(self: Any, input: torch.Tensor, identities: torch.Tensor, max_probe: int, circular_probe: bool,
                                 exp_hours: int, readonly: bool, local_sizes: torch.Tensor | None, offsets: torch.Tensor | None,
                                 metadata: torch.Tensor | None, output_on_uvm: bool, disable_fallback: bool,
                                 _modulo_identity_DPRECATED: bool, input_metadata: torch.Tensor | None, eviction_threshold: int,
                                 eviction_policy: int, opt_in_prob: int, num_reserved_slots: int, opt_in_rands: torch.Tensor | None,
                                 runtime_meta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fbgemm's CUDA ``zero_collision_hash`` (``faster_hash.cu``), one id after another: the real CPU kernel finds an
    id's slot, or its hash's first probe; a missing id takes the first free slot of its ``max_probe`` probes, else an
    expired one (stamp below the threshold and the id's own: the first probed with eviction policy 0, the lowest
    stamp with policy 1, LRU), else collides on its first probe. Returns the slots and the evicted slots (-1: none)."""
    first, _ = torch.ops.fbgemm.zero_collision_hash(
        input=input, identities=identities, max_probe=max_probe, circular_probe=True, exp_hours=-1, readonly=True,
        local_sizes=local_sizes, offsets=offsets, metadata=None, output_on_uvm=False, disable_fallback=False,
        _modulo_identity_DPRECATED=False, input_metadata=None, eviction_threshold=-1, eviction_policy=0, opt_in_prob=-1,
        num_reserved_slots=-1, opt_in_rands=None, runtime_meta=None)
    if readonly:
        return first, None
    assert metadata is not None and input_metadata is not None and eviction_threshold > 0
    ids, meta, out = identities.view(-1).tolist(), metadata.view(-1).tolist(), first.tolist()
    evicted, stamps = [-1] * len(out), input_metadata.tolist()
    bases = offsets.tolist() if offsets is not None else [0] * len(out)
    sizes = local_sizes.tolist() if local_sizes is not None else [len(ids)] * len(out)
    for i, (x, slot) in enumerate(zip(input.tolist(), out, strict=True)):
        if ids[slot] == x:
            meta[slot] = max(meta[slot], stamps[i])
            continue
        oldest = None
        for probe in range(max_probe):
            s = bases[i] + (slot - bases[i] + probe) % sizes[i]
            if ids[s] == -1:
                ids[s], meta[s], out[i], oldest = x, stamps[i], s, None
                break
            expired = eviction_threshold > meta[s] and meta[s] < stamps[i]
            if expired and eviction_policy == 0:
                ids[s], meta[s], out[i], evicted[i] = x, stamps[i], s, s
                break
            if expired and (oldest is None or meta[s] < meta[oldest]):
                oldest = s
        if oldest is not None:
            ids[oldest], meta[oldest], out[i], evicted[i] = x, stamps[i], oldest, oldest
    identities.view(-1).copy_(torch.tensor(ids))
    metadata.view(-1).copy_(torch.tensor(meta, dtype=metadata.dtype))
    return torch.tensor(out), torch.tensor(evicted)


@pytest.fixture
def emulated(monkeypatch: pytest.MonkeyPatch) -> None:
    """HashZch trains on this CPU: the emulated CUDA kernel, and the CPU allowed to insert."""
    monkeypatch.setattr(HashZchManagedCollisionModule, "_zero_collision_hash", emulated_zero_collision_hash)
    monkeypatch.setattr(collision, "HASH_ZCH_TRAINING_DEVICES", ("cuda", "cpu"))


def _module(device: str = "cpu", slots: int = 8, **settings: Any) -> CountedHashZch | CountedMCH:
    mc = ManagedCollision(**{"input_hash_size": 1000, "module": "hash_zch", **settings})
    features = FeatureSpec(dense_names=(), sparse=(SparseFeature("u", slots, managed_collision=mc),))
    (table,) = features.embedding_tables(8)
    return managed_collision_module(table, features.managed_tables()["t_u"], torch.device(device))


def _lookup(module: torch.nn.Module, *ids: int) -> list[int]:
    return module({"t_u": JaggedTensor(values=torch.tensor(ids), lengths=torch.tensor([len(ids)]))})["t_u"].values().tolist()


# -- the config ------------------------------------------------------------------------------------------------------

def test_auto_picks_mch_on_cpu_and_hash_zch_on_cuda() -> None:
    on_cpu = make(SyntheticDataConfig, managed_collision={"features": ["cat_0"]})
    on_cuda = make(SyntheticDataConfig, managed_collision={"features": ["cat_0"], "eviction_policy": "lru"})
    resolve_collision_modules(on_cpu, "cpu")
    resolve_collision_modules(on_cuda, "cuda")
    assert on_cpu.managed_collision.module == "mch" and on_cpu.managed_collision.spec().policy == "lfu"
    assert on_cuda.managed_collision.module == "hash_zch" and on_cuda.managed_collision.spec().module == "hash_zch"
    columns = SimpleNamespace(sparse=[SparseColumn(name="u", num_embeddings=10, managed_collision={}), SparseColumn(name="i", num_embeddings=10)])
    resolve_collision_modules(columns, "cuda")
    assert columns.sparse[0].managed_collision.module == "hash_zch"
    # where no config decided auto, the device the module is built for does; meta (built for sharding) takes mch
    assert ManagedCollision(input_hash_size=10).on("cuda").module == "hash_zch" and ManagedCollision(input_hash_size=10).on("meta").module == "auto"


def test_hash_zch_off_cuda_is_refused_with_the_fix() -> None:
    data = make(SyntheticDataConfig, managed_collision={"features": ["cat_0"], "module": "hash_zch"})
    with pytest.raises(ConfigError, match=r"data.managed_collision.module=hash_zch needs distributed.device=cuda.*Fix: "
                                          r"distributed.device=cuda, or data.managed_collision.module=mch"):
        resolve_collision_modules(data, "cpu")


@pytest.mark.parametrize(("settings", "message"), [
    ({"module": "hash_zch", "eviction_interval": 10}, r"\.eviction_interval is a setting of module mch, and .*module=hash_zch.*ttl_steps"),
    ({"module": "hash_zch", "decay_exponent": 0.5, "eviction_policy": "lru"}, r"\.decay_exponent is a setting of module mch"),
    ({"module": "hash_zch", "eviction_policy": "lfu"}, r"eviction_policy=lfu is a policy of module mch.*\['lru', 'ttl'\]"),
    ({"module": "mch", "ttl_steps": 5}, r"\.ttl_steps is a setting of module hash_zch"),
    ({"module": "mch", "max_probe": 5}, r"\.max_probe is a setting of module hash_zch"),
    ({"module": "mch", "eviction_policy": "ttl"}, r"eviction_policy=ttl is a policy of module hash_zch"),
    ({"module": "zch"}, r"module='zch' must be one of \['auto', 'mch', 'hash_zch'\]"),
    ({"ttl_steps": -1}, r"ttl_steps=-1 must be at least 0"),
    ({"max_probe": 0}, r"max_probe=0 must be at least 1"),
])
def test_settings_of_the_other_module_are_refused_by_name(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=r"data.sparse\[u\].managed_collision." + message.removeprefix(r"\.")):
        SparseColumn(name="u", num_embeddings=10, managed_collision=settings)


@pytest.mark.parametrize(("settings", "device", "message"), [
    ({"eviction_policy": "lfu"}, "cuda", r"eviction_policy=lfu is a policy of module mch, and data.managed_collision.module=auto "
                                         r"picks hash_zch on cuda.*Fix: .*eviction_policy=lru.*or data.managed_collision.module=mch"),
    ({"ttl_steps": 3}, "cpu", r"ttl_steps is a setting of module hash_zch, and data.managed_collision.module=auto picks mch on cpu"),
])
def test_auto_checks_the_settings_once_the_device_decides(settings: dict[str, Any], device: str, message: str) -> None:
    data = make(SyntheticDataConfig, managed_collision={"features": ["cat_0"], **settings})  # either module might take them
    with pytest.raises(ConfigError, match=message):
        resolve_collision_modules(data, device)


def test_unset_settings_take_each_module_default() -> None:
    spec = ManagedCollisionConfig(module="hash_zch").spec()
    assert (spec.policy, spec.ttl_steps, spec.max_probe) == ("lru", 100, 128)
    assert ManagedCollisionConfig(module="mch").spec().policy == "lfu" and ManagedCollisionConfig().spec().eviction_interval == 100


# -- the module ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_hash_zch_builds_on_meta_and_cpu(device: str) -> None:
    module = _module(device, ttl_steps=7, max_probe=16, eviction_policy="ttl")
    assert isinstance(module, CountedHashZch) and module._hash_zch_identities.shape == (8, 1)
    assert module._eviction_module.ttl_steps == 7 and module.max_probe == 16
    assert set(module.state_dict()) == {"_hash_zch_identities", "_hash_zch_metadata", "_hash_zch_bucket", "_current_iter_tensor"}
    assert isinstance(_module(device, module="auto"), CountedMCH)  # auto on CPU, and on meta where nothing decided it
    mc = ManagedCollision(input_hash_size=1000, module="hash_zch")
    table = FeatureSpec(dense_names=(), sparse=(SparseFeature("u", 8, managed_collision=mc),)).embedding_tables(8)
    _, managed = pooled_collections(table, {"t_u": mc})
    assert isinstance(managed, ManagedCollisionEmbeddingBagCollection)
    assert isinstance(managed._managed_collision_collection._managed_collision_modules["t_u"], CountedHashZch)


def test_slots_the_ranks_cannot_split_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(collision.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(collision.dist, "get_world_size", lambda: 2)
    with pytest.raises(ConfigError, match=r"'t_u' \(module hash_zch\) has 9 slots, which 2 ranks cannot split evenly.*multiple of 2"):
        _module("meta", slots=9)


def test_a_training_lookup_on_cpu_is_refused_with_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"'t_u' uses module hash_zch, which trains on CUDA only.*Fix: distributed.device=cuda, or "
                                          r"managed_collision.module=mch"):
        _lookup(_module().train(), 5)


def test_read_only_lookups_run_on_cpu() -> None:
    module = _module().eval()
    first = _lookup(module, 5, 7)  # an empty table: every id reads its hash's first slot, held by no id
    module._hash_zch_identities.data.view(-1)[first[0]] = 5  # as training would have placed it
    assert _lookup(module, 5, 7)[0] == first[0]
    counts = collision_counters(torch.nn.ModuleDict({"m": module}))
    assert counts["mc/t_u/eval_lookups"] == 4 and counts["mc/t_u/eval_fallback_lookups"] == 3 and counts["mc/t_u/slots_used"] == 1


def test_evict_hands_over_only_evicted_slots() -> None:
    module = _module()
    module._evicted_indices = [torch.tensor([-1, 3, -1, 3]), torch.tensor([-1, -1])]  # the kernel: -1 for "nothing evicted"
    assert module.evict().tolist() == [3] and module.counters()["evictions"] == 1
    module._evicted_indices = [torch.tensor([-1, -1])]
    assert module.evict() is None and module._evicted_indices == []


@needs_emulation
@pytest.mark.parametrize("policy", ["lru", "ttl"])
def test_ids_unseen_for_ttl_steps_lose_their_slot(emulated: None, policy: str) -> None:
    module = _module(ttl_steps=1, max_probe=8, eviction_policy=policy).train()
    for _ in range(2):  # steps 1, 2: three ids, seen at both
        _lookup(module, 5, 7, 900)
        assert module.evict() is None
    old = set(module._hash_zch_identities.view(-1).tolist()) - {-1}
    _lookup(module, *range(10, 20))  # step 3: 5 free slots; the old ids were seen a step ago, still theirs
    assert module.evict() is None and old <= set(module._hash_zch_identities.view(-1).tolist())
    _lookup(module, *range(20, 23))  # step 4: the old ids' stamps (2 + 1) have expired: new ids take their slots
    evicted = module.evict()
    assert evicted is not None and 0 < evicted.numel() <= 3 and -1 not in evicted.tolist()
    counts = module.counters()
    assert counts["evictions"] == evicted.numel() and counts["slots_used"] == 8 and counts["lookups"] == 19
    assert counts["fallback_lookups"] == 5 + 3 - evicted.numel()  # step 3: 10 ids for 5 free slots; step 4: the rest collide
    assert module._step == 4 and int(module._hash_zch_metadata.max()) == 4 + 1


@needs_emulation
def test_a_restored_mapping_is_checked_and_restarts_the_clock(emulated: None) -> None:
    trained = _module(ttl_steps=2).train()
    for step in range(3):
        _lookup(trained, *range(10 * step, 10 * step + 6))
        trained.evict()
    fresh = _module(ttl_steps=2).train()
    fresh.load_state_dict(trained.state_dict())
    fresh.check_restored("t_u")
    assert fresh._step == 3 and torch.equal(fresh._hash_zch_identities, trained._hash_zch_identities)
    smaller = _module(ttl_steps=2, input_hash_size=5)
    smaller.load_state_dict(trained.state_dict())
    with pytest.raises(CheckpointError, match=r"'t_u' maps raw ids up to \d+, outside this config's input_hash_size=5"):
        smaller.check_restored("t_u")
    fresh.get_buffer(HashZchManagedCollisionModule.BUCKET_BUFFER).fill_(2)  # as two ranks save it
    with pytest.raises(CheckpointError, match=r"'t_u' \(module hash_zch\) was saved by 2 rank\(s\), and this run has 1.*Fix: resume on 2"):
        fresh.check_restored("t_u")


@pytest.mark.slow
@needs_emulation
def test_gpu_check_runs_on_cpu_with_an_emulated_kernel(emulated: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``--check``'s code through the runner (DMP, DCP checkpoint, resume into a fresh model) on the emulated kernel."""
    from recsys_runner.bench.collision import CHECK_STEPS, check_hash_zch

    real = ManagedCollisionConfig.resolve
    monkeypatch.setattr(ManagedCollisionConfig, "resolve", lambda self, key, device_type: real(self, key, "cuda"))
    result = check_hash_zch(["distributed.device=cpu", "data.batch_size=128"], tmp_path)
    assert result["restored_step"] == CHECK_STEPS and set(result["tables"]) >= {"t_cat_0", "first_order_t_cat_1"}
    assert all(t["slots_evicted"] > 0 for t in result["tables"].values()) and "eval/auc" in result["eval"]
