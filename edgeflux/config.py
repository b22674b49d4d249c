"""params.yaml, grouped by stage, loaded into typed and validated objects.

Validation is pydantic's (already a dependency of Prefect and MLflow): strict types, unknown keys
rejected, bounds on numbers. Its errors are rewritten into one message per problem that names
the key, the value it got and what is allowed, so a typo in params.yaml reads like this:

    params.yaml: train_bp.budgt = '24MB': unknown key; allowed keys in train_bp: budget, ...

Memory budgets take units: ``300MB`` (decimal, 10^6), ``1.5GiB`` (binary, 2^30), ``4096B``.
A bare number is refused, because ``300`` could mean bytes or megabytes.
"""
from __future__ import annotations

import re
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator

_UNITS = {
    "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}
_BYTES_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]+)\s*$")


class ParamsError(ValueError):
    """params.yaml holds something edgeflux cannot use; the message says what and how to fix it."""


def parse_bytes(value: str | int) -> int:
    """'300MB' -> 300_000_000, '1.5GiB' -> 1_610_612_736. Integers and unit-less strings are refused."""
    if isinstance(value, bool) or not isinstance(value, str):
        raise ValueError(
            f"a memory size needs a unit, e.g. '{value}MB' or '{value}MiB' "
            f"(allowed units: {', '.join(_pretty_units())})"
        )
    match = _BYTES_RE.match(value)
    if not match:
        raise ValueError(
            f"cannot read {value!r} as a memory size; write a number and a unit, e.g. '300MB' or "
            f"'1.5GiB' (allowed units: {', '.join(_pretty_units())})"
        )
    number, unit = match.groups()
    if unit.upper() not in _UNITS:
        raise ValueError(f"unknown unit {unit!r} in {value!r}; allowed units: {', '.join(_pretty_units())}")
    size = int(round(float(number) * _UNITS[unit.upper()]))
    if size <= 0:
        raise ValueError(f"a memory size must be positive, got {value!r}")
    return size


def _pretty_units() -> list[str]:
    return [u if len(u) <= 2 else u[0] + "iB" for u in _UNITS]


