"""params.yaml, grouped by stage, loaded into typed and validated objects.

Validation is pydantic's (already a dependency of Prefect and MLflow): strict types, unknown keys
rejected, bounds on numbers. Its errors are rewritten into one message per problem that names
the key, the value it got and what is allowed, so a typo in params.yaml reads like this:

    params.yaml: train_bp.budgt = '24MB': unknown key; allowed keys in train_bp: budget, ...

Memory budgets take units: ``300MB`` (decimal, 10^6), ``1.5GiB`` (binary, 2^30), ``4096B``.
A bare number is refused, because ``300`` could mean bytes or megabytes.
"""
from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from edgeflux.bittrain.options import BitTrainOptions as BitTrainParams
from edgeflux.data.options import DataParams
from edgeflux.errors import UserError
from edgeflux.finetune.options import FinetuneOptions, parse_method
from edgeflux.tricks.options import AUTO, BACKPROP, TrickOptions, parse_backprop
from edgeflux.memory.options import MemoryOptions
from edgeflux.models.spec import ModelSpec
from edgeflux.neuroflux.options import AUGMENT_REFUSED, AUX_MODES, CacheOptions as CacheParams
from edgeflux.options import AugmentOptions, Bytes, Options as _Section, TrainOptions, parse_bytes

__all__ = ["BitTrainParams", "Bytes", "CacheParams", "DataParams", "DeviceParams", "FinetuneParams", "MEANetParams", "MemoryOptions", "ModelSpec", "NeuroFluxParams",
           "ExportParams", "Params", "ParamsError", "PretrainParams", "ReportParams", "TrainBPParams", "TrainOptions", "load_params",
           "parse_bytes", "validate"]


class ParamsError(ValueError, UserError):
    """params.yaml holds something edgeflux cannot use; the message says what and how to fix it."""


class DeviceParams(_Section):
    """The device every budgeted stage trains on: one budget for every method. A budgeted stage's section
    (one whose options are MemoryOptions) inherits each of INHERITED that it does not set itself; its own
    value overrides the device's, except max_batch, where the smaller of the two holds (both are limits)."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    budget: Bytes | None = None
    max_batch: int = Field(256, ge=1)
    threads: int | None = Field(None, ge=1)   # torch's threads in every stage; None: torch's default
    bittrain: BitTrainParams = BitTrainParams()


INHERITED = ("device", "budget", "max_batch", "bittrain")


class PretrainParams(TrainOptions):
    """The cloud stage: plain backprop, no budget, on the source split."""

    models: list[ModelSpec] = Field(min_length=1)

    @field_validator("models")
    @classmethod
    def _unique_keys(cls, models: list[ModelSpec]) -> list[ModelSpec]:
        keys = [m.key for m in models]
        dupes = sorted({k for k in keys if keys.count(k) > 1})
        if dupes:
            raise ValueError(f"the same model is listed twice: {', '.join(dupes)}")
        return models


class TrainBPParams(TrainOptions, MemoryOptions):
    """Backprop on the device data under a memory budget (batch_size is replaced by the fitted one)."""

    model: ModelSpec
    # backprop, optionally with -bittrain and tricks (-accumulate, -checkpoint, -fused_step), or auto: the fastest
    # feasible of those under the budget, measured by edgeflux.plan (`edgeflux plan` shows the table)
    method: str = BACKPROP
    tricks: TrickOptions = TrickOptions()   # accumulation, checkpointing, the step in backward (edgeflux.tricks)

    @field_validator("method")
    @classmethod
    def _known(cls, method: str) -> str:
        if method != AUTO:
            parse_backprop(method)
        return method


class NeuroFluxParams(TrainOptions, MemoryOptions):
    """NeuroFlux (stages profile, partition, train_blocks, select_exit). epochs: per block;
    max_batch: the partitioner's batch size limit B; budget: the memory budget M."""

    model: ModelSpec = ModelSpec(name="vgg16", width=0.25)
    aux: Literal[AUX_MODES] = "adaptive"   # adaptive: AAN-LL filters; classic: classic_filters everywhere
    classic_filters: int = Field(256, ge=1)
    aux_pool: int = Field(2, ge=1)        # auxiliary heads average-pool to aux_pool x aux_pool
    profile_batches: list[int] = Field([16, 32, 64, 128], min_length=2)
    min_r2: float = Field(0.98, ge=0, le=1)
    rho: float = Field(0.4, ge=0)         # grouping threshold of Algorithm 1
    cache: CacheParams = CacheParams()
    exit_tolerance: float = Field(0.005, ge=0, le=1)   # accuracy (0.005 = 0.5 points)
    throughput_batch: int = Field(64, ge=1)

    @field_validator("augment")
    @classmethod
    def _no_augment(cls, augment: AugmentOptions) -> AugmentOptions:
        if augment.enabled:
            raise ValueError(AUGMENT_REFUSED)
        return augment

    @field_validator("model")
    @classmethod
    def _from_scratch(cls, model: ModelSpec) -> ModelSpec:
        if model.weights or model.pretrained_path:
            raise ValueError("NeuroFlux trains its model from scratch, block by block (the paper's setting): "
                             "remove neuroflux.model's weights; fine-tuning from weights is the finetune stage")
        return model

    @field_validator("profile_batches")
    @classmethod
    def _distinct_positive(cls, batches: list[int]) -> list[int]:
        if any(b < 1 for b in batches) or len(set(batches)) < 2:
            raise ValueError("profile_batches needs at least two different batch sizes, each >= 1")
        return sorted(set(batches))


