"""``python -m recsys_runner.data convert|inspect|sequences``: text → Parquet conversion, a data summary, and an interaction log → rows with histories.

``convert`` reads CSV/TSV/Criteo files with a schema, encodes them exactly as training would
(fills, transforms, hashing, hex parsing, id checks) and writes Parquet files of model-ready columns
(binary labels int8, regression labels float32, dense float32, sparse int64 or list<int64>) with the
schema (the label column or the task → label column mapping included) stored in the file, so
``data=parquet data.path=<out>`` needs no column list::

    python -m recsys_runner.data convert --format criteo --num-embeddings 1000000 day_0.tsv out/
    python -m recsys_runner.data convert --format csv --schema schema.yaml logs/*.csv out/
    python -m recsys_runner.data convert --format csv ratings.csv out/ --label rating --label-threshold 4   # schema inferred
    python -m recsys_runner.data convert --format criteo_npy /data/criteo_1tb_npy/ out/   # TorchRec's .npy days: day_<i>.parquet

``inspect`` prints a file's (or directory's) columns and types, row count, the rate (mean) of each
label column, per column the null count and the number of distinct values, and per list (multi-hot) column the longest
list and the 99th percentile of the lengths, to choose ``max_values`` by. Text files are counted as training reads them:
every field as text (``007`` and ``7`` two ids), a dense column's or label's numbers as numbers, a multi-hot field's ids
(the columns' roles inferred as ``data=csv`` infers them). Label columns: the
``--label`` options, else those of the schema stored by ``convert``, else ``label``::

    python -m recsys_runner.data inspect out/ [--format parquet|csv|criteo|criteo_npy] [--label click --label conversion]

``--format criteo_npy`` reads TorchRec's Criteo days as ``data=criteo_npy`` does; ``inspect`` adds the rows of each day and
the range of the ids (with the table sizes that give each its own row where they are contiguous).

``sequences`` turns an interaction log (user, item, time, optional label or rating, item side columns) into rows
whose histories hold each user's earlier events only (:mod:`recsys_runner.data.sequences.interactions`), one per event or
one per user (``--rows``), split by time, leave-last-out or leave-two-out, with the schema stored and the id mapping
written beside them (``--vocab``: an earlier one); a CSV log whose id columns the type inference would merge (``007`` and
``7``) is refused (``--ids-as-text`` reads them as text); exact duplicate events are dropped and counted (``--duplicates``), and
a used output folder is refused unless ``--overwrite`` (:mod:`recsys_runner.data.sequences.output`)::

    python -m recsys_runner.data sequences events.csv out/ --user user --item item --time ts --side category \
        --max-len 50 --split time --eval-from 1700000000

``sequences`` ends like the project's other commands on SIGTERM, SIGINT or SIGUSR1: the signal stops it where it is
(:class:`~recsys_runner.train.signals.RaiseOnSignal`), the staged files are deleted, one line says that nothing was kept
and the command that redoes it, and the exit status is ``128 + signal``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import shlex
import sys
from collections.abc import Iterator
from typing import Any

from recsys_runner.data.convert import convert, convert_parser
from recsys_runner.data.files.tabular_config import (
    text_delimiter,
)
from recsys_runner.data.inspect import inspect
from recsys_runner.data.sequences.coverage import vocab_line
from recsys_runner.data.sequences.events import DUPLICATES, LogSpec
from recsys_runner.data.sequences.interactions import convert_log
from recsys_runner.data.sequences.mapping import EarlierVocab
from recsys_runner.data.sequences.output import OUTPUT_FILES
from recsys_runner.data.sequences.splits import LEAVE_TWO_OUT_MIN_EVENTS, ROWS, SPLITS, part_names
from recsys_runner.errors import ConfigError, DataError
from recsys_runner.noise import quiet_known_noise
from recsys_runner.train import signals  # the one import up the layers (pyproject.toml, docs/architecture.md)


def sequences(args: argparse.Namespace) -> None:
    """``sequences``: the log → ``<output>/<part>.parquet`` for each part of the split and the id mapping (:mod:`recsys_runner.data.sequences.interactions`),
    under the signal guard every command has (module docstring); a signal that comes while the finished output is moved
    into place waits for it (``signals.deferred``) and then stops the command saying the output is complete."""
    spec = LogSpec(user=args.user, item=args.item, time=args.time, label=args.label, label_threshold=args.label_threshold,
                   sides=list(args.side), max_len=args.max_len, split=args.split, eval_from=args.eval_from, valid_from=args.valid_from,
                   rows=args.rows, duplicates=args.duplicates, vocab=args.vocab, oov_buckets=args.oov_buckets or 1,
                   ids_as_text=args.ids_as_text, column_names=args.column_names.split(",") if args.column_names else None)
    if args.vocab is not None and args.oov_buckets is not None:
        raise ConfigError(f"--oov-buckets {args.oov_buckets} with --vocab: the tables keep the earlier output's sizes (its ids and its "
                          f"OOV rows), so a model trained on it reads the new rows. Fix: drop --oov-buckets")
    delimiter = text_delimiter(args.delimiter, "--delimiter ", "--delimiter ,")
    out = args.output.rstrip("/")
    with signals.RaiseOnSignal("during sequences") as guard:
        rows = convert_log(args.log, args.output, spec, args.format, delimiter, args.row_group_rows, overwrite=args.overwrite,
                           committing=signals.deferred)
        late = guard.signum
    copies = rows.num_duplicates
    said = f"{copies} of them exact duplicates of an earlier event ({'dropped' if spec.duplicates == 'drop' else 'kept'}, " if copies \
        else "no exact duplicates ("
    print(f"read {rows.num_events} events from {args.log}; {said}--duplicates {spec.duplicates})")
    if rows.num_short_users:
        print(f"{rows.num_short_users} user(s) have fewer than {LEAVE_TWO_OUT_MIN_EVENTS} events: --split leave-two-out gives them no valid "
              f"or test row (all their events are training rows)")
    for part, count in rows.cold_rows.items():
        if count:
            print(f"{count} of the {rows.parts[part].num_rows} {part} rows are of users without a training row (a user's single event "
                  f"under --split leave-last-out, or all of a user's events held out): the model never trained on these users, "
                  f"and their histories hold no training event")
    for table, count in rows.unseen.items():
        print(f"--vocab {args.vocab}: {count} {table} id(s) of this log are not in its mapping (each reads an OOV row)")
    if args.vocab is not None and args.ids_as_text is None and EarlierVocab.load(args.vocab).ids_as_text:
        print(f"--vocab {args.vocab}: its mapping read the id columns as text (--ids-as-text), and so did this run")
    if args.vocab is not None:
        for part, coverage in rows.coverage.items():
            print(vocab_line(args.vocab, part, coverage))
    names = part_names(spec.split, spec.valid_from)
    written = ", ".join(f"{rows.parts[n].num_rows} {'training' if n == 'train' else n} rows to {out}/{n}.parquet" for n in names)
    per = "one per user: its whole sequence, up to" if spec.rows == "per-user" else "histories: up to"
    print(f"wrote {written} ({spec.rows} rows, {per} {spec.max_len} earlier events per row) and the id mapping to {out}/vocab.json")
    model = "sasrec" if spec.rows == "per-user" else "din"
    held = "valid" if "valid" in names else "eval"
    print(f"train with: python -m recsys_runner model={model} data=parquet data.path={out}/train.parquet data.eval_path={out}/{held}.parquet")
    if late is not None:  # it came while the output was moved into place, which finished first
        raise signals.Interrupted(late, None, None, when="as sequences ended", finished=True)


def interrupted_message(e: signals.Interrupted, output: str, argv: list[str]) -> str:
    """What a signal left (the one line of ``lifecycle.interrupted_message``, for a command without an MLflow run)."""
    if e.finished:
        return f"Interrupted: {e}; the output in {output} was complete and is kept, nothing to redo."
    command = shlex.join(["python", "-m", "recsys_runner.data", *argv])
    return f"Interrupted: {e}; nothing was kept ({output} is as it was before); redo it with: {command}"


def _sequences_parser(sub: Any) -> None:
    s = sub.add_parser("sequences", help="an interaction log -> rows with user histories (train.parquet, eval.parquet or valid/test) "
                                         "and the id mapping (vocab.json, vocab/)")
    s.add_argument("log", help="the log: a Parquet or CSV/TSV file (or a directory or glob of them)")
    s.add_argument("output", help="output directory (train.parquet, eval.parquet or valid.parquet and test.parquet, vocab.json, vocab/)")
    s.add_argument("--user", default="user", help="the user column")
    s.add_argument("--item", default="item", help="the item column")
    s.add_argument("--time", default="timestamp", help="the event time column (integers, e.g. Unix seconds, or dates/timestamps of any unit: "
                                                        "Unix seconds, a fraction floored)")
    s.add_argument("--label", help="a 0/1 label column, or a rating with --label-threshold (default: every event is a positive)")
    s.add_argument("--label-threshold", type=float, help="label = (--label column >= this), e.g. a rating of 4")
    s.add_argument("--side", action="append", default=[], help="an item side column such as category (repeatable): "
                                                               "a candidate feature and its history hist_<side>")
    s.add_argument("--max-len", type=int, default=50, help="the longest history kept (the most recent events)")
    s.add_argument("--rows", choices=list(ROWS), default="per-event",
                   help="per-event: a row per event (every model); per-user: a row per user holding its whole sequence, its last "
                        "event the candidate (next-item models: sasrec, hstu)")
    s.add_argument("--split", choices=list(SPLITS), default="leave-last-out",
                   help="time: events at or after --eval-from are eval rows (with --valid-from: valid, then test); leave-last-out: "
                        "each user's last event is; leave-two-out: the last is test, the one before valid")
    s.add_argument("--eval-from", type=int, help="--split time: the first eval (test) time, in the time column's units")
    s.add_argument("--valid-from", type=int, help="--split time: the first valid time (before --eval-from): train, valid, test files")
    s.add_argument("--vocab", help="an earlier output folder: encode this log with its id mapping (unseen ids read OOV rows, counted)")
    s.add_argument("--oov-buckets", type=int, help="rows after each table's ids for ids a later --vocab run has not seen (default 1; "
                                                   "with --vocab the earlier output's)")
    s.add_argument("--ids-as-text", action=argparse.BooleanOptionalAction, default=None,
                   help="read the id columns (--user, --item, --side) as text: '007' and '7' two ids (a Parquet integer column as its "
                        "decimal text). Default: as inferred, refused where that would merge ids; with --vocab: as its mapping was read")
    s.add_argument("--format", choices=["auto", "parquet", "csv"], default="auto", help="auto: Parquet by file name, else text")
    s.add_argument("--delimiter", default=",", help="text logs: the field delimiter (a character, or tab/comma/semicolon/pipe)")
    s.add_argument("--column-names", help="a text log without a header line (MovieLens' u.data): its columns' names in file order, "
                                          "comma-separated, e.g. user,item,rating,timestamp; every line is then an event")
    s.add_argument("--row-group-rows", type=int, default=65_536)
    s.add_argument("--duplicates", choices=list(DUPLICATES), default="drop",
                   help="events equal in every column read (user, item, time, label, sides): drop all but the first, keep them "
                        "(leave-last-out then holds out a user's last event with its copies), or fail naming the first")
    s.add_argument("--overwrite", action="store_true",
                   help=f"replace an earlier output in the output folder as a whole (else a folder that holds anything is refused; "
                        f"one holding other files than {', '.join(OUTPUT_FILES)} and vocab/ is refused even so)")


@contextlib.contextmanager
def notes_shown() -> Iterator[None]:
    """The notes the data modules log at INFO while a command runs, printed as ``INFO <note>`` on stderr: which files of a
    folder are read and which not (its subdirectories, a README), empty part files skipped. Training shows them through
    Hydra's logging; here Python's default level (WARNING) dropped them, so ``inspect`` of a folder counted its top
    files alone without a word about the subdirectory beside them. Restored afterwards: tests call :func:`main` in
    process."""
    logger = logging.getLogger("recsys_runner")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    saved = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # the root handler a library installs would print each note a second time
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recsys_runner.data", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    convert_parser(sub)
    i = sub.add_parser("inspect", help="columns, row count, label rate, nulls, cardinality")
    i.add_argument("path", help="a file, directory or glob")
    i.add_argument("--format", choices=["parquet", "csv", "criteo", "criteo_npy"], default="parquet",
                   help="criteo_npy: TorchRec's preprocessed Criteo days (day_<i>_{dense,sparse,labels}.npy), as data=criteo_npy reads them")
    i.add_argument("--delimiter", default=",")
    i.add_argument("--label", action="append", help="a label column (repeat for several); default: the stored schema's, else 'label'")
    i.add_argument("--max-distinct", type=int, default=1_000_000, help="stop counting distinct values above this")
    _sequences_parser(sub)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    quiet_known_noise()
    try:
        with notes_shown():
            {"convert": convert, "inspect": inspect, "sequences": sequences}[args.command](args)
    except (DataError, ConfigError) as e:
        print(f"{e.label}: {e}", file=sys.stderr)
        return 2
    except signals.Interrupted as e:  # only sequences holds the signals (its output is staged); 128 + signal, as every command
        print(interrupted_message(e, args.output, argv), file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
