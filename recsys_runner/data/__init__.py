"""Data modules: each turns a ``data`` config into per-rank iterables of TorchRec ``Batch``es.

Every data module implements :class:`DataModule`; the runner only uses that protocol.
"""

from recsys_runner.data.base import DataConfig, DataModule
from recsys_runner.data.synthetic import SyntheticData, SyntheticDataConfig

__all__ = ["DataConfig", "DataModule", "SyntheticData", "SyntheticDataConfig"]
