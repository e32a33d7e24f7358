"""xDeepFM (Lian et al., 2018, "xDeepFM: Combining Explicit and Implicit Feature Interactions for Recommender Systems", https://arxiv.org/abs/1803.05170) on TorchRec.

Shape legend: ``B`` batch size, ``N`` dense features, ``F`` sparse features, ``m = N + F`` fields, ``D`` embedding
dim, ``H_k`` feature maps of CIN layer ``k``.

Every input is a field of width ``D`` (:class:`~recsys_runner.models.common.FieldArch`: a dense feature's field is
its value times a learned vector), ``X⁰ [B, m, D]``. As in the paper's output unit, the logit sums three parts:

* linear: one weight per sparse id and per dense feature, plus the bias
  (:class:`~recsys_runner.models.common.LinearArch`, as in ``fm``);
* CIN, the compressed interaction network (eq. 6): each layer crosses the previous layer's feature maps with the
  fields, vector-wise, ``X^k_{h,*} = Σ_{i,j} W^{k,h}_{ij} (X^{k-1}_{i,*} ∘ X⁰_{j,*})``, so layer ``k`` holds
  interactions of degree ``k + 1``; each map is sum-pooled over ``D`` and all layers' pooled maps go to one output
  unit. No activation (the identity, as the authors' code uses); by default each layer but the last sends half its
  maps to the output and half on (the authors' code's ``split_half``);
* DNN: an MLP over the flattened fields, ``[B, m·D]``, ending in one unit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_runner.errors import ConfigError
from recsys_runner.features import FeatureSpec, check_embedding_dim
from recsys_runner.models.common import MLP, FieldArch, LinearArch, ModelConfig, check_layer_sizes


@dataclass(kw_only=True)
class XDeepFMConfig(ModelConfig):
    """Schema of ``conf/model/xdeepfm.yaml``. Defaults: the paper's Criteo setting (its implementation details: 200
    feature maps per CIN layer on Criteo, 400 units per DNN layer, fields 10 wide, here 12, fbgemm's multiple of 4; 3 CIN
    layers, beyond which its study of depth finds quality falls; 2 DNN layers)."""

    _target_: str = "recsys_runner.models.xdeepfm.XDeepFM"
    embedding_dim: int = 12
    """Width ``D`` of every field: each embedding table and each dense feature's vector; a per-feature
    ``embedding_dim`` in ``data.sparse`` must equal it."""
    cin_layer_sizes: list[int] = field(default_factory=lambda: [200, 200, 200])
    """Feature maps ``H_k`` of each CIN layer; ``L`` layers build interactions up to degree ``L + 1``."""
    cin_split_half: bool = True
    """Each CIN layer but the last sends half its maps to the output and half on to the next layer (the authors' code
    does this by default; it halves the cost of every layer after the first); ``false``: all maps go both ways, as the
    paper's eq. 6 is written."""
    deep_layer_sizes: list[int] = field(default_factory=lambda: [400, 400])
    """Hidden layers of the DNN over the flattened fields (a final 1-unit layer is added)."""

    def __post_init__(self) -> None:
        check_embedding_dim("model.embedding_dim", self.embedding_dim)
        check_layer_sizes("cin_layer_sizes", self.cin_layer_sizes)
        odd = [s for s in self.cin_layer_sizes[:-1] if s % 2]
        if self.cin_split_half and odd:
            even = [s + s % 2 for s in self.cin_layer_sizes[:-1]] + self.cin_layer_sizes[-1:]
            raise ConfigError(
                f"model.cin_layer_sizes={self.cin_layer_sizes} has odd sizes {odd} before its last layer, but with "
                f"model.cin_split_half=true each of those layers sends half its maps to the output and half to the next "
                f"layer. Fix: even sizes, e.g. model.cin_layer_sizes=[{','.join(map(str, even))}], or model.cin_split_half=false")
        check_layer_sizes("deep_layer_sizes", self.deep_layer_sizes)


