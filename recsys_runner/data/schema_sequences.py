"""The ``data.sequences`` groups of a schema: read from their config and file form, written back, checked against the columns.

A group (group name → ``{features, max_len, truncate, timestamps}``, :data:`SEQUENCE_KEYS`) names list columns of
``data.sparse`` that describe one user's events; :func:`sequence_groups` reads the mapping of a data config, a schema
file or a stored encoder into :class:`~recsys_runner.features.SequenceGroup` objects, :func:`sequences_mapping` writes
them back, and :func:`check_group` checks a group against the columns: its features are sparse columns, its timestamps
none, and a history shares its candidate's id space.

A room of its own beside :mod:`recsys_runner.data.schema`: a group is not a column kind but a grammar over the sparse
columns (its keys, its raw form parsed and written back) and a check across them (a history and its candidate share an
id space). The schema files, the stored encoders and the file data's config read and write that form; the
:class:`~recsys_runner.data.schema.Schema` only checks its groups as it is made, so this module sits below the schema
(not in :mod:`recsys_runner.data.sequences`, the histories of file data, above the encoders) and names
:class:`~recsys_runner.data.schema.SparseColumn` for the type checker only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from recsys_runner.errors import require
from recsys_runner.features import SequenceGroup

if TYPE_CHECKING:  # the schema checks its groups here as it is made: its column kind is named for the type checker only
    from recsys_runner.data.schema import SparseColumn


SEQUENCE_KEYS = ("features", "max_len", "truncate", "timestamps")
"""The keys of one ``data.sequences`` group."""


def sequence_groups(raw: Any, key: str = "data.sequences") -> list[SequenceGroup]:
    """``data.sequences`` (group name → ``{features, max_len, truncate, timestamps}``) as :class:`SequenceGroup` objects.

    Raises:
        ConfigError: not a mapping of mappings, an unknown key, a missing ``features`` / ``max_len``, naming ``key``.
    """
    if raw is None:
        return []
    example = "{hist: {features: [hist_item_id, hist_category], max_len: 50, timestamps: hist_ts}}"
    require(isinstance(raw, dict), f"{key}={raw!r} must be a mapping of group names to groups, e.g. {key}='{example}'")
    groups = []
    for name, group in raw.items():
        where = f"{key}.{name}"
        require(isinstance(group, dict), f"{where}={group!r} must be a mapping with {', '.join(SEQUENCE_KEYS)}, e.g. {key}='{example}'")
        unknown = sorted(set(group) - set(SEQUENCE_KEYS))
        require(not unknown, f"{where} has unknown key(s) {unknown}; a sequence group has {', '.join(SEQUENCE_KEYS)}")
        features = group.get("features")
        require(isinstance(features, list | tuple) and all(isinstance(f, str) for f in features),
                f"{where}.features={features!r} must be a list of column names, e.g. [hist_item_id, hist_category]")
        max_len = group.get("max_len")
        require(isinstance(max_len, int) and not isinstance(max_len, bool),
                f"{where}.max_len={max_len!r} must be a positive integer: the longest history a row keeps, e.g. 50")
        timestamps = group.get("timestamps")
        require(timestamps is None or isinstance(timestamps, str), f"{where}.timestamps={timestamps!r} must be a column name or null")
        groups.append(SequenceGroup(str(name), tuple(features), max_len, group.get("truncate") or "recent", timestamps))
    return groups


def sequences_mapping(groups: list[SequenceGroup]) -> dict[str, dict[str, Any]]:
    """:func:`sequence_groups`' inverse: the form of a schema file and of the stored schema."""
    return {g.name: {"features": list(g.features), "max_len": g.max_len, "truncate": g.truncate, "timestamps": g.timestamps}
            for g in groups}


def check_group(group: SequenceGroup, sparse: list[SparseColumn], other_columns: list[str], id_space: bool = True) -> None:
    """A sequence group against the columns: every feature a ``data.sparse`` column, the timestamps column none of
    them, and each history sharing its table's id space (same encoding, size, ``hex``) with the features on it.

    Raises:
        ConfigError: naming the key and the fix.
    """
    key = f"data.sequences.{group.name}"
    by_name = {c.name: c for c in sparse}
    for f in group.features:
        require(f in by_name, f"{key}.features names {f!r}, which is not a data.sparse column (the columns: "
                f"{[c.name for c in sparse]}). Fix: add it to data.sparse, e.g. {{name: {f}, table: item}} next to the candidate "
                f"{{name: item_id, table: item}}")
    ts = group.timestamps
    if ts is not None:
        require(ts not in by_name, f"{key}.timestamps={ts!r} is also a data.sparse column; event times ride in the batch "
                f"as they are and are never embedded. Fix: remove {ts!r} from data.sparse")
        require(ts not in other_columns, f"{key}.timestamps={ts!r} is also a label or dense column. Fix: name the event-time "
                f"list column in {key}.timestamps and nothing else")
    for f in group.features if id_space else ():  # unsized columns (a config before sizing) are sized together later
        col = by_name[f]
        for other in sparse:
            if other is col or other.table_name != col.table_name:
                continue
            mine, theirs = (col.encoding, col.num_embeddings, col.hex), (other.encoding, other.num_embeddings, other.hex)
            require(mine == theirs, f"data.sparse[{f}] (history of {key}) and data.sparse[{other.name}] share table "
                    f"{col.table_name!r} but not one id space: encoding/num_embeddings/hex {mine} vs {theirs}. A history and its "
                    f"candidate must encode ids alike. Fix: give both the same encoding, num_embeddings and hex (or leave "
                    f"num_embeddings out of both: they are then sized together, one vocabulary from both columns)")
