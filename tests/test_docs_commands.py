"""Every training command README.md and docs/*.md show is one a newcomer can paste: it parses in the shell and in
Hydra's override grammar, and (unless it elides part with ``…``) composes and validates as the CLI would.

Commands are the ``python -m recsys_runner …`` and ``torchrun … -m recsys_runner …`` lines of the ``bash`` blocks (a
trailing backslash joins the next line) and the inline ones in backticks. A multirun's comma lists are cut to their
first value (one job of the sweep); commands with a ``<placeholder>`` or another config dir are left out. What the
commands do when run is the business of the tests of each feature; this catches a doc that drifted from the config:
a renamed key, an override the shell splits (an unquoted ``{a: b}``), a value Hydra cannot parse (a newline inside
quotes).

The ``| key | default | … |`` tables are checked against the config the same way: each key is one of the node it
documents, a default stated as a value (``16``, ``[64, null]``, ``null``; not one described in words) is the dataclass's,
and a model's table in models.md lists every key of its config. So are the other lists a config or registry is the
truth of: every ``key=value`` in the prose names a key that exists; README.md's table of groups names every option of
``conf/`` and only those; docs/metrics.md's tables name every registered metric and every module of the package; the
schema reference of docs/data.md names every key of the file options, and docs/metrics.md gives each metric its class's
direction. What the prose points at exists: every other doc it names, every file of the repository and every test.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import itertools
import re
import shlex
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, ListConfig, OmegaConf

from recsys_runner.config import register_configs, validate
from recsys_runner.data.collision import SyntheticCollisionConfig
from recsys_runner.data.schema import SparseColumn
from recsys_runner.export import register as register_export_schema
from recsys_runner.metrics.registry import METRICS, NAME_PATTERNS
from recsys_runner.paths import CONFIG_PATH
from recsys_runner.task_specs import TaskSpec
from tests.conftest import REPO

CONFIG_DIR = Path(CONFIG_PATH)

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
ELIDED = ("…", "...")
# docs/lifecycle.md sets DATA once and uses $DATA in the commands after it
SHELL_VARIABLES = {"$DATA": "data=parquet data.path=data/day_0.parquet"}
# commands for a GPU machine that leave the device to distributed.device=auto (CUDA there): checked as on CUDA
ON_A_GPU = {"launch.md:19"}
ENTRY = re.compile(r"(?:python -m|torchrun\b.*?-m) recsys_runner(?=\s|$)(.*)")


def _commands(path: Path) -> list[tuple[str, str]]:
    """``(where, command)`` for each training command of ``path``: ``where`` is ``file:line``."""
    found: list[tuple[str, str]] = []
    lines = path.read_text().split("\n")
    block: str | None = None
    i = 0
    while i < len(lines):
        line, start = lines[i], i + 1
        if line.startswith("```"):
            block = None if block is not None else line[3:].strip()
        elif block == "bash":
            while line.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line.rstrip()[:-1] + " " + lines[i].strip()
            found.append((f"{path.name}:{start}", line))
        elif block is None:
            found += [(f"{path.name}:{start}", m.group(1)) for m in re.finditer(r"`([^`]*recsys_runner[^`]*)`", line)]
        i += 1
    return [(where, text) for where, text in found if ENTRY.search(text)]


def _cases() -> list[tuple[str, str]]:
    cases = []
    for path in DOCS:
        for where, text in _commands(path):
            rest = ENTRY.search(text)
            assert rest is not None
            arguments = re.split(r"\s#", rest.group(1))[0]  # a shell comment ends the command
            if re.search(r"<|(^|\s)\[|--config-dir|--help", arguments):  # a placeholder, a usage form, another config dir
                continue
            cases.append((where, arguments))
    return cases


CASES = _cases()


def test_the_docs_show_training_commands() -> None:
    assert len(CASES) > 80, "the extraction found too few commands: did the docs' layout change?"


@pytest.fixture(scope="module")
def hydra_initialized() -> Iterator[None]:
    """Hydra initialized once for the module's hundred compositions (initializing costs as much as composing)."""
    register_configs()
    with initialize_config_dir(config_dir=CONFIG_PATH, version_base="1.3"):
        yield


