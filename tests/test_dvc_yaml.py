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
                     "export": {"prepare", "train_bp", "train_blocks", "select_exit", "finetune", "meanet_edge"},
                     "report": {"pretrain", "train_bp", "profile", "partition", "train_blocks", "select_exit",
                                "finetune", "meanet_cloud", "meanet_edge", "evaluate_edge_cloud", "export"}}
    assert stages_for("select_exit", graph) == ["prepare", "profile", "partition", "train_blocks", "select_exit"]
    assert stages_for("train_bp", graph) == ["prepare", "train_bp"]
    assert stages_for(None, graph)[-1] == "report"
    with pytest.raises(ValueError, match="unknown stage 'trian_bp'"):
        stages_for("trian_bp", graph)


# Code that never changes what a stage writes: atomic file writes, MLflow logging, the stage runner, the
# errors it reports, the processes and servers it starts, the registry's declarations, lazy namespaces.
PLUMBING = {"edgeflux/artifacts.py", "edgeflux/tracking", "stages/common.py", "edgeflux/errors.py",
            "edgeflux/process.py", "edgeflux/service.py", "edgeflux/environ.py", "stages/registry.py",
            "edgeflux/lazy.py"}


def _plumbing(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in PLUMBING)


def _imported_files(script: Path) -> set[str]:
    """The repository files (edgeflux/*, stages/*) a stage script imports directly (a name of a lazy package
    counts as the submodule that defines it)."""
    import ast

    from tests.test_imports import lazy_names

    names = set()
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            init = REPO / node.module.replace(".", "/") / "__init__.py"
            lazy = lazy_names(init, node.module) if init.is_file() else {}
            names |= {node.module} | {lazy.get(a.name, f"{node.module}.{a.name}") for a in node.names}
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
        if not _plumbing(paths[name]) and paths[name] != "edgeflux/config.py":
            todo += edges.get(name, ())
    return files | {paths[n] for n in seen}


def _runs(name: str, module: str) -> set[str]:
    """The files a stage runs: its module's imports, and for the report the modules whose rows it loads
    (stages/registry.py: rows=True), which it imports by name at run time."""
    from stages.registry import stages

    scripts = [module] + ([s.module for s in stages() if s.rows] if name == "report" else [])
    direct = set().union(*(_imported_files(REPO / (m.replace(".", "/") + ".py")) for m in scripts))
    return {f for f in _library_closure(direct | {m.replace(".", "/") + ".py" for m in scripts})
            if not _plumbing(f)}


def test_a_finetune_stage_depends_on_every_finetune_param_but_the_method_list():
    """Each finetune@<method> stage tracks the finetune section key by key, all but `methods`: adding a method
    to the list must not retrain the others, and an option left out would not retrain them when it changes."""
    stage = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]["finetune"]
    section = yaml.safe_load((REPO / "params.yaml").read_text())["finetune"]
    device = ["device.device", "device.budget", "device.max_batch", "device.bittrain"]   # what it inherits
    listed = stage["params"]
    assert listed[:-len(device)] == [f"finetune.{key}" for key in section if key != "methods"]
    assert sorted(listed[-len(device):]) == sorted(device)


def test_every_stage_depends_on_the_code_it_runs():
    """dvc repro reruns a stage only when a dep changed: code a stage runs, directly or through the library
    modules it imports, but does not list would leave its outputs stale after a change."""
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    lacking = []
    for name, stage in stages.items():
        deps = [d if isinstance(d, str) else next(iter(d)) for d in stage.get("deps", [])]
        cmd = stage["cmd"].split()
        module = cmd[cmd.index("-m") + 1]
        needed = _runs(name, module)
        if stage.get("params"):   # params are read, checked and defaulted by edgeflux/config.py
            needed.add("edgeflux/config.py")
        if missing := sorted(f for f in needed if not any(f == d or f.startswith(d.rstrip("/") + "/") for d in deps)):
            lacking.append(f"stage {name}: dvc.yaml deps lack {missing}")
    assert not lacking, "\n".join(lacking)


def test_a_stage_lists_the_device_keys_it_inherits_and_its_own_overrides():
    """A budgeted stage reruns when the device's budget, batch limit, device or BitTrain change. Where its
    dvc.yaml params list keys rather than its whole section, a device key that its section sets itself
    (finetune.max_batch) must be listed too: DVC reruns a stage only for the params it lists."""
    from stages.registry import stages

    params = yaml.safe_load((REPO / "params.yaml").read_text())
    dvc = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    for s in (s for s in stages() if s.budgeted):
        listed = dvc[s.name]["params"]
        assert "device.budget" in listed, s.name
        own = [f"{s.section}.{k}" for k in ("device", "budget", "max_batch", "bittrain") if k in params[s.section]]
        assert s.section in listed or set(own) <= set(listed), (s.name, own)