class FinetuneParams(FinetuneOptions):
    """Fine-tuning a pretrained backbone on the device (target) data: one run per method (stage finetune)."""

    model: str                                       # a key of pretrain.models: models/pretrained/<model>.pt
    methods: list[str] = Field(min_length=1)   # dvc.yaml runs the stage once per entry

    @field_validator("methods")
    @classmethod
    def _unique(cls, methods: list[str]) -> list[str]:
        if len(set(methods)) != len(methods):
            raise ValueError("a method is listed twice")
        for method in methods:
            if method != AUTO:
                parse_method(method)
        return methods

    @model_validator(mode="after")
    def _tricks_compose(self) -> FinetuneParams:
        for method in (m for m in self.methods if m != AUTO):   # e.g. -fused_step with tricks.accumulate
            try:
                self.tricks.with_on(parse_method(method).tricks)
            except ValueError as e:
                detail = e.errors()[0]["msg"] if hasattr(e, "errors") else str(e)
                raise ValueError(f"finetune method {method!r}: {detail}") from None
        return self


class MEANetClientParams(_Section):
    """How the edge talks to the cloud model server (edgeflux.meanet.cloud.CloudClient)."""

    timeout_s: float = Field(5.0, gt=0)      # per request: a slower cloud is treated as down
    retries: int = Field(2, ge=0)            # per request, after the first try
    batch: int = Field(64, ge=1)             # instances per request
    cooldown_s: float = Field(5.0, ge=0)     # after a request failed every retry, answer on the edge this long
    ready_timeout_s: float = Field(120.0, gt=0)   # how long the stage waits for the server's /ping
    # the share of what was sent that the cloud must answer itself, or evaluate_edge_cloud fails: its figures
    # would measure the edge's fallbacks, not the cloud
    min_answered: float = Field(0.99, ge=0, le=1)


class MEANetCostParams(_Section):
    """Table I's cost model (edgeflux.meanet.cost): the paper's WiFi upload power model and the edge's power."""

    upload_mw_per_mbps: float = Field(283.17, ge=0)
    upload_base_mw: float = Field(132.86, ge=0)
    upload_mbps: float = Field(18.88, gt=0)
    edge_power_w: float = Field(10.0, gt=0)


class MEANetEdgeOptions(TrainOptions, MemoryOptions):
    """What the edge's training reads of the meanet section: its checkpoint's signature (and dvc.yaml's params of
    meanet_edge), so that a change to the router's settings neither reruns nor restarts it."""


