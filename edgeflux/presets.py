"""Device presets (presets/<name>.yaml): what a Jetson, a Raspberry Pi or a laptop runs, as params overrides.

    preset = load_preset("pi4")                  # or a path to a preset file
    set_params(preset.params | {"train_bp.epochs": 1})   # params.yaml updated, comments kept
    env = {**os.environ, **preset.env()}         # the preset's name, for the MLflow tags

    python -m edgeflux.presets list              # the presets, with their devices
    python -m edgeflux.presets check             # params.yaml as the stages will read it (one line per problem)

A preset is checked when it is loaded (unknown fields, a wrong type). The merged params.yaml is checked by
`check` (edgeflux.config, torch-free): the flows check it before any stage, so a bad override stops them early.
presets/README.md says what each field means and where the values come from.
"""
from __future__ import annotations

import argparse
import copy
import io
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError
from ruamel.yaml import YAML

from edgeflux.errors import UserError
from edgeflux.options import Options

OVERRIDES_ENV = "EDGEFLUX_OVERRIDES"   # `edgeflux run`'s overrides as JSON, for the pipeline's MLflow parent run

__all__ = ["PRESETS_DIR", "Preset", "PresetError", "available", "load_preset", "merge", "set_params"]

PRESETS_DIR = Path("presets")   # relative to the project root, where params.yaml is: each clone has its own


class PresetError(ValueError, UserError):
    """A preset that does not exist or cannot be used; the message names the fix."""


class Preset(Options):
    name: str = ""
    description: str
    stages: list[str] | None = None           # the device stages to run; None: all of them
    params: dict[str, Any] = {}               # params.yaml overrides, dotted keys

    def env(self) -> dict[str, str]:
        """What the stages' environment gets: the preset's name, for the MLflow tags (its threads are a
        param, device.threads, which every stage applies itself)."""
        return {"EDGEFLUX_PRESET": self.name}


def available(root: Path = PRESETS_DIR) -> list[str]:
    return sorted(p.stem for p in root.glob("*.yaml"))


def load_preset(name: str, root: Path = PRESETS_DIR) -> Preset:
    """A preset by name (presets/<name>.yaml) or by path; PresetError names the presets there are."""
    path = Path(name) if name.endswith((".yaml", ".yml")) else root / f"{name}.yaml"
    if not path.is_file():
        raise PresetError(f"no preset {name!r} ({path} not found); presets in {root}/: "
                          f"{', '.join(available(root)) or 'none'}, or give a path to a preset file")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
        preset = Preset.model_validate({"name": path.stem, **raw})
    except (yaml.YAMLError, ValidationError) as exc:
        raise PresetError(f"{path}: not a valid preset: {_first_line(exc)}; see {root}/README.md") from None
    merge({}, preset.params)   # a dotted key that walks into a non-section fails here, naming the key
    return preset


def _first_line(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        return "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
    return str(exc).splitlines()[0]


def merge(params: dict, overrides: dict[str, Any]) -> dict:
    """``params`` with ``overrides`` applied, as `dvc exp run -S` would: a dotted key (`train_bp.epochs`)
    sets one value, a mapping value merges into the section there. ``params`` itself is not changed."""
    out = copy.deepcopy(params)
    for key, value in overrides.items():
        *sections, last = key.split(".")
        node = out
        for i, section in enumerate(sections):
            node = node.setdefault(section, {})
            if not isinstance(node, dict):
                raise PresetError(f"override {key!r}: {'.'.join(sections[:i + 1])} is a value, not a section")
        if isinstance(value, dict) and isinstance(node.get(last), dict):
            _deep_update(node[last], value)
        else:
            node[last] = value
    return out


def _deep_update(node: dict, value: dict) -> None:
    for k, v in value.items():
        if isinstance(v, dict) and isinstance(node.get(k), dict):
            _deep_update(node[k], v)
        else:
            node[k] = v


def set_params(overrides: dict[str, Any], path: str | Path = "params.yaml") -> None:
    """Apply ``overrides`` to the params file in place, keeping its comments and order (not validated:
    see `check`)."""
    if not overrides:
        return
    path = Path(path)
    rt = YAML()               # round-trip: comments, key order and quoting survive the rewrite
    rt.width = 4096
    rt.preserve_quotes = True
    rt.indent(mapping=2, sequence=4, offset=2)   # params.yaml's own layout, so untouched lines stay as they were
    rt.representer.add_representer(type(None), lambda r, _: r.represent_scalar("tag:yaml.org,2002:null", "null"))
    document = rt.load(path.read_text())
    _copy_into(document, merge(yaml.safe_load(path.read_text()) or {}, overrides))
    buffer = io.StringIO()
    rt.dump(document, buffer)
    path.write_text(buffer.getvalue())


def _copy_into(document, merged: dict) -> None:
    """Write ``merged``'s values into the round-trip ``document`` where they differ, keeping its comments."""
    for key, value in merged.items():
        if isinstance(value, dict) and isinstance(document.get(key), dict):
            _copy_into(document[key], value)
        elif key not in document or document[key] != value:
            document[key] = value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m edgeflux.presets", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the presets in presets/, one per line, with the device each is for")
    check = sub.add_parser("check", help="validate a params file as the stages will (exit 1, one line per problem)")
    check.add_argument("params", nargs="?", default="params.yaml", help="default: %(default)s")
    args = parser.parse_args(argv)
    if args.command == "list":
        for name in available():
            print(f"{name:<14} {load_preset(name).description}")
        return 0
    from edgeflux.config import ParamsError, load_params
    try:
        load_params(args.params)
    except ParamsError as exc:
        print(exc, file=sys.stderr)
        return 1
    print(f"{args.params}: valid")
    return 0


if __name__ == "__main__":
    sys.exit(main())

