"""Parts shared by every model, in TorchRec's style: small modules with a shape legend.

Shape legend: ``B`` batch size, ``F`` number of sparse features, ``D`` embedding dim,
``N`` number of dense features. How a model is trained (its tasks' losses, ``(loss, output)`` for TorchRec's
pipelines) is :mod:`recsys_runner.models.train_wrapper`'s.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, data_type_to_dtype
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.modules.mlp import MLP
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.types import DataType

from recsys_runner.configurable import Configurable
from recsys_runner.errors import require
from recsys_runner.features import DataNeeds, FeatureSpec
from recsys_runner.models.lookup import concatenated_lookup, managed_feature_names, pooled_collections

__all__ = ["LINEAR_ROW_WIDTH", "MLP", "DenseArch", "DenseFields", "FMInteraction", "FieldArch", "LinearArch", "ModelConfig",
           "SparseArch", "check_eval_metrics", "check_layer_sizes", "embedding_width_rule", "materialize", "projection_sizes",
           "require_count", "store_tables", "warn_unread"]

log = logging.getLogger(__name__)

LINEAR_ROW_WIDTH = 4
"""Floats per id in a :class:`LinearArch` table: fbgemm's fused kernels store rows in multiples of 4, so an
id's linear weight is the sum of its 4-float row (still one linear weight per id)."""


@dataclass(kw_only=True)
class ModelConfig(Configurable):
    """Base of every model config (``conf/model/<name>.yaml``'s schema): the model's parameters, each declared once.

    A subclass sets ``_target_`` to its model class, declares the hyperparameters with their defaults and
    docstrings, and checks them in ``__post_init__``. The model class takes the config first plus the
    runtime objects only the builder has::

        class DeepFM(nn.Module):
            def __init__(self, config: DeepFMConfig, *, features: FeatureSpec, dense_device: torch.device | None = None) -> None: …

        model = run.model.build(features=data.features, dense_device=device)
    """

    def data_needs(self) -> DataNeeds:
        """What the model asks of its data (its labels, its towers' pairs), declared before anything is built.

        By default one binary label ``[B]``; a multi-task or two-tower model overrides this.
        """
        return DataNeeds()

    def build(self, *, features: FeatureSpec, dense_device: torch.device | None = None) -> nn.Module:
        """The model this config describes: ``Cls(self, features=features, dense_device=dense_device)``.

        Args:
            features: the data's feature schema.
            dense_device: device of the dense parameters (embedding tables start on ``meta``).
        """
        model: nn.Module = self.component_class()(self, features=features, dense_device=dense_device)
        return model


def materialize(model: nn.Module, device: torch.device | str = "cpu") -> nn.Module:
    """``model`` (in place) with its ``meta`` embedding tables allocated on ``device`` and initialized by each table's
    ``init_fn``: what DistributedModelParallel does for the shards a rank owns, for a model used in one process
    without it (the docstrings' examples, tests, a notebook). The runner never calls this; it shards.

    Raises:
        ValueError: a tensor that is no embedding table is still on ``meta``: a managed-collision module's mapping,
            which DistributedModelParallel rebuilds per shard (build such a model with ``build()``, sharded).
    """
    for module in model.modules():
        if isinstance(module, EmbeddingBagCollection):
            module.to_empty(device=device)
            for table in module.embedding_bag_configs():
                assert table.init_fn is not None  # TorchRec's config sets one when none is given
                table.init_fn(module.embedding_bags[table.name].weight)
        elif isinstance(module, EmbeddingCollection):
            module.to_empty(device=device)
            for config in module.embedding_configs():
                assert config.init_fn is not None
                config.init_fn(module.embeddings[config.name].weight)
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"{type(model).__name__} still has tensors on meta that materialize() cannot initialize: {left[:3]} "
                         f"(managed-collision modules are rebuilt per shard by DistributedModelParallel). Fix: drop "
                         f"managed_collision from the features, or build the model sharded")
    return model