@functools.cache
def _composed(config_name: str, overrides: tuple[str, ...] = ()) -> DictConfig:
    """``conf/<config_name>.yaml`` composed with ``overrides``, once for the module (a composition costs ~0.3 s, and the
    tests below compose the same ones: ``config``, each ``model=``, ``data=``): read, never changed (``validate`` copies)."""
    return compose(config_name=config_name, overrides=list(overrides))


@pytest.mark.parametrize(("where", "arguments"), CASES, ids=[where for where, _ in CASES])
def test_a_documented_command_composes(hydra_initialized: None, where: str, arguments: str) -> None:
    for variable, value in SHELL_VARIABLES.items():
        arguments = arguments.replace(variable, value)
    try:
        words = shlex.split(arguments)
    except ValueError as e:
        pytest.fail(f"{where}: the shell cannot split {arguments!r}: {e}")
    multirun = "-m" in words or "--multirun" in words
    overrides = []
    for word in words:
        if word in ("-m", "--multirun", "--cfg", "job", "hydra", "-p") or any(mark in word for mark in ELIDED):
            continue  # an elided word (`…`, or a list ending in `, …]`) is not meant to be pasted as it is
        key, _, value = word.partition("=")
        if key.startswith(("hydra/launcher", "hydra.launcher", "hydra.sweeper")):
            continue  # the launcher's and sweeper's keys exist only in a multirun's Hydra config
        if multirun and "," in value and not value.startswith(("[", "{", "'", '"')):
            word = f"{key}={value.split(',')[0]}"  # one job of the sweep
        overrides.append(word)
    if where in ON_A_GPU:
        overrides.append("distributed.device=cuda")
    cfg = _composed("config", tuple(overrides))
    # an elided command may lack a required key (data.path); --cfg job prints the config without validating it
    if not any(mark in arguments for mark in ELIDED) and "--cfg" not in words:
        validate(cfg)


# --------------------------------------------------------------------------------------------
# `| key | default | … |` tables: every key exists, and a default the doc states as a value is the config's.
# --------------------------------------------------------------------------------------------


def _managed_collision() -> DictConfig:
    """A generated table's ``data.managed_collision`` (a mapping in the data config, typed ``Any``): its dataclass's defaults."""
    return OmegaConf.structured(SyntheticCollisionConfig)


# the config node each table documents, by (file, heading): the overrides and config that compose it and its path
# (empty: the root), or a function making it. A `model` heading of models.md (`` `name` — ``) is that model's.
TABLE_SECTIONS: dict[tuple[str, str], tuple[str, list[str], str] | Callable[[], DictConfig]] = {
    ("metrics.md", "Configuration"): ("config", [], "metrics"),
    ("data.md", "Feeding a GPU: workers and pinned memory"): ("config", [], "data"),
    ("data.md", "Managed-collision embeddings"): _managed_collision,
    ("multitask.md", "Declaring tasks"): lambda: OmegaConf.structured(TaskSpec),
    ("export.md", "Config keys"): ("export", [], ""),
    ("storage.md", "What to configure: `storage.*`"): ("config", [], "storage"),
}
# tables that list every key of their node (besides models.md's), so a key the config has and the table lacks is a finding
COMPLETE_TABLES = {("metrics.md", "Configuration"), ("data.md", "Managed-collision embeddings"), ("multitask.md", "Declaring tasks")}
MODEL_HEADING = re.compile(r"`(\w+)` — ")
POWER = re.compile(r"(\d+)\*\*(\d+)(-1)?")  # `2**63-1`
DESCRIBED = object()
"""A default cell that describes the value in words (`the task's name`, `as dssm`) rather than stating it."""

Row = tuple[int, list[str], str]


def _default_tables() -> list[tuple[str, str, list[Row]]]:
    """``(file, heading, rows)`` for each table of the docs whose header starts ``| key | default |``; a row is its line,
    the backticked keys of its first cell and its default cell."""
    found = []
    for path in DOCS:
        lines, heading = path.read_text().split("\n"), ""
        for i, line in enumerate(lines):
            if line.startswith("#"):
                heading = line.lstrip("#").strip()
            if re.match(r"\|\s*key\s*\|\s*default\s*\|", line):
                rows = []
                for j in range(i + 2, len(lines)):
                    if not lines[j].startswith("|"):
                        break
                    cells = [c.strip() for c in lines[j].strip().strip("|").split("|")]
                    rows.append((j + 1, re.findall(r"`([^`]+)`", cells[0]), cells[1]))
                found.append((path.name, heading, rows))
    return found


