"""Trained models as files a device runs without edgeflux: ONNX (for onnxruntime) and TorchScript or torch.export.

    checked = export_model(model, example, Path("models/export"), "train_bp", card, exporter="torchscript")

traces the model once, writes the trace as ``<name>.ts`` (TorchScript: ``torch.jit.load``, also from LibTorch and
the older PyTorch a JetPack brings) or ``<name>.pt2`` (``exporter="dynamo"``: ``torch.export.load(path).module()``),
and converts the same trace to ``<name>.onnx`` with torch's ONNX exporter, a batch dimension of any size. Each file
is then run on ``example`` (the test split's first batch) and its logits compared with the PyTorch model's: a
difference above ``TOLERANCE`` is an ExportCheckError, and nothing of that model is left behind. ``<name>.json``
beside them says what a device needs to feed the model (input shape, the normalisation the training used, the
classes) and what was measured (accuracy, the checks).

Why TorchScript by default, though torch marks it deprecated in favour of torch.export: on 2 CPU cores the
torch.export-based ONNX exporter took 17-25 s per MobileNetV2 (its decompositions re-trace the program with symbolic
shapes), the TorchScript one 2 s, and a device exports every method's model after training. ``dynamo`` is the
path for a torch that has dropped TorchScript.
"""
from __future__ import annotations

import hashlib
import logging
import os
import warnings
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from edgeflux.artifacts import atomic_write, write_json
from edgeflux.errors import UserError
from edgeflux.models.units import eval_mode

log = logging.getLogger(__name__)

TOLERANCE = 1e-4     # max |logit difference| allowed between an exported file and the PyTorch model (float32)
OPSET = 18           # the ONNX opset torch's exporter targets by default; onnxruntime 1.16+ runs it
EXPORTERS = ("torchscript", "dynamo")
TRACE_SUFFIX = {"torchscript": ".ts", "dynamo": ".pt2"}
SUFFIXES = (".onnx", ".ts", ".pt2", ".json")


class ExportCheckError(RuntimeError, UserError):
    """An exported file computes other logits than the PyTorch model it came from."""


def export_model(model: nn.Module, example: torch.Tensor, out_dir: Path, name: str, card: dict[str, Any],
                 exporter: Literal[EXPORTERS] = "torchscript") -> dict:
    """``model`` as ``out_dir/<name>.{onnx,ts|pt2,json}``, each file checked on ``example``; returns the checks.

    ``card``: what the sidecar JSON says of the model besides the checks (classes, normalisation, accuracy)."""
    out_dir = Path(out_dir)
    model, example = model.cpu(), example.cpu().float()
    onnx_path, trace_path = out_dir / f"{name}.onnx", out_dir / f"{name}{TRACE_SUFFIX[exporter]}"
    remove_export(out_dir, name)   # the other exporter's trace, from an earlier run
    try:
        with eval_mode(model), torch.no_grad(), warnings.catch_warnings():
            # TorchScript's deprecation notices: the module docstring says why it is the default
            warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.(jit|onnx)")
            warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\.(jit|onnx)")
            expected = model(example)
            trace = _trace(model, example[:2], exporter)   # a short trace: the batch dimension is left free
            atomic_write(trace_path, lambda tmp: _save_trace(trace, tmp, exporter))
            atomic_write(onnx_path, lambda tmp: _write_onnx(trace, example[:2], tmp, exporter))
            checks = {"batch": len(example), "tolerance": TOLERANCE, "exporter": exporter,
                      "onnx_max_abs_diff": _max_diff(run_onnx(onnx_path, example), expected),
                      "trace_max_abs_diff": _max_diff(_load_trace(trace_path, exporter)(example), expected)}
        for what, file in (("onnx", onnx_path), ("trace", trace_path)):
            if not checks[f"{what}_max_abs_diff"] <= TOLERANCE:
                raise ExportCheckError(f"{name}: {file.name}'s logits differ from PyTorch's by "
                                       f"{checks[f'{what}_max_abs_diff']:.3g} (> {TOLERANCE:g}) on the test split's "
                                       f"first batch; the exporter translates one of the model's operations wrongly: "
                                       f"try export.exporter: {EXPORTERS[exporter == EXPORTERS[0]]}")
    except BaseException:
        remove_export(out_dir, name)   # a failed check leaves no file a device could pick up
        raise
    _write_card(out_dir, name, card, checks, example.shape[1:], int(expected.shape[1]), (onnx_path, trace_path))
    log.info("export %s: ONNX max |Δlogit| %.2g, %s %.2g (tolerance %g)", name, checks["onnx_max_abs_diff"],
             trace_path.suffix, checks["trace_max_abs_diff"], TOLERANCE)
    return checks


def _write_card(out_dir: Path, name: str, card: dict, checks: dict, shape, classes: int, files) -> None:
    write_json(out_dir / f"{name}.json", {
        "name": name, **card, "check": checks, "onnx_opset": OPSET, "torch": torch.__version__.split("+")[0],
        "files": {p.suffix.lstrip("."): {"file": p.name, "sha256": _sha256(p), "bytes": p.stat().st_size}
                  for p in files},
        "input": {"name": "images", "shape": ["batch", *shape], "dtype": "float32", "layout": "NCHW",
                  "pixels": "RGB or gray in [0, 1] (uint8 / 255), then (x - mean) / std per channel"},
        "output": {"name": "logits", "shape": ["batch", classes]}})


def _trace(model: nn.Module, example: torch.Tensor, exporter: str):
    if exporter == "dynamo":
        return torch.export.export(model, (example,), dynamic_shapes=({0: torch.export.Dim("batch")},))
    return torch.jit.trace(model, (example,), check_trace=False)   # export_model checks the saved file instead


def _save_trace(trace, path: Path, exporter: str) -> None:
    with path.open("wb") as f:   # a file object: torch.export names an archive by its suffix, and tmp's is .tmp
        (torch.export.save if exporter == "dynamo" else torch.jit.save)(trace, f)


def _load_trace(path: Path, exporter: str):
    return torch.export.load(str(path)).module() if exporter == "dynamo" else torch.jit.load(str(path))


def _write_onnx(trace, example: torch.Tensor, path: Path, exporter: str) -> None:
    names = {"input_names": ["images"], "output_names": ["logits"], "opset_version": OPSET}
    if exporter == "dynamo":
        torch.onnx.export(trace, (example,), dynamo=True, verbose=False, **names).save(str(path))
    else:
        torch.onnx.export(trace, (example,), str(path), dynamo=False, **names,
                          dynamic_axes={"images": {0: "batch"}, "logits": {0: "batch"}})


def run_onnx(path: Path, images: torch.Tensor) -> torch.Tensor:
    """The ONNX file's logits for ``images`` in onnxruntime (CPU), as a device would run it."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = max(1, len(os.sched_getaffinity(0)))
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, {session.get_inputs()[0].name: images.numpy()})
    return torch.from_numpy(logits)


def _max_diff(got: torch.Tensor, expected: torch.Tensor) -> float:
    if got.shape != expected.shape:
        return float("inf")
    return float((got.detach().float() - expected.float()).abs().max())


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def remove_export(out_dir: Path, name: str) -> None:
    for suffix in SUFFIXES:
        (Path(out_dir) / f"{name}{suffix}").unlink(missing_ok=True)