def store_tables(model: nn.Module, data_type: Callable[[str, list[str]], DataType]) -> nn.Module:
    """``model`` (in place) with each embedding table stored in ``data_type(table name, the features reading it)``
    (``precision.embedding_data_type`` and ``embedding_data_type_by_feature``: ``PrecisionConfig.table_data_type``).

    Each table config of its ``EmbeddingBagCollection``s and ``EmbeddingCollection``s gets its type, which
    TorchRec's sharders hand to fbgemm as the kernel's ``weights_precision``, and each table's weight (on ``meta`` until
    DistributedModelParallel materializes it) takes the matching dtype, which the planner's memory estimate reads
    (``tensor.element_size()``) and an unsharded model (export) loads into. Done once, after the model is built, so that
    no model (nor a user's own) passes the setting to its tables; TorchRec's collections would otherwise make every
    table float32, and float16 for any other ``data_type`` (bfloat16 included).
    """
    for module in model.modules():
        if isinstance(module, EmbeddingBagCollection):
            tables: list[tuple[Any, nn.EmbeddingBag | nn.Embedding]] = [
                (c, cast(nn.EmbeddingBag, module.embedding_bags[c.name])) for c in module.embedding_bag_configs()]
        elif isinstance(module, EmbeddingCollection):
            tables = [(c, cast(nn.Embedding, module.embeddings[c.name])) for c in module.embedding_configs()]
        else:
            continue
        for config, table in tables:
            config.data_type = data_type(config.name, list(config.feature_names))
            dtype = data_type_to_dtype(config.data_type)
            weight = table.weight
            if weight.dtype != dtype:
                table.weight = nn.Parameter(weight.detach().to(dtype), requires_grad=weight.requires_grad)
    return model


def embedding_width_rule(model: type[nn.Module]) -> str | None:
    """What ``model`` states about its tables' widths: its ``same_embedding_width`` class attribute.

    A reason (why the model needs one width for every table, e.g. an interaction taking dot products
    between embeddings) makes :class:`SparseArch` refuse per-feature widths that differ from
    ``model.embedding_dim``; ``None`` (a model that only concatenates embeddings) accepts mixed
    per-feature widths (``data.sparse[...].embedding_dim``).
    """
    rule: Any = getattr(model, "same_embedding_width", None)
    return rule if isinstance(rule, str) else None


def check_layer_sizes(name: str, sizes: list[int], *, allow_empty: bool = False) -> None:
    """Validate an MLP's layer sizes from config: all positive, and non-empty unless ``allow_empty`` (a part the
    model can do without, e.g. AutoInt's optional DNN, whose key documents what ``[]`` means)."""
    require(allow_empty or len(sizes) > 0, f"model.{name} must list at least one layer size, e.g. model.{name}=[64,16]")
    positive = [s if s > 0 else 1 for s in sizes]
    require(all(s > 0 for s in sizes), f"model.{name}={sizes} has a non-positive layer size. Fix: every size at least 1, "
                                       f"e.g. model.{name}=[{','.join(str(s) for s in positive)}]")


def require_count(config: ModelConfig, key: str, least: int, note: str = "") -> None:
    """``model.<key>`` (a count) is at least ``least`` (0 or 1), else a :class:`ConfigError` naming the value and, as the fix,
    the key's default; ``note`` says what the bound means, e.g. `` (0: padded)``."""
    value, default = getattr(config, key), {f.name: f.default for f in dataclasses.fields(config)}[key]
    require(value >= least, f"model.{key} must be {'positive' if least == 1 else f'>= {least}'}{note}, got {value}. Fix: e.g. "
                            f"model.{key}={default}")


