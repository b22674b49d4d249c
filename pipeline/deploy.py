"""Create the work pools and deployments on a Prefect server (idempotent: re-running updates them).

    PREFECT_API_URL=http://<cloud host>:4200/api python -m pipeline.deploy

Pools (process workers): `cloud` trains the main blocks, `jetson` and `pi` hold device fleets, each device
a worker polling its own work queue named after its device id. Deployments:

    cloud_flow/cloud        pool cloud    prepare, pretrain, meanet_cloud; push models and dvc.lock
    fleet_flow/<pool>       pool cloud    one device_flow/<pool> run per device of the pool, metrics collected
    device_flow/<pool>      jetson, pi    pull the cloud's models, the on-device stages, push the results
    retrain_flow/<pool>     jetson, pi    on orchestration.retrain_cron (params.yaml): retrain on new data

Each device pool's deployments run under its preset (presets/<name>.yaml: budgets, batch limits, threads,
the training device): `pi` -> pi4, `jetson` -> jetson-nano; `--preset jetson=jetson-orin` changes one, and
a run's own parameters (`--param preset=laptop`, `params={...}`) change it for that run.

Where the code comes from: nothing is uploaded. A worker runs in a git clone of this repository (with its
venv and `dvc pull`ed data) and says where with EDGEFLUX_HOME; each deployment's pull step enters that
directory on the worker at run time (`{{ $EDGEFLUX_HOME }}` is resolved there, not here), so one deployment
serves every device of a pool, whatever path each keeps its clone at, and keeps each device's DVC cache
and activation cache between runs.
"""
from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, field

from pipeline import cli_logging, flows  # first: flows sets the offline environment before prefect is imported
from prefect.client.orchestration import get_client  # noqa: I001
from prefect.client.schemas.actions import DeploymentScheduleCreate, WorkPoolCreate
from prefect.client.schemas.schedules import CronSchedule
from prefect.utilities.callables import parameter_schema
from prefect.workers.process import ProcessWorker

from edgeflux.config import OrchestrationParams, load_params
from edgeflux.presets import PresetError, load_preset

log = logging.getLogger(__name__)

POOLS = {"cloud": "the cloud host: main-block training and fleet orchestration",
         "jetson": "NVIDIA Jetson devices, one worker and work queue per device",
         "pi": "Raspberry Pi devices, one worker and work queue per device"}
DEVICE_PRESETS = {"jetson": "jetson-nano", "pi": "pi4"}   # each device pool's default preset
PULL_STEPS = [{"prefect.deployments.steps.set_working_directory": {"directory": "{{ $EDGEFLUX_HOME }}"}}]


@dataclass
class Deployment:
    flow: object            # the @flow function
    name: str               # the deployment's name (shown as <flow name>/<name>)
    pool: str
    parameters: dict = field(default_factory=dict)
    cron: str | None = None
    timezone: str = "UTC"

    @property
    def full_name(self) -> str:
        return f"{self.flow.name}/{self.name}"


def deployments(retrain_cron: str, timezone: str = "UTC", share_activation_cache: bool = False,
                presets: dict[str, str] | None = None) -> list[Deployment]:
    out = [Deployment(flows.cloud_flow, "cloud", "cloud")]
    for pool, preset in (presets or DEVICE_PRESETS).items():
        out += [Deployment(flows.device_flow, pool, pool, {"preset": preset,
                                                           "share_activation_cache": share_activation_cache}),
                Deployment(flows.retrain_flow, pool, pool, {"preset": preset}, cron=retrain_cron, timezone=timezone),
                Deployment(flows.fleet_flow, pool, "cloud", {"pool": pool})]
    return out


def _entrypoint(fn) -> str:
    return f"pipeline/flows.py:{fn.fn.__name__}"


def summary_of(docstring: str | None) -> str:
    """A flow's docstring's first paragraph as one line: the deployment's description in Prefect's UI (its first
    line alone would end mid-sentence where the docstring wraps)."""
    return " ".join((docstring or "").strip().split("\n\n")[0].split())


def apply(items: list[Deployment], pools=POOLS) -> dict[str, str]:
    """Create or update the pools and deployments; {deployment name: id}."""
    template = ProcessWorker.get_default_base_job_template()
    ids = {}
    with get_client(sync_client=True) as client:
        for pool, description in pools.items():
            client.create_work_pool(WorkPoolCreate(name=pool, type="process", description=description,
                                                   base_job_template=template), overwrite=True)
        for d in items:
            schedules = [DeploymentScheduleCreate(schedule=CronSchedule(cron=d.cron, timezone=d.timezone),
                                                  active=True)] if d.cron else []
            flow_id = client.create_flow_from_name(d.flow.name)
            ids[d.full_name] = str(client.create_deployment(
                flow_id, d.name, work_pool_name=d.pool, entrypoint=_entrypoint(d.flow), pull_steps=PULL_STEPS,
                parameters=d.parameters, schedules=schedules, enforce_parameter_schema=True,
                parameter_openapi_schema=parameter_schema(d.flow).model_dump_for_openapi(),
                description=summary_of(d.flow.description)))
            log.info("deployment %s on pool %s%s", d.full_name, d.pool, f", cron {d.cron!r}" if d.cron else "")
    return ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", default="params.yaml",
                        help="params file whose orchestration section sets the retraining schedule (default: %(default)s)")
    parser.add_argument("--cron", default=None,
                        help="override orchestration.retrain_cron, e.g. '*/5 * * * *' (every 5 minutes)")
    parser.add_argument("--preset", action="append", default=[], metavar="POOL=PRESET",
                        help="a device pool's default preset (presets/<PRESET>.yaml), e.g. jetson=jetson-orin; "
                             "'none' runs params.yaml as it is; repeatable (defaults: "
                             + ", ".join(f"{k}={v}" for k, v in DEVICE_PRESETS.items()) + ")")
    args = parser.parse_args()
    cli_logging()
    o = load_params(args.params).orchestration
    if args.cron:
        o = OrchestrationParams(**{**o.model_dump(), "retrain_cron": args.cron})
    presets = pool_presets(args.preset, parser)
    for name in apply(deployments(o.retrain_cron, o.timezone, o.share_activation_cache, presets)):
        print(name)


def pool_presets(items: list[str], parser: argparse.ArgumentParser) -> dict[str, str | None]:
    """DEVICE_PRESETS with `pool=preset` items applied; each preset is loaded, so a typo stops here."""
    presets = dict(DEVICE_PRESETS)
    for item in items:
        pool, _, name = item.partition("=")
        if pool not in DEVICE_PRESETS or not name:
            parser.error(f"--preset {item!r}: give POOL=PRESET with POOL one of {', '.join(DEVICE_PRESETS)}")
        presets[pool] = None if name == "none" else name
    try:
        [load_preset(name) for name in presets.values() if name]
    except PresetError as exc:
        parser.error(str(exc))
    return presets


if __name__ == "__main__":
    main()
