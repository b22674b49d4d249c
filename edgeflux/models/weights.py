"""Load a torchvision state_dict file into a unit model, by structural correspondence.

No download ever happens here: the user saves the file once, on a machine with internet, with
`torch.save(torchvision.models.<name>(weights="DEFAULT").state_dict(), path)`.

Correspondence: both state_dicts are grouped by owning module (in registration order, which
is forward order for these architectures), each module is sorted into conv / bn / linear by
its tensors, and the i-th conv of our model is paired with the i-th conv of the source (the
same for bn and linear). A tensor is copied when its shape matches; otherwise it is skipped
with the reason. This maps torchvision's ImageNet VGG/ResNet onto the CIFAR-style ones:
the 7x7 ResNet stem and the 4096-wide VGG MLP do not match in shape and are reported.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger(__name__)

_KINDS = ("conv", "bn", "linear")


HOW_TO_SAVE = "torch.save(torchvision.models.{name}(weights='DEFAULT').state_dict(), '{file}')"


class WeightsError(ValueError):
    """A weights file that cannot be loaded (strictly, for arch: torchvision) into the architecture it was named for."""


class WeightsFileNotFoundError(WeightsError, FileNotFoundError):
    """The torchvision weights file the user pointed at is not there."""


def _group(state: Mapping[str, torch.Tensor]) -> dict[str, list[dict[str, str]]]:
    """Module groups {local name: full key} per kind, in order; unclassifiable modules under 'other'."""
    modules: dict[str, dict[str, str]] = {}
    for key in state:
        prefix, _, local = key.rpartition(".")
        modules.setdefault(prefix, {})[local] = key
    groups: dict[str, list[dict[str, str]]] = {k: [] for k in (*_KINDS, "other")}
    for keys in modules.values():
        groups[_kind(state, keys)].append(keys)
    return groups


def _kind(state: Mapping[str, torch.Tensor], keys: dict[str, str]) -> str:
    if "running_mean" in keys:
        return "bn"
    weight = keys.get("weight")
    if weight is None:
        return "other"
    return {4: "conv", 2: "linear"}.get(state[weight].ndim, "other")


def read_state_dict(path: Path, name: str = "<name>") -> dict[str, torch.Tensor]:
    """The file's state_dict, or one line naming what is wrong with the file and how to make the right one
    (``name``: the torchvision architecture the file should be of)."""
    how = HOW_TO_SAVE.format(name=name, file=path.name)
    if not path.is_file():
        raise WeightsFileNotFoundError(f"no weights file at {path}: edgeflux never downloads weights; on a machine "
                                       f"with internet run {how} and place the .pth file at {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:   # truncated, not a torch file, or a pickled nn.Module (refused by weights_only)
        raise WeightsError(f"{path} cannot be read as a state_dict ({type(e).__name__}: "
                           f"{str(e).splitlines()[0][:120]}); make it with {how}") from None
    if not isinstance(state, Mapping) or not state or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise WeightsError(f"{path} does not hold a state_dict (a mapping of tensor names to tensors); "
                           f"make it with {how}")
    return dict(state)


def load_torchvision_weights(model: nn.Module, path: str | Path) -> dict:
    """Copy the tensors of a torchvision state_dict file into `model` where shapes match.

    Returns {"loaded": [our keys copied], "skipped": [(our key, reason)], "missing": [our keys
    with no counterpart in the file], "unused": [file keys nothing was paired with]}.
    """
    path = Path(path)
    source = read_state_dict(path)
    target = model.state_dict()  # detached tensors sharing storage with the model: copy_ writes through
    ours, theirs = _group(target), _group(source)
    loaded: list[str] = []
    skipped: list[tuple[str, str]] = []
    missing: list[str] = []
    unused: list[str] = [k for keys in theirs["other"] for k in keys.values()]
    missing += [k for keys in ours["other"] for k in keys.values()]
    with torch.no_grad():
        for kind in _KINDS:
            for i, mine in enumerate(ours[kind]):
                src = theirs[kind][i] if i < len(theirs[kind]) else {}
                for local, key in mine.items():
                    src_key = src.get(local)
                    if src_key is None:
                        missing.append(key)
                        continue
                    s, t = source[src_key], target[key]
                    if s.shape != t.shape:
                        skipped.append(
                            (key, f"shape mismatch: source {src_key} {tuple(s.shape)} vs model {tuple(t.shape)}")
                        )
                        continue
                    t.copy_(s)
                    loaded.append(key)
                unused += [k for local, k in src.items() if local not in mine]
            unused += [k for keys in theirs[kind][len(ours[kind]) :] for k in keys.values()]

    log.info(
        "loaded %d tensors from %s (%d skipped, %d missing, %d unused in the file)",
        len(loaded), path, len(skipped), len(missing), len(unused),
    )
    for key, reason in skipped:
        log.info("skipped %s: %s", key, reason)
    if not loaded:
        log.warning("nothing from %s matched the model: is it the same architecture and width?", path)
    return {"loaded": loaded, "skipped": skipped, "missing": missing, "unused": unused}