def warn_unread(config: ModelConfig, keys: Sequence[str], read: bool, setting: str) -> None:
    """Warn of ``keys`` of ``config`` set away from their defaults when ``read`` is false: another setting (``setting``, the
    one under which the model reads them, e.g. ``model.position=time_gap``) leaves them unread, so the run trains the same
    model whatever their values. A warning, not an error: a sweep or a comparison may toggle that setting with the others
    fixed (``model.logq_correction=true,false model.logq_alpha=0.05``), and its runs without it are meant."""
    defaults = {f.name: f.default if f.default_factory is dataclasses.MISSING else f.default_factory() for f in dataclasses.fields(config)}
    shown = {k: f"[{','.join(map(str, v))}]" if isinstance(v := getattr(config, k), list) else v for k in keys}
    unread = [f"model.{k}={shown[k]}" for k in keys if not read and getattr(config, k) != defaults[k]]
    if unread:
        log.warning("%s %s no effect: the model reads %s only with %s", ", ".join(unread), "has" if len(unread) == 1 else "have",
                    "it" if len(unread) == 1 else "them", setting)


def check_eval_metrics(metrics: list[str], eval_negatives: int, items: str, example: str) -> None:
    """A two-tower or next-item model's own ``model.eval_metrics``: at least one (its task reads an empty list as unset and
    would log its default metrics, which the user did not ask for), and no ``coverage@<k>`` when ``eval_negatives`` ranks
    each row against sampled items (coverage counts ``items``, e.g. ``catalogue items``, in the top k of all of them).
    ``example`` is a list to suggest, e.g. ``hr@10,ndcg@10``."""
    require(len(metrics) > 0, f"model.eval_metrics=[] lists no metric, and the eval would log the model's default ones instead. "
                              f"Fix: list the metrics to log, e.g. model.eval_metrics=[{example}], or drop the override for the "
                              f"default")
    require(not (eval_negatives and any(m.startswith("coverage@") for m in metrics)),
            f"model.eval_metrics={list(metrics)}: coverage@<k> counts {items} in the top k, which a ranking against "
            f"model.eval_negatives={eval_negatives} sampled items has not. Fix: remove coverage@<k>, or model.eval_negatives=0")


def projection_sizes(name: str, sizes: list[int | None], embedding_dim: int, model: str, why: str) -> list[int]:
    """An MLP's layer sizes from config whose output must be ``embedding_dim`` wide: each ``null`` entry is
    ``embedding_dim`` (so ``model.embedding_dim`` alone changes the width), and the last must equal it.

    Args:
        name: the config key (``dense_arch_layer_sizes``), for messages.
        sizes: the configured sizes, ``None`` meaning "``model.embedding_dim``".
        embedding_dim: ``D``.
        model: the model's name and ``why``: the reason the output must be ``D`` wide, for the message.

    Raises:
        ConfigError: an empty list, a non-positive size, or a last size other than ``D``.
    """
    resolved = [embedding_dim if s is None else s for s in sizes]
    check_layer_sizes(name, resolved)
    require(
        resolved[-1] == embedding_dim,
        f"model.{name} ends in {resolved[-1]} but model.embedding_dim={embedding_dim}: {model}'s {why}, so they must have "
        f"the same width. Fix: end model.{name} in null (it then follows model.embedding_dim), e.g. "
        f"model.{name}=[{''.join(f'{s},' for s in resolved[:-1])}null]",
    )
    return resolved