Bytes = Annotated[int, BeforeValidator(parse_bytes)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class ModelSpec(_Section):
    """Which model of the zoo, how wide, and optional torchvision weights on disk."""

    name: Literal["vgg11", "vgg16", "vgg19", "resnet18", "mobilenet_v2", "mobilenet_v3_small", "mobilenet_v3_large"]
    width: float = Field(1.0, gt=0, le=4)
    batch_norm: bool = True
    pretrained_path: str | None = None

    @property
    def key(self) -> str:
        """A file-name-safe id, e.g. 'mobilenet_v2-w0.5'."""
        return f"{self.name}-w{self.width:g}" + ("" if self.batch_norm else "-nobn")


class DataParams(_Section):
    dataset: Literal["fashion-mnist", "mnist", "mnist-subset", "cifar10", "cifar100", "imagefolder"] = "fashion-mnist"
    root: str | None = None
    download: bool = False
    image_size: int = Field(32, ge=8, le=512)
    channels: Literal[1, 3] | None = None
    val_fraction: float = Field(0.1, gt=0, lt=1)
    split_by: Literal["data", "classes", "none"] = "data"
    source_fraction: float = Field(0.5, gt=0, lt=1)
    source_classes: list[int] | None = None
    seed: int = 0


class TrainOptions(_Section):
    """Options every trainer shares, so that stages read the same names."""

    epochs: int = Field(1, ge=1)
    batch_size: int = Field(128, ge=1)
    lr: float = Field(0.05, gt=0)
    optimizer: Literal["sgd", "adam"] = "sgd"
    momentum: float = Field(0.9, ge=0, lt=1)
    weight_decay: float = Field(5e-4, ge=0)
    max_train_samples: int | None = Field(None, ge=1)
    evals_per_epoch: int = Field(2, ge=1)
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"


class BitTrainParams(_Section):
    """BitTrain: store saved activations as sparse bitmaps (edgeflux.bittrain, which exports this
    class as BitTrainOptions). ``context`` is an edgeflux.memory StepContext: pass it to any trainer."""

    enabled: bool = False
    threshold: float = Field(0.0, ge=0)   # 0: exact (bit-identical gradients); > 0 prunes |x| < threshold
    min_bytes: int = Field(4096, ge=0)    # smaller saved tensors stay dense
    store_dtype: Literal["float16", "bfloat16", "float32", "float64"] | None = None   # non-zero values' dtype
    double_mask: bool = False             # BatchNorm/activation mask propagation (edgeflux.bittrain.doublemask)
    narrow_indices: bool = True           # int64 max-pool indices held as int16/int32 when they fit (exact)
    activation_masks: bool = True         # in-place ReLU6/Hardtanh input copies read from the output (exact)

    @property
    def exact(self) -> bool:
        """True when gradients are bit-identical to plain training (no pruning, no fp16, no approximate rule)."""
        return not self.enabled or (self.threshold == 0 and self.store_dtype is None and not self.double_mask)

    def context(self, units: Any = None) -> AbstractContextManager:
        """A compressed_activations context for these options, or nullcontext() when disabled.

        units: the model (or (name, module) pairs), for per-unit accounting.
        """
        if not self.enabled:
            return nullcontext()
        from edgeflux.bittrain import compressed_activations  # lazy: edgeflux.bittrain imports this module

        return compressed_activations(threshold=self.threshold, min_bytes=self.min_bytes,
                                      store_dtype=self.store_dtype, double_mask=self.double_mask, units=units,
                                      narrow_indices=self.narrow_indices, activation_masks=self.activation_masks)

    def to_dict(self) -> dict:
        return self.model_dump()


class MemoryOptions(_Section):
    """The memory options every budgeted trainer takes (composable across techniques)."""

    budget: Bytes | None = None
    max_batch: int = Field(256, ge=1)
    bittrain: BitTrainParams = BitTrainParams()


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


class CacheParams(_Section):
    """How NeuroFlux stores block activations on disk (edgeflux.neuroflux.cache)."""

    storage: Literal["dense", "float16", "bittrain"] = "dense"   # float16: half the disk, approximate
    threshold: float = Field(0.0, ge=0)   # bittrain: prune |x| < threshold (0: exact)
    # a shard holds as many samples as fit this many bytes in the compute dtype (at least one): what
    # reading a cache keeps in memory is a few shards, so on a device this bounds the input pipeline
    shard_size: Bytes = Field(4 * 2**20, ge=1)

    @model_validator(mode="after")
    def _threshold_needs_bittrain(self) -> CacheParams:
        # checked here, not when the first cache is written: that happens after the block has trained
        if self.threshold and self.storage != "bittrain":
            raise ValueError(f"threshold {self.threshold:g} prunes bitmap values: it needs storage: bittrain "
                             f"(storage is {self.storage}); set threshold: 0 or storage: bittrain")
        return self


class NeuroFluxParams(TrainOptions, MemoryOptions):
    """NeuroFlux (stages profile, partition, train_blocks, select_exit). epochs: per block;
    max_batch: the partitioner's batch size limit B; budget: the memory budget M."""

    model: ModelSpec = ModelSpec(name="vgg16", width=0.25)
    aux: Literal["adaptive", "classic"] = "adaptive"   # adaptive: AAN-LL filters; classic: classic_filters everywhere
    classic_filters: int = Field(256, ge=1)
    aux_pool: int = Field(2, ge=1)        # auxiliary heads average-pool to aux_pool x aux_pool
    profile_batches: list[int] = Field([16, 32, 64, 128], min_length=2)
    min_r2: float = Field(0.98, ge=0, le=1)
    rho: float = Field(0.4, ge=0)         # grouping threshold of Algorithm 1
    cache: CacheParams = CacheParams()
    exit_tolerance: float = Field(0.005, ge=0, le=1)   # accuracy (0.005 = 0.5 points)
    throughput_batch: int = Field(64, ge=1)
    # Blocks train at different batch sizes (Algorithm 1): lr is for a batch of lr_reference_batch
    # and each block scales it to its own batch (linear: Goyal et al.'s rule; sqrt: milder; constant: as is)
    lr_scaling: Literal["constant", "linear", "sqrt"] = "constant"
    lr_reference_batch: int = Field(32, ge=1)

    def block_lr(self, batch: int) -> float:
        """The learning rate of a block trained at `batch`."""
        ratio = batch / self.lr_reference_batch
        return self.lr * {"constant": 1.0, "linear": ratio, "sqrt": ratio ** 0.5}[self.lr_scaling]

    @field_validator("profile_batches")
    @classmethod
    def _distinct_positive(cls, batches: list[int]) -> list[int]:
        if any(b < 1 for b in batches) or len(set(batches)) < 2:
            raise ValueError("profile_batches needs at least two different batch sizes, each >= 1")
        return sorted(set(batches))


class ReportParams(_Section):
    target_acc: float = Field(0.8, gt=0, le=1)


class Params(_Section):
    data: DataParams = DataParams()
    pretrain: PretrainParams
    train_bp: TrainBPParams
    neuroflux: NeuroFluxParams = NeuroFluxParams()
    report: ReportParams = ReportParams()


def _format_error(err: dict, where: str, raw: dict) -> str:
    loc = [str(p) for p in err["loc"] if not str(p).startswith("function-")]
    # pydantic appends the validator kind ('str', 'int', 'constrained-str', ...) to union locations
    loc = [p for p in loc if not re.fullmatch(r"(str|int|float|bool|list\[.*\]|none|constrained-.*|.*\[.*\])", p)]
    key = ".".join(loc) or "(top level)"
    got = err.get("input")
    if err["type"] == "extra_forbidden":
        allowed = _allowed_keys(loc[:-1])
        return f"{where}: {key} = {got!r}: unknown key; allowed keys in {'.'.join(loc[:-1]) or 'params.yaml'}: {', '.join(allowed)}"
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
        return Params.model_validate(raw)
    except ValidationError as exc:
        lines = [_format_error(e, where, raw) for e in exc.errors()]
        raise ParamsError("\n".join(lines)) from None


def load_params(path: str | Path = "params.yaml") -> Params:
    path = Path(path)
    if not path.exists():
        raise ParamsError(f"{path}: not found; run from the repository root, where params.yaml lives")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ParamsError(f"{path}: not valid YAML: {exc}") from None
    return validate(raw or {}, where=str(path))
