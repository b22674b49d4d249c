"""Deterministic, class-stratified splits of a dataset's images: train/val/test and the source_*/target_*
splits of transfer learning, all drawn from one seed (see prepare())."""

from __future__ import annotations

import torch

from edgeflux.errors import UserError


class DataParamsError(ValueError, UserError):
    """A data.* setting does not work for this dataset (named in the message: the user's to fix)."""


def make_splits(
    train_labels: torch.Tensor,
    labels: torch.Tensor,
    val_fraction: float,
    seed: int,
    split_by: str,
    source_fraction: float,
    source_classes: list[int] | None,
    given_val: int = 0,
) -> dict[str, torch.Tensor]:
    """Index tensors of every split into `labels` (train images first, then test); see prepare().

    One generator seeded with `seed` draws every permutation in a fixed order, so a seed names the splits.
    given_val > 0: the last given_val training images are the dataset's own validation set (imagefolder's val/),
    taken as the val split instead of carving val_fraction.
    """
    n_train = len(train_labels)
    n_test = len(labels) - n_train
    gen = torch.Generator().manual_seed(seed)
    if given_val:
        train = torch.randperm(n_train - given_val, generator=gen)
        val = n_train - given_val + torch.randperm(given_val, generator=gen)
    else:
        val, train = stratified_pick(torch.arange(n_train), train_labels, val_fraction, gen)
    test = n_train + torch.randperm(n_test, generator=gen)
    if len(train) == 0 or len(val) == 0:
        raise DataParamsError(f"data.val_fraction={val_fraction} leaves an empty train or val split ({n_train} images)")
    splits = {"train": train, "val": val, "test": test}
    if split_by == "data":
        for part in ("train", "val"):
            idx = splits[part]
            splits[f"source_{part}"], splits[f"target_{part}"] = stratified_pick(
                idx, labels[idx], source_fraction, gen
            )
        splits["source_test"], splits["target_test"] = test.clone(), test.clone()
    elif split_by == "classes":
        wanted = torch.tensor(source_classes, dtype=torch.int64)
        for part in ("train", "val", "test"):
            idx = splits[part]
            in_source = torch.isin(labels[idx], wanted)
            splits[f"source_{part}"], splits[f"target_{part}"] = idx[in_source], idx[~in_source]
    else:
        for part in ("train", "val", "test"):
            splits[f"source_{part}"], splits[f"target_{part}"] = splits[part].clone(), splits[part].clone()
    for part in ("source_train", "target_train"):
        if len(splits[part]) == 0:
            raise DataParamsError(f"split {part!r} is empty: adjust source_fraction / source_classes")
    return splits


def stratified_pick(
    idx: torch.Tensor, labels: torch.Tensor, fraction: float, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split `idx` into (picked, rest), picking `fraction` of every class; both shuffled.

    Per class floor(n_c * fraction) images, plus one more for the classes with the largest
    remainders until the total is round(n * fraction): every class within one image of exact,
    and the total exact too.
    """
    if len(idx) == 0:
        return idx.clone(), idx.clone()
    classes, counts = torch.unique(labels, return_counts=True)
    exact = counts.double() * fraction
    take = exact.floor().long()
    short = round(len(idx) * fraction) - int(take.sum())
    if short > 0:  # ties go to the lower class id (stable sort): deterministic
        order = torch.argsort(exact - take, descending=True, stable=True)
        take[order[:short]] += 1
    picked, rest = [], []
    for c, k in zip(classes.tolist(), take.tolist()):
        members = idx[labels == c]
        members = members[torch.randperm(len(members), generator=gen)]
        picked.append(members[:k])
        rest.append(members[k:])
    picked_t, rest_t = torch.cat(picked), torch.cat(rest)
    return (
        picked_t[torch.randperm(len(picked_t), generator=gen)],
        rest_t[torch.randperm(len(rest_t), generator=gen)],
    )
