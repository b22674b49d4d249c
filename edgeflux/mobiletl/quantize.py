"""The frozen bottom of a fine-tuned model, run forward-only in int8 (the paper's g(x), "frozen and quantized").

``torch.ao.quantization``'s FX graph mode does the work: ``prepare_fx`` inserts observers, a few target
batches calibrate them (post-training static quantization: per-channel int8 weights, per-tensor uint8
activations), ``convert_fx`` swaps in the int8 kernels (fbgemm/x86 on x86, qnnpack on ARM: Raspberry Pi,
Jetson CPU). FX rather than eager mode because it handles the residual ``+`` and the squeeze-excitation
``*`` of torchvision's blocks without rewriting them. The bottom is quantized as one graph; if that
fails, unit by unit, and a unit whose ops cannot be quantized stays in float (one warning names them).

Quantized kernels run on CPU only: on CUDA the bottom stays in float, with a warning.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import platform
import warnings
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor, nn

__all__ = ["FrozenBottom", "quantize_bottom", "quantized_engine"]

log = logging.getLogger(__name__)

# Copying an int8 module (the memory measurement copies the model) re-creates its quantized weights, and torch
# warns each time that quantized tensors are deprecated (torchao replaces them; see _quiet). Said once in the docs.
warnings.filterwarnings("ignore", message=r".*quantized tensor creation functions.*", category=UserWarning)


def quantized_engine() -> str | None:
    """x86 (fbgemm) on x86-64, qnnpack on ARM; None where this torch build has neither."""
    engines = torch.backends.quantized.supported_engines
    arm = platform.machine().lower() in ("aarch64", "arm64", "armv7l")
    for engine in (("qnnpack",) if arm else ("x86", "fbgemm")):
        if engine in engines:
            return engine
    return None


class FrozenBottom(nn.Module):
    """Frozen units run under no_grad, as one function of the input: nothing is saved for backward.

    The (possibly int8) network is held outside the module tree: it has no parameters that train,
    ``.to()``, ``state_dict()`` and the optimizer never see it, and a checkpoint holds the top only (its
    weights come from the pretrained model file, which the run's signature names)."""

    def __init__(self, net: nn.Module, int8: bool, float_units: Sequence[str] = ()) -> None:
        super().__init__()
        self.__dict__["net"] = net.eval()
        self.int8 = int8
        self.float_units = list(float_units)

    def forward(self, x: Tensor) -> Tensor:
        with torch.no_grad():
            # int8 kernels compute channels-last; the top trains in torch's default layout (channels-last
            # convolutions there take more scratch memory and time on CPU)
            return self.net(x).contiguous()

    def held_tensors(self) -> list[Tensor]:
        """The tensors the hidden network holds (edgeflux.memory counts them with the model's buffers): float
        parameters and buffers, and the int8 weights as their packed form holds them (int8 values, per-channel
        scales and zero points, float bias; read back with unpack(), so these are copies of the same size)."""
        out: list[Tensor] = []
        for m in self.net.modules():
            out += [*m.parameters(recurse=False), *m.buffers(recurse=False)]
            packed = getattr(m, "_packed_params", None)
            packed = getattr(packed, "_packed_params", packed)     # quantized Linear wraps it once more
            if packed is not None and hasattr(packed, "unpack"):
                out += [piece for t in packed.unpack() if isinstance(t, Tensor) for piece in _plain(t)]
        return out

    def extra_repr(self) -> str:
        return f"int8={self.int8}, float_units={self.float_units}"


def _plain(t: Tensor) -> list[Tensor]:
    if not t.is_quantized:
        return [t]
    if t.qscheme() in (torch.per_channel_affine, torch.per_channel_symmetric):
        return [t.int_repr(), t.q_per_channel_scales(), t.q_per_channel_zero_points()]
    return [t.int_repr()]


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    # torch.ao.quantization and quantized tensors warn that they are deprecated in favour of torchao (not
    # installed here, and not published for the Jetson/Pi torch builds); observers warn about reduce_range once
    # per layer. A torch without them fails in _quantize, and the bottom runs in float with a warning.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module=r"torch\.ao\..*")
        warnings.filterwarnings("ignore", message=r".*(torch\.ao\.quantization|quantized tensor creation).*")
        yield


def _quantize(module: nn.Module, batches: Sequence[Tensor], engine: str) -> nn.Module:
    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    torch.backends.quantized.engine = engine
    prepared = prepare_fx(copy.deepcopy(module).eval(), get_default_qconfig_mapping(engine),
                          example_inputs=(batches[0],))
    with torch.no_grad():
        for x in batches:
            prepared(x)
    return convert_fx(prepared)


def quantize_bottom(units: Sequence[tuple[str, nn.Module]], calibration: Sequence[Tensor],
                    device: torch.device | str = "cpu") -> FrozenBottom:
    """The frozen ``units`` (name, module) as one FrozenBottom, int8 where it can be, calibrated on ``calibration``
    (a few batches of the target data). The float modules are copied, never changed."""
    float_net = nn.Sequential(*(copy.deepcopy(m) for _, m in units)).eval().requires_grad_(False)
    engine = quantized_engine()
    why = ("the device is CUDA and quantized kernels run on CPU only" if torch.device(device).type != "cpu"
           else None if engine else f"torch {torch.__version__} has no x86/fbgemm/qnnpack quantized engine")
    if why:
        warnings.warn(f"the frozen bottom runs in float: {why}", stacklevel=2)
        return FrozenBottom(float_net, int8=False, float_units=[n for n, _ in units])
    with _quiet():
        try:
            return FrozenBottom(_quantize(float_net, calibration, engine), int8=True)
        except Exception as exc:   # noqa: BLE001 - any tracing/quantization failure falls back unit by unit
            log.info("quantizing the bottom as one graph failed (%s); trying unit by unit", exc)
        parts, floats, x = [], [], list(calibration)
        for (name, _), module in zip(units, float_net):
            try:
                part = _quantize(module, x, engine)
            except Exception:      # noqa: BLE001 - this unit stays in float
                part = module
                floats.append(name)
            with torch.no_grad():
                x = [module(b) for b in x]
            parts.append(part)
    if floats:
        warnings.warn(f"units {', '.join(floats)} of the frozen bottom could not be quantized and run in float",
                      stacklevel=2)
    return FrozenBottom(nn.Sequential(*parts), int8=len(floats) < len(parts), float_units=floats)
