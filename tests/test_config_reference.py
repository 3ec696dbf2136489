"""The config schema (omni/runtime/config_schema.py) against the parser and the docs: every
key it declares is read by load_config and takes its example, its defaults are the
parser's, and docs/operations.md holds the reference it generates."""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path

import pytest

from omni.api.toolcalls import PARSERS
from omni.engine.spec_config import SpecConfig
from omni.runtime import catalog, config_schema
from omni.runtime.config_schema import KEYS, TABLES, Key, toml_value

OPERATIONS = Path(__file__).resolve().parents[1] / "docs" / "operations.md"
MODEL_PATH = "/models/llama"  # one checkpoint for every entry: the sides of "llama" share it
# Entries a key's example may refer to: a draft (speculative.model) and a disaggregated
# model, "llama", whose sides a third entry may join.
BASE = {
    "gpus": [{"index": 0, "budget": "16GiB"}, {"index": 1, "budget": "16GiB"}],
    "models": [
        {"name": "llama-1b", "path": "/models/llama-1b"},
        {"name": "llama-prefill", "path": MODEL_PATH, "role": "prefill", "serves": "llama"},
        {"name": "llama-decode", "path": MODEL_PATH, "role": "decode", "serves": "llama"},
    ],
}


def document(key: Key, value: object = None, *, with_key: bool = True) -> dict:
    """BASE with `key` set to `value` (its example by default): in the first GPU's table,
    or in a model "m" of its own; `with_key=False`: the same without it."""
    value = key.example if value is None else value
    own = {key.name: value} if with_key else {}
    data = {name: list(items) for name, items in BASE.items()}
    if key.table == "node":
        return data | own
    if key.table == "gpus":  # (both its keys are required: with_key does not apply)
        data["gpus"][0] = data["gpus"][0] | own
        return data
    model = {"name": "m", "path": MODEL_PATH}
    if key.table == "models":
        model |= key.context | own
    else:  # models.speculative
        model["speculative"] = key.context | own
    data["models"].append(model)
    return data


def load(tmp_path: Path, data: dict) -> catalog.NodeConfig:
    lines = [f"{k} = {toml_value(v)}" for k, v in data.items() if k not in ("gpus", "models")]
    for table in ("gpus", "models"):
        for item in data.get(table, []):
            lines += [f"[[{table}]]", *(f"{k} = {toml_value(v)}" for k, v in item.items())]
    path = tmp_path / "omnid.toml"
    path.write_text("\n".join(lines) + "\n")
    return catalog.load_config(path)


def ids(key: Key) -> str:
    return f"{key.table}.{key.name}"


def test_operations_md_holds_the_current_reference():
    text = OPERATIONS.read_text()
    assert config_schema.START in text and config_schema.END in text
    assert config_schema.rewrite(text) == text, (
        "docs/operations.md's configuration reference is out of date with "
        f"omni/runtime/config_schema.py: run `{config_schema.WRITE_COMMAND}`"
    )


def test_the_writer_replaces_only_the_section(tmp_path):
    path = tmp_path / "ops.md"
    path.write_text(f"before\n{config_schema.START}\nold\n{config_schema.END}\nafter\n")
    config_schema.main(["--write", str(path)])
    assert path.read_text() == f"before\n{config_schema.reference()}\nafter\n"
    with pytest.raises(ValueError, match="config-reference:start"):
        config_schema.rewrite("no markers")


@pytest.mark.parametrize("key", KEYS, ids=ids)
def test_every_key_takes_its_example(tmp_path, key):
    load(tmp_path, document(key))


@pytest.mark.parametrize("key", [k for k in KEYS if k.default is not None], ids=ids)
def test_documented_defaults_are_the_parsers(tmp_path, key):
    """Writing a key's documented default reads as leaving the key out."""
    if key.table == "models.speculative":  # the table is kept as written: SpecConfig's
        assert getattr(SpecConfig(), key.name) == key.default
        return
    with_default = load(tmp_path, document(key, key.default))
    assert with_default == load(tmp_path, document(key, with_key=False))


class Recording(dict):
    """A TOML table that notes each key the parser looks up (present or not)."""

    def __init__(self, data: dict, table: str, seen: set):
        super().__init__(data)
        self.table, self.seen = table, seen

    def _note(self, key) -> None:
        self.seen.add((self.table, key))

    def __getitem__(self, key):
        self._note(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self._note(key)
        return super().__contains__(key)

    def get(self, key, default=None):
        self._note(key)
        return super().get(key, default)


def test_the_parser_reads_every_key(tmp_path, monkeypatch):
    """A key the schema declares but the parser never looks up would pass its unknown-key
    check and do nothing."""
    seen: set[tuple[str, str]] = set()
    loads = tomllib.loads

    def recording_loads(text: str) -> dict:
        data = loads(text)
        for table in ("gpus", "models"):
            data[table] = [Recording(item, table, seen) for item in data.get(table, [])]
        return Recording(data, "node", seen)

    monkeypatch.setattr(catalog.tomllib, "loads", recording_loads)
    load(tmp_path, document(next(k for k in KEYS if k.name == "gpu")))
    declared = {(k.table, k.name) for k in KEYS if k.table != "models.speculative"}
    assert declared - seen == set()
    # the speculative table goes to SpecConfig whole (and `model` names another entry)
    fields = {f.name for f in dataclasses.fields(SpecConfig)}
    assert config_schema.keys("models.speculative") == fields | {"model"}


def test_each_nested_table_is_a_key_of_the_table_around_it():
    for table in TABLES[1:]:
        parent, _, name = table.name.rpartition(".")
        assert name in config_schema.keys(parent or "node")


def test_choices_named_in_the_reference_are_the_codes():
    types = {k.name: k.type for k in KEYS}
    assert re.findall(r"\w+", types["require_limits"].split(":")[1]) == list(catalog.SANDBOX_LIMITS)
    assert set(re.findall(r'"(\w+)"', types["tool_parser"])) == set(PARSERS)


def test_the_flags_named_are_omnids(capsys):
    from omni.runtime import omnid

    with pytest.raises(SystemExit):
        omnid.parse_args(["--help"])
    usage = capsys.readouterr().out
    for key in KEYS:
        for flag in key.flags:
            assert re.search(rf"{flag}\b", usage), f"{key.name}: omnid has no {flag}"


def test_the_example_config_in_operations_md_parses(tmp_path):
    """The complete example under "The config file"."""
    section = OPERATIONS.read_text().split("## The config file", 1)[1]
    example = re.search(r"```toml\n(.*?)```", section, re.S).group(1)
    path = tmp_path / "omnid.toml"
    path.write_text(example)
    config = catalog.load_config(path)
    assert config.models and config.gpus
