"""Prefect flows that run the DVC pipeline: in one process, in the cloud, on a device, on a schedule.

dvc.yaml is the single source of the stage graph and of caching: every flow reads the graph from it and
runs each stage as a Prefect task (`dvc repro --single-item <stage>`, which does nothing when the stage
is up to date), adding retries, logs and observability. Every stage of one flow run lands under one
MLflow parent run (EDGEFLUX_PIPELINE_ID = the flow run id), tagged with the flow and the device.

    pipeline        the whole DAG (or a target and what it needs) in this clone
    cloud_flow      prepare, pretrain, meanet_cloud; `dvc push` their outputs; commit and push dvc.lock
    device_flow     git pull + dvc pull of the cloud's outputs; the on-device stages; dvc push; the
                    device's dvc.lock and metrics pushed to the git branch devices/<device id>
    retrain_flow    new labelled samples in data/incoming -> re-run the fine-tuning stages on them, push
    fleet_flow      one device_flow run per device of a pool, their headline metrics side by side

Flows that write the clone (all but fleet_flow) hold it for their whole run (pipeline.sync.clone_lock): a
scheduled retrain_flow that comes due while a device_flow runs waits for it.

What travels where (pipeline/sync.py, docs/orchestration.md): code, dvc.lock and the small uncached
outputs (metrics, memory reports, plots) through git; models and prepared data through the DVC remote; NeuroFlux's
activation cache stays on the device unless `share_activation_cache`; runs to the MLflow server.

    python -m pipeline.flows                     # the whole pipeline, in-process
    python -m pipeline.flows --target train_bp   # a stage and what it needs
"""
from __future__ import annotations

import argparse
import json
import os
import socket
from graphlib import TopologicalSorter
from pathlib import Path

import yaml

from edgeflux.environ import offline_env
from edgeflux.presets import Preset, PresetError, load_preset, set_params
from pipeline.sync import (clone_lock, command, dvc_pull, dvc_push, git_publish, git_pull, split_by_store, stage_group,
                           stage_outputs)
from stages import registry

os.environ.update(offline_env())   # before prefect reads its settings: no telemetry, no heartbeat traceback
from prefect import flow, get_run_logger, task  # noqa: E402
from prefect.runtime import flow_run  # noqa: E402

CLOUD_STAGES = registry.names("cloud")           # the rest of dvc.yaml runs on the device
RETRAIN_STAGES = registry.names(incoming=True)  # the stages that read data/incoming
INCOMING = "data/incoming"
ACTIVATION_CACHE = "cache/neuroflux"


def _paths(entries) -> list[str]:
    """dvc.yaml lists paths as strings or as one-key mappings ({path: options})."""
    return [e if isinstance(e, str) else next(iter(e)) for e in entries or []]


def stage_graph(dvc_yaml: Path = Path("dvc.yaml")) -> dict[str, set[str]]:
    """{stage: stages it depends on}, from which stage outputs each stage's deps are."""
    stages = yaml.safe_load(dvc_yaml.read_text())["stages"]
    produced = {out: name for name, s in stages.items()
                for key in ("outs", "metrics", "plots") for out in _paths(s.get(key))}
    graph = {}
    for name, s in stages.items():
        deps = _paths(s.get("deps"))
        graph[name] = {producer for out, producer in produced.items() for d in deps if producer != name
                       and (d == out or d.startswith(out.rstrip("/") + "/") or out.startswith(d.rstrip("/") + "/"))}
    return graph


def stages_for(target: str | None, graph: dict[str, set[str]]) -> list[str]:
    """Stages in run order: all of them, or `target` and what it needs."""
    if target is not None:
        if target not in graph:
            raise ValueError(f"unknown stage {target!r}; dvc.yaml has: {', '.join(graph)}")
        keep, todo = set(), [target]
        while todo:
            stage = todo.pop()
            if stage not in keep:
                keep.add(stage)
                todo.extend(graph[stage])
        graph = {s: d & keep for s, d in graph.items() if s in keep}
    return list(TopologicalSorter(graph).static_order())


