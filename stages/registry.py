"""What the rest of edgeflux knows about a stage, declared in the stage's own module:

    STAGE = Stage(name="train_bp", section="train_bp", side="device", budgeted=True, rows=True,
                  curve="plots/train_bp.csv", outs=("details/train_bp.json", "plots/train_bp.csv", ...))

    def summary_rows(inputs: RowInputs) -> list[MethodRow]:   # rows=True: what the report shows of it

The report, the flows, the sandbox and the `edgeflux` command read `stages()` instead of keeping their
own lists; `dvc.yaml` stays the graph (deps, params, caching) and the order, and tests/test_registry.py
holds the two together (the same stages, the same outputs, deps that cover what each stage imports).

The declarations are read from the stage files" source, not by importing them: a stage imports torch and
its technique, and the processes that only need the list (a Prefect worker on a 4 GB device, the CLI"s
`--dry-run`) must not pay for that. A declaration therefore holds literals only; `load_module()` imports
a stage when its code is needed (the report"s rows).
"""
from __future__ import annotations

import ast
import importlib
from dataclasses import dataclass, fields
from pathlib import Path
from types import ModuleType
from typing import Literal

import yaml

STAGES_DIR = Path(__file__).resolve().parent
DVC_YAML = STAGES_DIR.parent / "dvc.yaml"
MATRIX_ITEM = "${item.method}"   # dvc.yaml"s matrix stage (finetune) names its outputs per method like this


class RegistryError(ValueError):
    """A stage declaration that cannot be read: the message names the file and the fix."""


@dataclass(frozen=True)
class Stage:
    name: str                                   # dvc.yaml"s stage name
    section: str | None                         # the params.yaml section the stage reads (None: none)
    side: Literal["cloud", "device"]            # cloud_flow runs the cloud"s stages, device_flow the rest
    budgeted: bool = False                      # trains under the device section"s budget (device.*)
    incoming: bool = False                      # trains on data/incoming too: retrain_flow reruns it
    outs: tuple[str, ...] = ()                  # dvc.yaml"s outs, metrics and plots, in any order
    curve: str | None = None                    # its accuracy-vs-time CSV (one of outs): plotted, timed to target
    rows: bool = False                          # its module"s summary_rows() adds rows to the report
    module: str = ""                            # filled in by the registry: stages.<file>

    def load_module(self) -> ModuleType:
        return importlib.import_module(self.module)

    def files(self, methods: list[str]) -> list[str]:
        """The names its headline and details files have: finetune/<method> once per method."""
        return [f"{self.name}/{m}" for m in methods] if self.matrix else [self.name]

    @property
    def matrix(self) -> bool:
        return any(MATRIX_ITEM in out for out in self.outs)


def _declaration(path: Path) -> dict | None:
    """The keyword arguments of `STAGE = Stage(...)` in a stage file, or None when it declares none."""
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        if (isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["STAGE"]
                and isinstance(node.value, ast.Call) and getattr(node.value.func, "id", None) == "Stage"):
            try:
                return {kw.arg: ast.literal_eval(kw.value) for kw in node.value.keywords}
            except ValueError:
                raise RegistryError(f"{path}: STAGE = Stage(...) must hold literals only (strings, booleans, "
                                    f"tuples): the registry reads it without importing the stage") from None
    return None


def stages(root: Path = STAGES_DIR, package: str = "stages", dvc_yaml: Path = DVC_YAML) -> list[Stage]:
    """Every declared stage, in dvc.yaml"s order (the pipeline"s reading order), then any dvc.yaml lacks."""
    found = []
    for path in sorted(root.glob("*.py")):
        if (kwargs := _declaration(path)) is not None:
            unknown = set(kwargs) - {f.name for f in fields(Stage)}
            if unknown:
                raise RegistryError(f"{path}: Stage() has no field {', '.join(sorted(unknown))}")
            found.append(Stage(**{k: tuple(v) if isinstance(v, list) else v for k, v in kwargs.items()},
                               module=f"{package}.{path.stem}"))
    order = list((yaml.safe_load(dvc_yaml.read_text()) or {}).get("stages", {})) if dvc_yaml.exists() else []
    return sorted(found, key=lambda s: order.index(s.name) if s.name in order else len(order))


def by_name(root: Path = STAGES_DIR) -> dict[str, Stage]:
    return {s.name: s for s in stages(root)}


def names(side: str | None = None, *, incoming: bool | None = None) -> tuple[str, ...]:
    """The stage names on one side (cloud | device), or those that read incoming data."""
    return tuple(s.name for s in stages() if (side is None or s.side == side)
                 and (incoming is None or s.incoming == incoming))
