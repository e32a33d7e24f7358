"""recsys_runner: Hydra-composed experiment runner for TorchRec recommender training."""

__version__ = "0.1.0"