def downstream(stages, graph: dict[str, set[str]]) -> list[str]:
    """`stages` and every stage that depends on them, in run order."""
    keep = set(stages)
    for stage in stages_for(None, graph):
        if graph[stage] & keep:
            keep.add(stage)
    return [s for s in stages_for(None, graph) if s in keep]


def choose(wanted, graph: dict[str, set[str]]) -> list[str]:
    """The named stages in run order; ValueError naming the unknown ones."""
    unknown = sorted(set(wanted) - set(graph))
    if unknown:
        raise ValueError(f"unknown stage(s) {', '.join(unknown)}; dvc.yaml has: {', '.join(graph)}")
    return [s for s in stages_for(None, graph) if s in set(wanted)]


def device_stages(graph: dict[str, set[str]]) -> list[str]:
    return [s for s in stages_for(None, graph) if s not in CLOUD_STAGES]


# --- tasks ---------------------------------------------------------------------------------------------

@task(retries=1, retry_delay_seconds=5, task_run_name="dvc repro {stage}")
def repro_stage(stage: str, env: dict[str, str]) -> str:
    logger = get_run_logger()
    proc = command(["dvc", "repro", "--single-item", stage], env=env)
    logger.info("%s", proc.stdout.strip()[-4000:] or f"{stage}: up to date")
    return proc.stdout


def run_stages(stages: list[str], env: dict[str, str]) -> list[str]:
    for stage in stages:
        repro_stage(stage, env)  # sequential: a stage's inputs are the previous stages' outputs
    return stages


# --- flows ---------------------------------------------------------------------------------------------

def flow_env(flow_name: str, **tags: str) -> dict[str, str]:
    """The stages' environment: one MLflow parent run per flow run, tagged with the flow and the device."""
    env = {**os.environ, "EDGEFLUX_PIPELINE_ID": f"prefect:{flow_run.get_id()}", "EDGEFLUX_FLOW": flow_name}
    return env | {f"EDGEFLUX_{k.upper()}": v for k, v in tags.items() if v}


def device_id() -> str:
    return os.environ.get("EDGEFLUX_DEVICE_ID") or socket.gethostname()


@task(task_run_name="params: {names}")
def apply_params(names: str, overrides: dict, env: dict[str, str]) -> None:
    """The preset's and the run's overrides into params.yaml (comments kept), then checked as the stages will
    read it (edgeflux.config loads without torch, which this long-lived flow process should not hold)."""
    from edgeflux.config import ParamsError, load_params

    set_params(overrides)
    try:
        load_params()
    except ParamsError as exc:
        raise PresetError(str(exc)) from None
    get_run_logger().info("params.yaml: %s", ", ".join(f"{k}={v}" for k, v in overrides.items()))


def configure(preset: Preset | None, params: dict | None, env: dict[str, str]) -> dict[str, str]:
    """Apply the device's preset and the run's ``params`` (which win) to params.yaml; the stages' env."""
    overrides = {**(preset.params if preset else {}), **(params or {})}
    env = env | (preset.env() if preset else {})
    if overrides:
        names = " + ".join(n for n in (preset and f"preset {preset.name}", params and "run params") if n)
        apply_params(names, overrides, env)
    return env


def _headline(stages: list[str]) -> dict[str, dict]:
    """Each run stage's metrics file(s), as the flow's result and the fleet's table."""
    out = {}
    for path in split_by_store(stage_outputs(stages))[1]:
        if path.startswith("metrics/") and path.endswith(".json") and Path(path).is_file():
            out[path.removeprefix("metrics/").removesuffix(".json")] = json.loads(Path(path).read_text())
    return out


@flow(name="edgeflux-pipeline", log_prints=True)
def pipeline(target: str | None = None) -> list[str]:
    """Run the DVC stages in dependency order in this clone; returns the stages run."""
    with clone_lock("pipeline"):
        return run_stages(stages_for(target, stage_graph()), flow_env("pipeline"))