class SparseArch(nn.Module):
    """Embeds every sparse feature: ``KeyedJaggedTensor → [B, ΣD_f]``, the features' pooled embeddings
    concatenated in ``features.sparse`` order (``[B, F·D]`` when every width is ``D``).

    Each feature's width ``D_f`` is its own ``embedding_dim`` in the data's schema, else the model's
    ``embedding_dim``. The model states whether it accepts mixed widths (its ``same_embedding_width``,
    :func:`embedding_width_rule`); this enforces only that. A model that needs one width reads the
    fields as ``[B, F, D]`` with :meth:`fields`.

    A table whose feature asks for managed collision (``SparseFeature.managed_collision``) is looked up through
    TorchRec's ManagedCollisionEmbeddingBagCollection (``mc_ebc``), the others through a plain one (``ebc``).

    The EmbeddingBagCollection is created on ``meta``: no memory is spent until
    DistributedModelParallel materializes each shard on the rank that owns it.

    Args:
        features: the data's feature schema; one table ``t_<feature>`` per sparse feature (or a shared one).
        embedding_dim: ``D``, the width of every table whose features set none.
        model: the model class that owns this arch; its ``same_embedding_width`` and name go into the check.

    Raises:
        ConfigError: the model needs one width and a feature sets another, naming the model and why.

    Example::

        >>> from recsys_runner.configurable import make
        >>> from recsys_runner.data.generated.synthetic_config import SyntheticDataConfig
        >>> from recsys_runner.models.common import SparseArch, materialize
        >>> from recsys_runner.models.deepfm import DeepFM
        >>> data = make(SyntheticDataConfig, batch_size=8, num_dense=3, num_sparse=4, num_embeddings=50).build()
        >>> batch = next(iter(data.train_batches(epoch=0, rank=0, world_size=1)))
        >>> arch = materialize(SparseArch(data.features, embedding_dim=8, model=DeepFM))   # DeepFM: one width for every table
        >>> embedded = arch(batch.sparse_features)
        >>> embedded.shape, arch.fields(embedded).shape   # [B, F·D], [B, F, D]
        (torch.Size([8, 32]), torch.Size([8, 4, 8]))
    """

    def __init__(self, features: FeatureSpec, embedding_dim: int, model: type[nn.Module]) -> None:
        super().__init__()
        reason = embedding_width_rule(model)
        if reason is not None:
            features.require_uniform_dim(embedding_dim, model.__name__, reason)
        self.ebc, self.mc_ebc = pooled_collections(features.embedding_tables(embedding_dim), features.managed_tables(),
                                                   features.weighted)
        """The plain tables (pooled by the batch's weights when a feature is weighted), and those whose raw ids a
        managed-collision module maps (``models/collision.py``)."""
        self.feature_names = features.sparse_names
        self.managed_names = managed_feature_names(features)
        self.weighted_names = features.weighted_names
        self.widths = features.embedding_dims(embedding_dim)
        """``D_f`` of each feature, in ``feature_names`` order."""
        self.output_dim = sum(self.widths)
        """``ΣD_f``: the width of :meth:`forward`'s output."""

    def forward(self, sparse: KeyedJaggedTensor) -> torch.Tensor:
        return concatenated_lookup(self.ebc, self.mc_ebc, sparse, self.feature_names, self.managed_names, self.weighted_names)

    def fields(self, embedded: torch.Tensor) -> torch.Tensor:
        """:meth:`forward`'s ``[B, F·D]`` as ``[B, F, D]``; only for a model that needs one width."""
        assert len(set(self.widths)) <= 1, "fields() needs one embedding width; the model must state same_embedding_width"
        return embedded.unflatten(1, (len(self.widths), self.widths[0] if self.widths else 0))

    def columns(self, names: list[str]) -> list[int]:
        """The columns of :meth:`forward`'s output that hold the features ``names``, feature by feature."""
        offsets = [sum(self.widths[:i]) for i in range(len(self.widths))]
        return [c for n in names for i in [self.feature_names.index(n)] for c in range(offsets[i], offsets[i] + self.widths[i])]


class DenseArch(nn.Module):
    """MLP over the dense features: ``[B, N] → [B, layer_sizes[-1]]``.

    Example::

        >>> import torch
        >>> from recsys_runner.models.common import DenseArch
        >>> DenseArch(in_features=3, layer_sizes=[16, 8])(torch.randn(4, 3)).shape
        torch.Size([4, 8])
    """

    def __init__(self, in_features: int, layer_sizes: list[int], device: torch.device | None = None) -> None:
        super().__init__()
        with warnings.catch_warnings():
            # Data without dense columns (MovieLens' ids) gives a first layer of 0 inputs: its weight is empty, and torch
            # warns that initializing it does nothing. That is exactly right here: the layer's output is its bias, a
            # learned constant field (DeepFM's, DLRM's interactions keep their shape).
            warnings.filterwarnings("ignore", message="Initializing zero-element tensors is a no-op", category=UserWarning)
            self.mlp = MLP(in_features, layer_sizes, bias=True, activation="relu", device=device)

    def forward(self, dense: torch.Tensor) -> torch.Tensor:
        return self.mlp(dense)


