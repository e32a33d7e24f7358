"""Precision policy: which dtype the dense forward runs in.

``fp32`` runs everything in float32. ``bf16`` runs the dense arches under ``torch.autocast`` in
bfloat16 (on CPU too, where recent x86 cores have native bf16 matmul; measured ~1.2× on DeepFM);
parameters, optimizer state, the embedding tables and the loss stay in float32, so no gradient
scaling is needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from recsys_runner.errors import require

_DTYPES = {"fp32": None, "bf16": torch.bfloat16}


@dataclass(kw_only=True)
class PrecisionConfig:
    """Schema of ``conf/precision/*.yaml``."""

    _target_: str = "recsys_runner.precision.Precision"
    dtype: str = "fp32"
    """Dense compute dtype: ``fp32`` or ``bf16``."""

    def __post_init__(self) -> None:
        require(self.dtype in _DTYPES, f"precision.dtype={self.dtype!r} is not one of {sorted(_DTYPES)}; choose precision=fp32 or precision=bf16")


class Precision:
    """Turns the configured dtype into an autocast context for a device type."""

    def __init__(self, dtype: str = "fp32") -> None:
        self.dtype = dtype

    def autocast(self, device: torch.device) -> torch.autocast | None:
        """The autocast to run the dense forward under, or ``None`` for float32."""
        fast = _DTYPES[self.dtype]
        return None if fast is None else torch.autocast(device_type=device.type, dtype=fast)