class MEANetParams(MEANetEdgeOptions):
    """MEANet (stages meanet_cloud, meanet_edge, evaluate_edge_cloud). The training options are the edge's
    (adaptive + extension blocks, under budget); cloud_epochs trains model A's main block at the cloud."""

    main: str                                # a key of pretrain.models: the main block's CNN
    cloud: str                               # a key of pretrain.models: the cloud model
    variant: Literal["A", "B"] = "B"
    split_after: str | None = None           # the unit whose output is F (the fusion point); null: the variant's default
    fusion: Literal["sum", "concat"] = "sum"
    extension_blocks: int = Field(2, ge=1)   # model B
    n_hard: int | None = Field(None, ge=1)   # null: half of the classes
    cloud_epochs: int = Field(1, ge=1)       # model A: the main block's training at the cloud
    threshold: float | None = Field(None, ge=0)   # the router's entropy threshold; null: the middle of (mu_c, mu_w)
    send: Literal["images", "features"] = "images"
    sweep: int = Field(5, ge=3)              # thresholds evaluated (mu_c, mu_w and the threshold among them)
    max_test_samples: int | None = Field(None, ge=1)   # evaluate_edge_cloud: the first of the test split
    client: MEANetClientParams = MEANetClientParams()
    cost: MEANetCostParams = MEANetCostParams()

    def edge_options(self) -> MEANetEdgeOptions:
        """The training options alone (already validated here: a budget is bytes now, not '64MB')."""
        return MEANetEdgeOptions.model_construct(**{key: getattr(self, key) for key in MEANetEdgeOptions.model_fields})


class ReportParams(_Section):
    target_acc: float = Field(0.8, gt=0, le=1)


class ExportParams(_Section):
    """Stage export: every trained device model as ONNX and torch.export files (edgeflux/export.py)."""
    batch: int = Field(32, ge=1)    # the test split's first `batch` images: what each file is checked on
    exporter: Literal["torchscript", "dynamo"] = "torchscript"   # <name>.ts or <name>.pt2 beside the .onnx
    registry: bool = True           # each ONNX file also a new version in MLflow's model registry


CRON_FIELD = r"[\d*/,\-]+|[A-Za-z]{3}"   # numbers, ranges, steps, lists, or a month/day name


class OrchestrationParams(_Section):
    """Read by pipeline/deploy.py and the flows, not by a stage: changing it reruns nothing."""
    retrain_cron: str = "0 3 * * *"        # when retrain_flow looks for new labelled data (5 cron fields)
    timezone: str = "UTC"                  # the cron's time zone (an IANA name)
    share_activation_cache: bool = False   # device flows push NeuroFlux's activation cache to the DVC remote

    @field_validator("retrain_cron")
    @classmethod
    def _five_fields(cls, v: str) -> str:
        fields = v.split()
        if len(fields) != 5 or not all(re.fullmatch(CRON_FIELD, f) for f in fields):
            raise ValueError("not a cron expression: give 5 fields, minute hour day month weekday, "
                             "e.g. '0 3 * * *' (03:00 every day)")
        return v


class Params(_Section):
    data: DataParams = DataParams()
    device: DeviceParams = DeviceParams()
    pretrain: PretrainParams
    train_bp: TrainBPParams
    neuroflux: NeuroFluxParams = NeuroFluxParams()
    finetune: FinetuneParams | None = None
    meanet: MEANetParams | None = None
    report: ReportParams = ReportParams()
    export: ExportParams = ExportParams()
    orchestration: OrchestrationParams = OrchestrationParams()