@flow(name="cloud_flow", log_prints=True)
def cloud_flow(stages: list[str] | None = None, push: bool = True, branch: str = "main") -> dict:
    """The cloud's part: prepare, pretrain, the MEANet cloud model; push their outputs and the dvc.lock."""
    with clone_lock("cloud_flow"):
        order = choose(stages or CLOUD_STAGES, stage_graph())
        run_stages(order, flow_env("cloud_flow", device_id=device_id()))
        result = {"stages": order, "pushed_bytes": 0, "commit": None}
        if push:
            result["pushed_bytes"] = dvc_push(split_by_store(stage_outputs(order))[0])
            result["commit"] = git_publish(order, f"HEAD:{branch}", f"cloud_flow: {', '.join(order)}")
        return result


@flow(name="device_flow", log_prints=True)
def device_flow(preset: str | None = None, stages: list[str] | None = None, params: dict | None = None,
                pull: bool = True, push: bool = True, share_activation_cache: bool = False, branch: str = "main",
                fleet_id: str | None = None) -> dict:
    """A device's part: the cloud's models in, the on-device stages under the device's preset (presets/<name>.yaml)
    and the run's params overrides, results out."""
    with clone_lock("device_flow"):
        graph = stage_graph()
        chosen = load_preset(preset) if preset else None   # a wrong name fails here, before anything moves
        order = choose(stages or (chosen and chosen.stages) or device_stages(graph), graph)
        result = {"device": device_id(), "preset": preset, "stages": order, "pulled_bytes": 0, "pushed_bytes": 0,
                  "commit": None}
        if pull:
            git_pull(branch, device_stages(graph))
            needed = [s for s in CLOUD_STAGES if s in {u for s in order for u in stages_for(s, graph)}]
            result["pulled_bytes"] = dvc_pull(needed + [p for p in incoming_files() if p.endswith(".dvc")])
        env = configure(chosen, params, flow_env("device_flow", device_id=device_id(), fleet_id=fleet_id or ""))
        run_stages(order, env)
        if push:
            cached = split_by_store(stage_outputs(order))[0]
            result["pushed_bytes"] = dvc_push([p for p in cached if share_activation_cache or p != ACTIVATION_CACHE])
            result["commit"] = git_publish(order, f"devices/{device_id()}", f"device_flow on {device_id()}")
        result["metrics"] = _headline(order)
        return result


def incoming_files() -> list[str]:
    """data/incoming's DVC files (one per class folder) and the .gitignore `dvc add` keeps beside them."""
    folder = Path(INCOMING)
    return sorted(str(p) for p in [*folder.glob("*.dvc"), folder / ".gitignore"] if p.is_file())


@task(task_run_name="dvc add new labelled data")
def track_new_data() -> list[str]:
    """Version each class folder of data/incoming that is new or changed since its last `dvc add`; a symbolic
    link anywhere under it stops the flow first (nothing added, nothing pushed)."""
    from edgeflux.data.inbox import refuse_links

    refuse_links(INCOMING)
    changed = []
    for folder in sorted(p for p in Path(INCOMING).iterdir() if p.is_dir() and not p.name.startswith(".")):
        dvc_file = folder.with_name(folder.name + ".dvc")
        if not dvc_file.exists() or json.loads(command(["dvc", "status", "--json", str(dvc_file)]).stdout or "{}"):
            changed.append(str(folder))
    if changed:
        command(["dvc", "add", *changed])
        get_run_logger().info("new labelled data: versioned %s (dvc add)", ", ".join(changed))
    return changed


def stale(stages: list[str]) -> list[str]:
    """Those of ``stages`` that `dvc status` reports changed (deps, params, outs or code)."""
    report = json.loads(command(["dvc", "status", "--json", *stages]).stdout or "{}")
    changed = {stage_group(name) for name in report}
    return [s for s in stages if s in changed]


def retrain_targets(graph: dict[str, set[str]]) -> list[str]:
    """The fine-tuning stages (and what depends on them) that `dvc status` reports changed, and every stage
    downstream of those: their inputs change once those run, although `dvc status` cannot say so yet."""
    return downstream(stale(downstream(RETRAIN_STAGES, graph)), graph)