TABLES = _default_tables()


def _node(name: str, heading: str) -> DictConfig:
    if name == "models.md" and (m := MODEL_HEADING.match(heading)):
        section: tuple[str, list[str], str] | Callable[[], DictConfig] = ("config", [f"model={m.group(1)}"], "model")
    else:
        section = TABLE_SECTIONS[(name, heading)]
    if callable(section):
        return section()
    config_name, overrides, path = section
    if config_name == "export":
        register_export_schema()
    cfg = _composed(config_name, tuple(overrides))
    node = OmegaConf.select(cfg, path) if path else cfg
    assert isinstance(node, DictConfig)
    return node


def _value(cell: str) -> object:
    """The default a cell states: `16`, `[64, null]`, `auto`, `2**63-1`, the first value of `` `null`: the environment's ``;
    :data:`DESCRIBED` for words."""
    text = cell.strip()
    if m := re.fullmatch(r"`([^`]*)`(\s*[:(].*)?", text):  # `null`: what null means
        text = m.group(1)
    text = text.replace("`", "")
    if m := POWER.fullmatch(text):
        return int(m.group(1)) ** int(m.group(2)) - (1 if m.group(3) else 0)
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return DESCRIBED
    return DESCRIBED if isinstance(value, str) and (value == "required" or re.search(r"[\s<]", value)) else value


def _values(names: list[str], cell: str) -> list[object]:
    """One stated default per key of a row: `100`, `128` for two keys, `[ctr, cvr], null, null` for three."""
    if len(names) == 1:
        return [_value(cell)]
    try:
        parts = yaml.safe_load(f"[{cell.replace('`', '')}]")
    except yaml.YAMLError:
        parts = None
    if not isinstance(parts, list) or len(parts) != len(names):
        return [DESCRIBED] * len(names)  # one description for them all (`as dssm`)
    return [DESCRIBED if isinstance(v, str) and re.search(r"[\s<]", v) else v for v in parts]


def test_every_default_table_is_checked() -> None:
    unchecked = [f"{name}: {heading!r}" for name, heading, _ in TABLES
                 if (name, heading) not in TABLE_SECTIONS and not (name == "models.md" and MODEL_HEADING.match(heading))]
    assert not unchecked, f"a new `| key | default |` table: add its config node to TABLE_SECTIONS: {unchecked}"
    assert sum(name == "models.md" for name, _, _ in TABLES) >= 18, "did models.md's headings change?"


@pytest.mark.parametrize(("name", "heading", "rows"), TABLES, ids=[f"{n}:{h.split(' — ')[0]}" for n, h, _ in TABLES])
def test_a_documented_default_is_the_configs(hydra_initialized: None, name: str, heading: str, rows: list[Row]) -> None:
    """Each key of a ``| key | default |`` table is a key of the config node it documents, a default stated as a value
    (not in words) is the dataclass's, and models.md's tables (and :data:`COMPLETE_TABLES`) leave out no key."""
    node = _node(name, heading)
    keys = [str(k) for k in node if not str(k).startswith("_")]
    wrong = []
    for line, names, cell in rows:
        for written, stated in zip(names, _values(names, cell), strict=True):
            # a key as the doc writes it: `embedding_dim`, `logq_*`, or with its node's name (`storage.endpoint_url`)
            key = next((k for k in (written, written.partition(".")[2]) if k and OmegaConf.select(node, k, default=DESCRIBED) is not DESCRIBED), written)
            if "*" in key and not any(fnmatch.fnmatchcase(k, key) for k in keys):
                wrong.append(f"{name}:{line}: `{written}` matches no key here (the keys: {', '.join(keys)})")
            elif "*" not in key and OmegaConf.select(node, key, default=DESCRIBED) is DESCRIBED:
                wrong.append(f"{name}:{line}: `{written}` is no key here (the keys: {', '.join(keys)})")
            elif "*" not in key and stated is not DESCRIBED:
                actual = OmegaConf.select(node, key)
                actual = OmegaConf.to_container(actual) if OmegaConf.is_config(actual) else actual
                if stated != actual:
                    wrong.append(f"{name}:{line}: `{written}` defaults to {actual!r}, the doc says {cell}")
    if name == "models.md" or (name, heading) in COMPLETE_TABLES:
        documented = [key.split(".")[-1] for _, names, _ in rows for key in names]
        missing = [k for k in keys if not any(fnmatch.fnmatchcase(k, d) for d in documented)]
        if missing:
            wrong.append(f"{name}, {heading!r}: keys missing from the table: {missing}")
    assert not wrong, "\n".join(wrong)