def _format_error(err: dict, where: str, raw: dict) -> str:
    loc = [str(p) for p in err["loc"] if not str(p).startswith("function-")]
    # pydantic appends the validator kind ('str', 'int', 'constrained-str', ...) to union locations
    loc = [p for p in loc if not re.fullmatch(r"(str|int|float|bool|list\[.*\]|none|constrained-.*|.*\[.*\])", p)]
    key = ".".join(loc) or "(top level)"
    got = err.get("input")
    if err["type"] == "extra_forbidden":
        allowed = _allowed_keys(loc[:-1])
        shown = "a section" if isinstance(got, dict) else "a list" if isinstance(got, list) else repr(got)
        close = difflib.get_close_matches(loc[-1], allowed, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        return (f"{where}: {key} = {shown}: unknown key{hint}; allowed keys in {'.'.join(loc[:-1]) or 'params.yaml'}: "
                f"{', '.join(allowed)}")
    if err["type"] == "missing":
        return f"{where}: {key} is missing; add it (see the default params.yaml)"
    msg = err["msg"].removeprefix("Value error, ")
    if (err["type"] in ("float_type", "float_parsing") and isinstance(got, str)
            and re.fullmatch(r"[-+]?[0-9.]+[eE][-+]?[0-9]+", got)):
        # YAML 1.1 (PyYAML) reads 1e-3 as a string: a float needs a dot before the exponent
        msg += f"; YAML reads {got} as text: write it as {float(got)!r} or with a dot, like 1.0e-3"
    return f"{where}: {key} = {got!r}: {msg}"


def _allowed_keys(loc: list[str]) -> list[str]:
    model: Any = Params
    for part in loc:
        if part.isdigit():
            continue
        field = model.model_fields[part]
        ann = field.annotation
        inner = getattr(ann, "__args__", (ann,))
        model = next((a for a in inner if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if model is None:
            return []
    return list(model.model_fields)


def validate(raw: dict, where: str = "params.yaml") -> Params:
    """Turn a parsed params.yaml into Params, or raise ParamsError listing every problem."""
    if not isinstance(raw, dict):
        raise ParamsError(f"{where}: expected a mapping of stage sections, got {type(raw).__name__}")
    try:
        params = Params.model_validate(inherit_device(raw, where))
    except ValidationError as exc:
        lines = [_format_error(e, where, raw) for e in exc.errors()]
        raise ParamsError("\n".join(lines)) from None
    keys = [m.key for m in params.pretrain.models]
    if params.finetune is not None and params.finetune.model not in keys:
        raise ParamsError(f"{where}: finetune.model = {params.finetune.model!r}: not a model the pretrain stage "
                          f"trains; allowed: {', '.join(keys)} (the keys of pretrain.models)")
    for key in ("main", "cloud") if params.meanet is not None else ():
        if getattr(params.meanet, key) not in keys:
            raise ParamsError(f"{where}: meanet.{key} = {getattr(params.meanet, key)!r}: not a model the pretrain "
                              f"stage trains; allowed: {', '.join(keys)} (the keys of pretrain.models)")
    return params


def budgeted_sections() -> tuple[str, ...]:
    """The sections that inherit the device section: those whose options include the memory options."""
    return tuple(name for name, field in Params.model_fields.items()
                 if any(isinstance(t, type) and issubclass(t, MemoryOptions)
                        for t in getattr(field.annotation, "__args__", (field.annotation,))))


def inherit_device(raw: dict, where: str = "params.yaml") -> dict:
    """``raw`` with the device section's keys copied into every budgeted section that does not set them
    (bittrain key by key). The device section is checked on its own first, so that a bad device.budget is
    one message naming device.budget, not one per stage."""
    device = raw.get("device", {})
    try:
        DeviceParams.model_validate(device)
    except ValidationError as exc:
        raise ParamsError("\n".join(_format_error({**e, "loc": ("device", *e["loc"])}, where, raw)
                                     for e in exc.errors())) from None
    inherited = {key: device[key] for key in INHERITED if key in device}
    out = dict(raw)
    for name in budgeted_sections():
        section = raw.get(name)
        if not isinstance(section, dict):
            continue
        merged = {**inherited, **section}
        if isinstance(inherited.get("bittrain"), dict) and isinstance(section.get("bittrain"), dict):
            merged["bittrain"] = {**inherited["bittrain"], **section["bittrain"]}
        caps = [v for v in (inherited.get("max_batch"), section.get("max_batch")) if type(v) is int]
        if len(caps) == 2:   # both limits hold: the device's, and the method's own (e.g. steps per epoch)
            merged["max_batch"] = min(caps)
        out[name] = merged
    return out


def load_params(path: str | Path = "params.yaml") -> Params:
    path = Path(path)
    if not path.exists():
        raise ParamsError(f"{path}: not found; run from the repository root, where params.yaml lives")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ParamsError(f"{path}: not valid YAML: {exc}") from None
    return validate(raw or {}, where=str(path))