@flow(name="retrain_flow", log_prints=True)
def retrain_flow(preset: str | None = None, params: dict | None = None, pull: bool = True, push: bool = True,
                 branch: str = "main") -> dict:
    """Scheduled: when data/incoming holds new labelled samples (dropped here, or pulled), re-run the
    fine-tuning stages that read it (and what depends on them) under the device's preset, then push;
    otherwise do nothing."""
    with clone_lock("retrain_flow"):
        graph = stage_graph()
        chosen = load_preset(preset) if preset else None
        if pull:
            git_pull(branch, device_stages(graph))
            dvc_pull([p for p in incoming_files() if p.endswith(".dvc")])
        env = configure(chosen, params, flow_env("retrain_flow", device_id=device_id()))
        new_data = track_new_data()
        todo = retrain_targets(graph)
        result = {"device": device_id(), "new_data": new_data, "retrained": todo, "pushed_bytes": 0, "commit": None}
        if not todo:
            get_run_logger().info("nothing to retrain: %s and the fine-tuning stages are up to date", INCOMING)
            return result
        run_stages(todo, env)
        if push:
            incoming = [p for p in incoming_files() if p.endswith(".dvc")]
            result["pushed_bytes"] = dvc_push([*incoming, *split_by_store(stage_outputs(todo))[0]])
            result["commit"] = git_publish(todo, f"devices/{device_id()}", f"retrain_flow on {device_id()}",
                                           extra=incoming_files())
        result["metrics"] = _headline(todo)
        return result


@task(task_run_name="device_flow on {device}")
def run_on_device(deployment: str, device: str, parameters: dict, timeout_s: float) -> str:
    from prefect.deployments import run_deployment
    run = run_deployment(deployment, parameters=parameters, work_queue_name=device, timeout=timeout_s,
                         flow_run_name=f"{device}: device_flow")
    if not run.state.is_completed():
        raise RuntimeError(f"device_flow on {device} ended {run.state.name}: see flow run {run.id}")
    return str(run.id)


def fleet_devices(pool: str) -> list[str]:
    """The pool's devices: each worker polls a work queue named after its device id (`--work-queue pi-01`)."""
    from prefect.client.orchestration import get_client
    with get_client(sync_client=True) as client:
        queues = client.read_work_queues(work_pool_name=pool)
    return sorted(q.name for q in queues if q.name != "default")


@flow(name="fleet_flow", log_prints=True)
def fleet_flow(pool: str = "pi", devices: list[str] | None = None, preset: str | None = None,
               params: dict | None = None, stages: list[str] | None = None, timeout_s: float = 6 * 3600) -> dict:
    """One device_flow run per device of ``pool`` (all of its device queues by default), at once, under the
    pool's preset unless ``preset`` names another; returns and prints each device's headline metrics as its
    MLflow parent run recorded them."""
    from edgeflux.tracking import fleet_metrics
    devices = devices or fleet_devices(pool)
    if not devices:
        raise ValueError(f"pool {pool!r} has no device queues: start workers with "
                         f"`prefect worker start --pool {pool} --work-queue <device id>`")
    fleet_id = str(flow_run.get_id())
    parameters = {"params": params, "stages": stages, "fleet_id": fleet_id} | ({"preset": preset} if preset else {})
    futures = [run_on_device.submit(f"device_flow/{pool}", d, parameters, timeout_s) for d in devices]
    [f.result() for f in futures]
    table = fleet_metrics(fleet_id)
    for device, metrics in sorted(table.items()):
        print(f"{device}: " + ", ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items())))
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    stages = list(stage_graph())   # (checked here: a bad name would otherwise fail after the server starts)
    parser.add_argument("--target", default=None, choices=stages, metavar="STAGE",
                        help=f"run only this stage and the stages it depends on; one of: {', '.join(stages)}")
    args = parser.parse_args()
    pipeline(args.target)


if __name__ == "__main__":
    main()