# --------------------------------------------------------------------------------------------
# docs/metrics.md's tables against the registry and the package.
# --------------------------------------------------------------------------------------------


def _first_column(heading: str | None, header: str) -> list[str]:
    """The backticked names of the first column of docs/metrics.md's table whose header starts ``header``, under the
    ``## heading`` section (``None``: above the first)."""
    text = (REPO / "docs" / "metrics.md").read_text()
    section = (text if heading is None else text.split(f"\n## {heading}\n", 1)[1]).split("\n## ", 1)[0]
    lines = section.split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = [line for line in itertools.takewhile(lambda line: line.startswith("|"), lines[start + 2:])]
    return [name for row in rows for name in re.findall(r"`([^`]+)`", row.split(" | ")[0])]


def test_the_eval_metric_tables_name_every_registered_metric_and_no_other() -> None:
    documented = _first_column("Eval metrics", "| name | definition |")
    assert sorted(documented) == sorted([*METRICS, *NAME_PATTERNS]), "docs/metrics.md's eval metric table against the registry"
    multiclass = _first_column("Eval metrics", "| name | multi-class definition |")
    assert sorted(multiclass) == sorted(n for n, e in METRICS.items() if "multiclass" in e.also)


def test_the_module_table_lists_every_metrics_module() -> None:
    documented = {name.removeprefix("metrics/") for name in _first_column(None, "| module |")}
    modules = {p.name for p in (REPO / "recsys_runner" / "metrics").glob("*.py")} - {"__init__.py"}
    assert documented == modules, f"docs/metrics.md's module table lacks {sorted(modules - documented)}, lists gone {sorted(documented - modules)}"


def test_the_readme_names_every_option_of_each_group() -> None:
    """README.md's table of config groups: each group's row names every ``conf/<group>/`` option, and each plain name in
    its options column is an option of the group (or of a sub-group: ``optim/sparse``'s ``lamb``)."""
    wrong, checked = [], 0
    for row in (REPO / "README.md").read_text().split("\n"):
        cells = row.strip("|").split(" | ")
        if not (row.startswith("| `") and (m := re.fullmatch(r"`(\w+)`", cells[0].strip()))):
            continue
        group = CONFIG_DIR / m.group(1)
        if not group.is_dir():
            continue  # a row of keys (`metrics (keys)`, `train (keys)`)
        checked += 1
        named = set(re.findall(r"`(\w+)`", cells[1]))
        options = {p.stem for p in group.glob("*.yaml")}
        everywhere = {p.stem for p in group.rglob("*.yaml")}
        if missing := sorted(options - named):
            wrong.append(f"{m.group(1)}: the row leaves out {missing}")
        if strangers := sorted(named - everywhere):
            wrong.append(f"{m.group(1)}: the row names {strangers}, which are no options of conf/{m.group(1)}/")
    assert checked >= 9, "did README.md's table of groups change its layout?"
    assert not wrong, "README.md's table of groups against conf/:\n" + "\n".join(wrong)


def test_the_readme_names_only_keys_that_exist(hydra_initialized: None) -> None:
    """README.md's ``| `train` (keys) |`` rows: each key named in the second column is a key of that section."""
    cfg = _composed("config")
    rows = [row.strip("|").split(" | ") for row in (REPO / "README.md").read_text().split("\n") if re.match(r"\| `\w+` \(keys\) \|", row)]
    assert len(rows) >= 2, "did README.md's table of groups change its layout?"
    wrong = [f"{section}.{key}" for section, keys, *_ in ((re.findall(r"`(\w+)`", r[0])[0], r[1]) for r in rows)
             for key in re.findall(r"`(\w+)`", keys) if key not in cfg[section]]
    assert not wrong, f"README.md names keys the config does not have: {wrong}"


