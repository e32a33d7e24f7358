"""``python -m recsys_runner.tracking replay <file>``: send metrics a run could not deliver to its MLflow run."""

from __future__ import annotations

import argparse

from recsys_runner.tracking.tracker import replay


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m recsys_runner.tracking", description="Tracking utilities.")
    sub = parser.add_subparsers(dest="command", required=True)
    rep = sub.add_parser("replay", help="send metrics a run could not deliver (mlflow_unsent_<run id>.json)")
    rep.add_argument("file")
    rep.add_argument("--uri", default=None, help="tracking URI (default: the one the run used)")
    args = parser.parse_args(argv)
    run_id = replay(args.file, args.uri)
    print(f"replayed {args.file} into run {run_id}")


if __name__ == "__main__":
    main()
