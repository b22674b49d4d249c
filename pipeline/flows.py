"""Prefect flow that runs the DVC pipeline stage by stage.

dvc.yaml is the single source of the stage graph and of caching: this flow reads the graph from
it and runs each stage as a Prefect task (`dvc repro --single-item <stage>`, which does nothing
when the stage is up to date), adding retries, logs and observability. Every stage of one flow run
lands under one MLflow parent run (EDGEFLUX_PIPELINE_ID = the flow run id).

    python -m pipeline.flows                     # the whole pipeline
    python -m pipeline.flows --target train_bp   # a stage and what it needs
"""
from __future__ import annotations

import argparse
import os
import subprocess
from graphlib import TopologicalSorter
from pathlib import Path

import yaml
from prefect import flow, get_run_logger, task
from prefect.runtime import flow_run


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


@task(retries=1, retry_delay_seconds=5, task_run_name="dvc repro {stage}")
def repro_stage(stage: str, env: dict[str, str]) -> str:
    logger = get_run_logger()
    proc = subprocess.run(["dvc", "repro", "--single-item", stage], env=env, capture_output=True, text=True)
    logger.info(proc.stdout[-4000:])
    if proc.returncode != 0:
        raise RuntimeError(f"dvc repro {stage} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc.stdout


@flow(name="edgeflux-pipeline", log_prints=True)
def pipeline(target: str | None = None) -> list[str]:
    """Run the DVC stages in dependency order; returns the stages run."""
    order = stages_for(target, stage_graph())
    env = {**os.environ, "EDGEFLUX_PIPELINE_ID": f"prefect:{flow_run.get_id()}"}
    for stage in order:
        repro_stage(stage, env)  # sequential: a stage's inputs are the previous stages' outputs
    return order


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    stages = list(stage_graph())   # (checked here: a bad name would otherwise fail after the server starts)
    parser.add_argument("--target", default=None, choices=stages, metavar="STAGE",
                        help=f"run only this stage and the stages it depends on; one of: {', '.join(stages)}")
    args = parser.parse_args()
    pipeline(args.target)


if __name__ == "__main__":
    main()