class LinearArch(nn.Module):
    """A linear model of the inputs, one weight per sparse id: ``(dense [B, N], sparse KJT) → [B]``.

    ``Σ_f w_f[id_f] + vᵀ dense + b``: each sparse feature reads a table ``<prefix><table>`` with one weight
    per id (a :data:`LINEAR_ROW_WIDTH`-float row summed; a multi-hot bag pools its ids' weights), created on
    ``meta`` like every table. Wide & Deep's wide head and DeepFM's first-order term.

    Why tables of their own, 4 floats wide, rather than one more column of the embedding tables: they are
    ordinary EmbeddingBagCollection tables, so the planner shards them like every other (table-wise for
    small ones, row-wise for large ones, next to or apart from their embedding table) and the fused
    TBE kernels batch them together; an extra column would make every embedding table ``D + 4`` wide
    (fbgemm's row granularity), put the linear weight under the embedding row's row-wise Adagrad state,
    let column-wise sharding split it off, and have every forward slice it out of the FM and deep inputs.

    One consequence to know when tuning: each of an id's 4 floats gets the whole gradient of the logit, so an optimizer
    step moves the id's weight by 4 times what it moves one float (Adagrad's first step: ``4 · lr`` per id, on every id
    of the row), where a 1-float weight would move once.

    Args:
        features: the data's feature schema (tables and pooling follow its tables).
        prefix: the tables' name prefix (``wide_``, ``first_order_``), distinct from the embedding tables'.
        device: device of the dense linear layer.
        zero_init: start every id's weight at 0 (FM's first-order weights, as libFM does: the term adds only
            what it learns, instead of 4·F random floats of noise per row of the logit at step 0).

    Example::

        >>> from recsys_runner.configurable import make
        >>> from recsys_runner.data.generated.synthetic_config import SyntheticDataConfig
        >>> from recsys_runner.models.common import LinearArch, materialize
        >>> data = make(SyntheticDataConfig, batch_size=8, num_dense=3, num_sparse=4, num_embeddings=50).build()
        >>> batch = next(iter(data.train_batches(epoch=0, rank=0, world_size=1)))
        >>> arch = materialize(LinearArch(data.features, prefix="linear_"))
        >>> arch(batch.dense_features, batch.sparse_features).shape
        torch.Size([8])
    """

    def __init__(self, features: FeatureSpec, prefix: str, device: torch.device | None = None, zero_init: bool = False) -> None:
        super().__init__()
        bounds = {"weight_init_min": 0.0, "weight_init_max": 0.0} if zero_init else {}
        tables = [
            EmbeddingBagConfig(name=f"{prefix}{t.name}", embedding_dim=LINEAR_ROW_WIDTH, num_embeddings=t.num_embeddings,
                               feature_names=list(t.feature_names), pooling=t.pooling, **bounds)
            for t in features.embedding_tables(LINEAR_ROW_WIDTH)
        ]
        managed = {f"{prefix}{t}": mc for t, mc in features.managed_tables().items()}  # the same raw ids, mapped alike
        self.ebc, self.mc_ebc = pooled_collections(tables, managed, features.weighted)
        self.dense = nn.Linear(features.num_dense, 1, device=device) if features.num_dense else None
        self.feature_names = features.sparse_names
        self.managed_names = managed_feature_names(features)
        self.weighted_names = features.weighted_names

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        # [B, F·4] viewed as [B, F, 4]: the layout torch.stack of the features' [B, 4] gives, so the sum is unchanged
        pooled = concatenated_lookup(self.ebc, self.mc_ebc, sparse, self.feature_names, self.managed_names, self.weighted_names)
        logit = pooled.unflatten(1, (len(self.feature_names), LINEAR_ROW_WIDTH)).sum(dim=(1, 2))
        return logit if self.dense is None else logit + self.dense(dense).squeeze(1)


