"""Datasets for edgeflux: offline first, deterministic splits, one image layout for every model.

Two steps, matching the `prepare` stage:

1. `load_raw(name)` finds a dataset on disk (downloading only when asked) and returns it as
   uint8 NCHW tensors in its native size and channel count (a folder of photos, imagefolder:
   already at `image_size`, each file decoded straight to it).
2. `prepare(raw, ...)` brings every image to `image_size` x `image_size` with the requested
   channel count, carves deterministic, class-stratified splits (train/val/test plus the
   source/target splits used for transfer learning) and computes normalisation statistics on
   the train split (or takes ImageNet's). `save_prepared` / `load_prepared` move the result between stages;
   `tensors` and `batches` feed it to training loops.

Fashion-MNIST, the default, is found without network access where the Debian package
`dataset-fashion-mnist` is installed (/usr/share/datasets/fashion-mnist). Its idx files are
parsed in bulk with numpy, so loading all 70,000 images takes well under a second.

One module per job: `raw` (what a loader returns), `load` (raw datasets from disk), `imagefolder`
(a user's folder of photos, decoded straight to the final size), `images` (decoding, resizing and
converting images in bulk), `splits` (class-stratified splits from a seed), `preparation` (the
prepared dataset: conversion, splits, statistics, manifest), `store` (the prepared data on disk
between stages), `feed` (splits and batches for training) and `incoming` (new samples for
retraining). Everything public but `incoming` is importable from `edgeflux.data` itself.
"""
from edgeflux.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "feed": ["Batches", "Images", "augment_pixels", "batches", "tensors"],
    "images": ["LUMA_601", "to_gray"],
    "imagefolder": ["load_imagefolder"],
    "options": ["DATASETS", "DataParams"],
    "load": ["DEBIAN_FASHION_MNIST", "MNIST_SUBSET_SEED", "MNIST_SUBSET_TEST", "default_data_dir", "load_raw",
             "read_idx"],
    "raw": ["DatasetFormatError", "DatasetNotFoundError", "RawDataset"],
    "preparation": ["IMAGENET_MEAN", "IMAGENET_STD", "imagenet_stats", "prepare", "sha256_path"],
    "splits": ["DataParamsError"],
    "store": ["PreparedData", "PreparedDataError", "load_prepared", "save_prepared"],
})