def test_the_schema_reference_names_the_file_options_keys_and_every_column_field(hydra_initialized: None) -> None:
    """docs/data.md's schema reference: each key of its table is one of ``data=parquet`` and ``data=csv``, every key of
    the file options is in the table or the list of reading keys below it, and the ``sparse`` and ``infer`` rows name
    exactly the fields of a sparse column and of ``data.infer``."""
    section = (REPO / "docs" / "data.md").read_text().split("\n## Schema reference\n", 1)[1].split("\n#", 1)[0]
    rows = {re.findall(r"`(\w+)`", r)[0]: r.split(" | ", 1)[1] for r in section.split("\n") if r.startswith("| `")}
    assert len(rows) >= 9, "did the schema reference change its layout?"
    named = set(re.findall(r"`(\w+)`", section))
    for option in ("parquet", "csv", "criteo"):
        data = _composed("config", (f"data={option}",)).data
        assert not (missing := [k for k in data if k not in named and not k.startswith("_")]), \
            f"data={option}'s keys {missing} are in neither the schema reference nor its list of reading keys"
        if option != "criteo":
            assert not (strangers := [k for k in rows if k not in data]), f"data={option} has no keys {strangers}"
            assert sorted(re.findall(r"`(\w+)`", rows["infer"].split("(")[0])) == sorted(data.infer)
    assert sorted(re.findall(r"\b\w+\b", rows["sparse"].split("{")[1].split("}")[0]) + re.findall(r"`(\w+)`", rows["sparse"].split("transforms")[1])) \
        == sorted(f.name for f in dataclasses.fields(SparseColumn))


# --------------------------------------------------------------------------------------------
# Inline overrides in the prose (`model.logq_correction=false`): each names a key that exists.
# --------------------------------------------------------------------------------------------

INLINE_OVERRIDE = re.compile(r"`\+{0,2}([a-z_]+(?:\.[^\s=`]+)+)=[^`]*`")
# keys the docs misspell on purpose, to show the error a typo gets
MISSPELT = {"data.batch_sise", "model.hiden", "model.hidden", "model.embedding_dimm", "train.num_step", "export.dri",
            "train.steps"}  # misspelt, or (train.steps) the example of a renamed key refused naming its new name
ROOTS = {"model", "data", "optim", "scheduler", "distributed", "precision", "checkpoint", "tracking", "train", "metrics",
         "storage", "export", "predict", "load", "seed"}


def _inline_overrides() -> list[tuple[str, str]]:
    """``(file:line, key)`` of each ``key=value`` in backticks outside the code blocks, for keys of the runner's config."""
    found = []
    for path in DOCS:
        block = False
        for i, line in enumerate(path.read_text().split("\n"), 1):
            if line.startswith("```"):
                block = not block
            elif not block:
                found += [(f"{path.name}:{i}", m.group(1)) for m in INLINE_OVERRIDE.finditer(line)
                          if m.group(1).split(".")[0] in ROOTS and m.group(1) not in MISSPELT]
    return found


def _has_key(cfg: DictConfig, key: str) -> bool:
    """Whether ``key`` (``data.sparse[item].max_values``, ``model.task_specs.cvr.kind``) leads through ``cfg``: a name
    under a mapping of the user's (a dict, or a ``null`` option that takes one) or an entry of a list is accepted."""
    node: Any = cfg
    for part in re.split(r"\.(?![^\[]*\])", key):
        name = re.sub(r"\[.*\]$", "", part)
        if node is None or isinstance(node, ListConfig):
            return True
        if not isinstance(node, DictConfig):
            return False
        if name not in node:
            return OmegaConf.get_type(node) in (dict, None)
        node = node[name]
    return True