class FMInteraction(nn.Module):
    """Second-order factorization-machine term: ``[B, F, D] → [B]``, ``½ Σ_d ((Σ_f v)² − Σ_f v²)``: the sum of the
    dot products of every pair of fields, in ``O(F·D)``.

    Example::

        >>> import torch
        >>> from recsys_runner.models.common import FMInteraction
        >>> FMInteraction()(torch.ones(2, 3, 4))   # 3 fields of four ones: 3 pairs, each dot product 4
        tensor([12., 12.])
    """

    def forward(self, fields: torch.Tensor) -> torch.Tensor:
        square_of_sum = fields.sum(dim=1).pow(2)
        sum_of_square = fields.pow(2).sum(dim=1)
        return 0.5 * (square_of_sum - sum_of_square).sum(dim=1)


class DenseFields(nn.Module):
    """Each dense feature as a field of width ``D``: ``dense [B, N] → [B, N, D]``, ``x_j · v_j`` with a learned
    vector ``v_j`` per feature (how a factorization machine embeds a real-valued input).

    Example::

        >>> import torch
        >>> from recsys_runner.models.common import DenseFields
        >>> DenseFields(num_dense=3, embedding_dim=8)(torch.randn(4, 3)).shape
        torch.Size([4, 3, 8])
    """

    def __init__(self, num_dense: int, embedding_dim: int, device: torch.device | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_dense, embedding_dim, device=device))
        nn.init.normal_(self.weight, std=0.01)

    def forward(self, dense: torch.Tensor) -> torch.Tensor:
        return dense.unsqueeze(2) * self.weight


class FieldArch(nn.Module):
    """Every input feature as one field of width ``D``: ``(dense [B, N], sparse KJT) → [B, N + F, D]``.

    The ``N`` dense features come first, each its value times a learned vector (:class:`DenseFields`, as a
    factorization machine and AutoInt embed a real value), then the ``F`` sparse features' pooled embeddings
    (:class:`SparseArch`). What the field-interaction models (xDeepFM's CIN, AutoInt's attention, MaskNet's masks)
    read; they need one width for every table, which ``model``'s ``same_embedding_width`` states.

    Args:
        features: the data's feature schema.
        embedding_dim: ``D``.
        model: the model class that owns this arch (its ``same_embedding_width`` goes to :class:`SparseArch`).
        device: device of the dense fields' vectors (the tables start on ``meta``).

    Example::

        >>> from recsys_runner.configurable import make
        >>> from recsys_runner.data.generated.synthetic_config import SyntheticDataConfig
        >>> from recsys_runner.models.autoint import AutoInt
        >>> from recsys_runner.models.common import FieldArch, materialize
        >>> data = make(SyntheticDataConfig, batch_size=8, num_dense=3, num_sparse=4, num_embeddings=50).build()
        >>> batch = next(iter(data.train_batches(epoch=0, rank=0, world_size=1)))
        >>> arch = materialize(FieldArch(data.features, embedding_dim=8, model=AutoInt))
        >>> arch(batch.dense_features, batch.sparse_features).shape   # [B, N + F, D]: 3 dense fields, then 4 sparse ones
        torch.Size([8, 7, 8])
    """

    def __init__(self, features: FeatureSpec, embedding_dim: int, model: type[nn.Module], device: torch.device | None = None) -> None:
        super().__init__()
        self.sparse_arch = SparseArch(features, embedding_dim, model)
        self.dense_fields = DenseFields(features.num_dense, embedding_dim, device=device) if features.num_dense else None
        self.num_fields = features.num_dense + len(self.sparse_arch.feature_names)
        """``m = N + F``: the fields of :meth:`forward`'s output."""

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        fields = self.sparse_arch.fields(self.sparse_arch(sparse))
        return fields if self.dense_fields is None else torch.cat([self.dense_fields(dense), fields], dim=1)