class CINLayer(nn.Module):
    """One CIN layer, ``D`` first: ``x0 [B, D, m], x [B, D, H_in] → [B, D, H_out]``,
    ``out[b, d, h] = Σ_{i,j} W[h, i, j] · x[b, d, i] · x0[b, d, j]`` (the paper's eq. 6, no bias, no activation).

    Computed as the ``[B, D, H_in·m]`` Hadamard products of every (map, field) pair, compressed by one matrix
    ``[H_out, H_in·m]`` (the paper's Figure 4: a 1×1 convolution along ``D``; with ``D`` first it is one GEMM).

    Args:
        num_fields: ``m``.
        in_maps: ``H_in`` (``m`` for the first layer, whose ``x`` is ``x0``).
        out_maps: ``H_out``.
        device: device of the weight.

    Example::

        >>> import torch
        >>> from recsys_runner.models.xdeepfm import CINLayer
        >>> layer = CINLayer(num_fields=4, in_maps=4, out_maps=3)
        >>> x0 = torch.randn(2, 8, 4)   # [B, D, m]
        >>> layer(x0, x0).shape   # the first layer: x is x0 → [B, D, H_out]
        torch.Size([2, 8, 3])
    """

    def __init__(self, num_fields: int, in_maps: int, out_maps: int, device: torch.device | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_maps, in_maps, num_fields, device=device))
        """``W [H_out, H_in, m]``."""
        bound = 1.0 / math.sqrt(in_maps * num_fields)  # a 1x1 convolution's default bound (fan-in H_in·m)
        nn.init.uniform_(self.weight, -bound, bound)

    def forward(self, x0: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        pairs = (x.unsqueeze(3) * x0.unsqueeze(2)).flatten(2, 3)  # [B, D, H_in·m], pair (i, j) at i·m + j
        return pairs @ self.weight.flatten(1).t()


class CIN(nn.Module):
    """Compressed interaction network: ``x0 [B, m, D] → [B, output_dim]``, each layer's output maps sum-pooled over ``D``
    and concatenated (the paper's ``p⁺``).

    With ``split_half`` (as the authors' code does by default), every layer but the last sends half of its maps to the
    output and the other half on to the next layer, which halves the next layer's cost.

    Args:
        num_fields: ``m``.
        layer_sizes: ``H_k`` of each layer (even before the last with ``split_half``).
        split_half: split each layer's maps between the output and the next layer.
        device: device of the weights.

    Example::

        >>> import torch
        >>> from recsys_runner.models.xdeepfm import CIN
        >>> cin = CIN(num_fields=4, layer_sizes=[16, 16])
        >>> cin(torch.randn(2, 4, 8)).shape, cin.output_dim   # half the first layer's 16 maps, then all of the last's
        (torch.Size([2, 24]), 24)
    """

    def __init__(self, num_fields: int, layer_sizes: list[int], split_half: bool = True, device: torch.device | None = None) -> None:
        super().__init__()
        last = len(layer_sizes) - 1
        self.kept = [size // 2 if split_half and k < last else size for k, size in enumerate(layer_sizes)]
        """Maps of layer ``k`` that go on to layer ``k + 1`` (the first ones)."""
        inputs = [num_fields, *self.kept[:-1]]
        self.layers = nn.ModuleList(CINLayer(num_fields, a, b, device) for a, b in zip(inputs, layer_sizes, strict=True))
        self.pooled = [size - kept if split_half and k < last else size
                       for k, (size, kept) in enumerate(zip(layer_sizes, self.kept, strict=True))]
        """Maps of layer ``k`` that are pooled into the output (the last ones)."""
        self.output_dim = sum(self.pooled)
        """Width of :meth:`forward`'s output."""

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        x0 = x0.transpose(1, 2)  # [B, D, m]
        x, pooled = x0, []
        for layer, kept, out in zip(self.layers, self.kept, self.pooled, strict=True):
            maps = layer(x0, x)
            pooled.append(maps[..., maps.shape[2] - out:].sum(dim=1))
            x = maps[..., :kept]
        return torch.cat(pooled, dim=1)


class XDeepFM(nn.Module):
    """xDeepFM: linear + CIN + DNN over shared fields; ``(dense [B, N], sparse KJT) → logits [B]``.

    Args:
        config: its hyperparameters (:class:`XDeepFMConfig`: ``embedding_dim`` ``D``, the CIN's feature maps per layer,
            the DNN's hidden sizes).
        features: the data's feature schema (from the runner).
        dense_device: device of the dense parameters (tables start on ``meta``).

    Example::

        >>> from recsys_runner.configurable import make
        >>> from recsys_runner.data.generated.synthetic_config import SyntheticDataConfig
        >>> from recsys_runner.models.common import materialize
        >>> from recsys_runner.models.xdeepfm import XDeepFM, XDeepFMConfig
        >>> data = make(SyntheticDataConfig, batch_size=8, num_dense=3, num_sparse=4, num_embeddings=50).build()
        >>> batch = next(iter(data.train_batches(epoch=0, rank=0, world_size=1)))
        >>> config = XDeepFMConfig(embedding_dim=8, cin_layer_sizes=[16, 16], deep_layer_sizes=[32])
        >>> model = materialize(XDeepFM(config, features=data.features))
        >>> model(batch.dense_features, batch.sparse_features).shape
        torch.Size([8])
    """

    same_embedding_width: ClassVar[str | None] = (
        "its CIN takes Hadamard products between every pair of fields (each dense feature's vector and each embedding)"
    )
    """Why every table must have one width (see :class:`~recsys_runner.models.common.SparseArch`)."""

    def __init__(self, config: XDeepFMConfig, *, features: FeatureSpec, dense_device: torch.device | None = None) -> None:
        super().__init__()
        self.fields = FieldArch(features, config.embedding_dim, type(self), device=dense_device)
        num_fields = self.fields.num_fields
        self.linear = LinearArch(features, prefix="linear_", device=dense_device, zero_init=True)
        self.cin = CIN(num_fields, list(config.cin_layer_sizes), config.cin_split_half, device=dense_device)
        self.cin_out = nn.Linear(self.cin.output_dim, 1, bias=False, device=dense_device)
        self.deep = nn.Sequential(
            MLP(num_fields * config.embedding_dim, list(config.deep_layer_sizes), device=dense_device),
            nn.Linear(config.deep_layer_sizes[-1], 1, device=dense_device),  # its bias is the model's bias
        )

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        x0 = self.fields(dense, sparse)
        cin = self.cin_out(self.cin(x0)).squeeze(1)
        deep = self.deep(x0.flatten(1)).squeeze(1)
        return self.linear(dense, sparse) + cin + deep
