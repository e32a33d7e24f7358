"""Makes conf/ importable as the package ``recsys_runner.conf`` inside a wheel, for Hydra's pkg:// lookup."""
