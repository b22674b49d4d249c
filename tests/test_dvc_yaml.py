"""dvc.yaml and params.yaml read as files, without running DVC: the stage graph the flows take from it, and
each stage's deps and params against the code and sections it reads (a stage that does not list what it
runs would not rerun when that changes)."""
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]


def test_stage_graph_is_read_from_dvc_yaml():
    from pipeline.flows import stage_graph, stages_for

    graph = stage_graph(REPO / "dvc.yaml")
    assert graph == {"prepare": set(), "pretrain": {"prepare"}, "train_bp": {"prepare"},
                     "profile": {"prepare"}, "partition": {"profile"},
                     "train_blocks": {"prepare", "profile", "partition"}, "select_exit": {"prepare", "train_blocks"},
                     "finetune": {"prepare", "pretrain"}, "meanet_cloud": {"prepare", "pretrain"},
                     "meanet_edge": {"prepare", "meanet_cloud"},
                     "evaluate_edge_cloud": {"prepare", "meanet_cloud", "meanet_edge"},
                     "report": {"pretrain", "train_bp", "profile", "partition", "train_blocks", "select_exit",
                                "finetune", "meanet_cloud", "meanet_edge", "evaluate_edge_cloud"}}
    assert stages_for("select_exit", graph) == ["prepare", "profile", "partition", "train_blocks", "select_exit"]
    assert stages_for("train_bp", graph) == ["prepare", "train_bp"]
    assert stages_for(None, graph)[-1] == "report"
    with pytest.raises(ValueError, match="unknown stage 'trian_bp'"):
        stages_for("trian_bp", graph)


# Code that never changes what a stage writes: atomic file writes, MLflow logging, the stage runner.
PLUMBING = {"edgeflux/artifacts.py", "edgeflux/tracking.py", "stages/common.py"}


def _imported_files(script: Path) -> set[str]:
    """The repository files (edgeflux/*, stages/*) a stage script imports directly."""
    import ast

    names = set()
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
    files = set()
    for name in names:
        path = name.replace(".", "/")
        for candidate in (f"{path}.py", f"{path}/__init__.py"):
            if name.split(".")[0] in ("edgeflux", "stages") and (REPO / candidate).is_file():
                files.add(candidate)
    return files


def _library_closure(files: set[str]) -> set[str]:
    """`files` and every library file they run, transitively (tests/test_imports.py's import graph). Not
    followed: the plumbing's imports (it writes and logs what the stage computed) and config.py's (the
    registries it takes allowed values from; a stage's results follow the params values, which DVC tracks)."""
    from tests.test_imports import import_graph, module_names

    paths = {name: str(path.relative_to(REPO)) for name, path in module_names(REPO / "edgeflux").items()}
    modules = {p: n for n, p in paths.items()}
    edges = import_graph().edges
    todo = [modules[f] for f in files if f in modules]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if paths[name] not in PLUMBING | {"edgeflux/config.py"}:
            todo += edges.get(name, ())
    return files | {paths[n] for n in seen}


def test_a_finetune_stage_depends_on_every_finetune_param_but_the_method_list():
    """Each finetune@<method> stage tracks the finetune section key by key, all but `methods`: adding a method
    to the list must not retrain the others, and an option left out would not retrain them when it changes."""
    stage = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]["finetune"]
    section = yaml.safe_load((REPO / "params.yaml").read_text())["finetune"]
    assert stage["params"] == [f"finetune.{key}" for key in section if key != "methods"]


def test_every_stage_depends_on_the_code_it_runs():
    """dvc repro reruns a stage only when a dep changed: code a stage runs, directly or through the library
    modules it imports, but does not list would leave its outputs stale after a change (as edgeflux/data.py's
    tensors() once was)."""
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    for name, stage in stages.items():
        deps = [d if isinstance(d, str) else next(iter(d)) for d in stage.get("deps", [])]
        cmd = stage["cmd"].split()
        module = cmd[cmd.index("-m") + 1]
        needed = _library_closure(_imported_files(REPO / (module.replace(".", "/") + ".py"))) - PLUMBING
        if stage.get("params"):   # params are read, checked and defaulted by edgeflux/config.py
            needed.add("edgeflux/config.py")
        missing = {f for f in needed if not any(f == d or f.startswith(d.rstrip("/") + "/") for d in deps)}
        assert not missing, f"stage {name}: dvc.yaml deps lack {sorted(missing)}"