def test_every_inline_override_names_a_key(hydra_initialized: None) -> None:
    """Each ``group.key=value`` the prose shows is a key of the config under some option of the groups (a model's key
    under that model), or of an entry command's config (``export.*``, ``predict.*``)."""
    import recsys_runner.evaluate
    import recsys_runner.predict  # noqa: F401  (each stores its entry schema)

    register_export_schema()
    configs = [_composed(name) for name in ("config", "export", "predict", "evaluate")]
    # every option of each group: model= and data= alone (the compositions the tests above made), the small groups several
    # in one composition (a group's keys are its option's whatever the other groups choose): the i-th composition of a
    # row takes the i-th option of each of its groups, which can be chosen together (debug's presets choose the
    # checkpoint, optim's choose optim/sparse and /dense). 12 compositions for their 31 options, each ~0.3 s
    for group in ("model", "data"):
        configs += [_composed("config", (f"{group}={p.stem}",)) for p in sorted((CONFIG_DIR / group).glob("*.yaml"))]
    for row in (("optim/sparse", "optim/dense", "scheduler", "precision", "tracking", "debug"), ("optim", "checkpoint")):
        options = {group: sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml")) for group in row}
        for i in range(max(len(o) for o in options.values())):
            configs.append(_composed("config", tuple(f"{group}={o[i]}" for group, o in options.items() if i < len(o))))
    overrides = _inline_overrides()
    assert len(overrides) > 200, "the extraction found too few overrides: did the docs' layout change?"
    wrong = [f"{where}: {key}" for where, key in overrides if not any(_has_key(cfg, key) for cfg in configs)]
    assert not wrong, "keys no config has:\n" + "\n".join(wrong)


# --------------------------------------------------------------------------------------------
# What the prose points at: metric directions, other docs, the repository's files and tests.
# --------------------------------------------------------------------------------------------


def test_the_direction_paragraph_gives_every_metric_its_class_direction() -> None:
    """docs/metrics.md's "Which way is better" lists each registered metric (and name pattern) under its class's
    ``higher_is_better``: ``True for …; False for …; None for …``."""
    from recsys_runner.metrics.registry import higher_is_better

    paragraph = (REPO / "docs" / "metrics.md").read_text().split("Which way is better", 1)[1].split("\n\n", 1)[0]
    listed: dict[str, bool | None] = {}
    for direction, names in re.findall(r"`(True|False|None)` for (.*?)(?=`(?:True|False|None)` for|\.\s|$)", paragraph, re.S):
        for name in re.findall(r"`([^`]+)`", names.split("(")[0]):
            listed[name] = {"True": True, "False": False, "None": None}[direction]
    registered = {**{n: e.higher_is_better for n, e in METRICS.items()},
                  **{n: higher_is_better("eval/" + n.replace("@<k>", "_at_10")) for n in NAME_PATTERNS}}
    assert listed == registered, "docs/metrics.md's directions against the metric classes'"


DOC_LINK = re.compile(r"(?<![\w/])(?:docs/)?([a-z_]+\.md)\b")
REPO_PATH = re.compile(r"(?<![\w/.])((?:recsys_runner|tests|hydra_plugins|conf|sweeps)/[\w./-]+\.(?:py|yaml))\b")
TEST_NAME = re.compile(r"(?<![\w/])(test_\w+)\b(?!\.sh)")


def test_every_doc_file_path_and_test_the_docs_name_exists() -> None:
    """A doc names another doc (``docs/retrieval.md``, ``[launch.md](launch.md)``), a file of the repository
    (``recsys_runner/train/corpus.py``, ``conf/debug/fast.yaml``) or a test (``tests/test_presets.py``,
    ``test_resumed_training_matches_uninterrupted``) that exists: a rename leaves no pointer into nothing."""
    tests = {p.stem for p in (REPO / "tests").glob("test_*.py")}
    defined = set(re.findall(r"^\s*(?:async )?def (test_\w+)", "\n".join(p.read_text() for p in (REPO / "tests").glob("*.py")), re.M))
    wrong = []
    for path in DOCS:
        text = path.read_text()
        wrong += [f"{path.name}: {name}" for name in sorted(set(DOC_LINK.findall(text)))
                  if not (REPO / "docs" / name).exists() and not (REPO / name).exists()]
        wrong += [f"{path.name}: {name}" for name in sorted(set(REPO_PATH.findall(text))) if not (REPO / name).exists()]
        wrong += [f"{path.name}: {name}" for name in sorted(set(TEST_NAME.findall(text))) if name not in tests | defined]
    assert not wrong, "the docs point at what does not exist:\n" + "\n".join(wrong)
