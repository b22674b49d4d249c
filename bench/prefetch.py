"""Where NeuroFlux's batch reader decodes shards: training step time with and without prefetching.

A block reads its input in shards (`edgeflux.neuroflux.cache.Batches`): block 0 the dataset
(uint8 images, normalised to float32 as read), later blocks the previous block's activation
cache (float16 or bitmap shards on disk). Three ways to read, same batches in the same order:

- no prefetch: each shard is read, checked and decoded on the training thread when needed;
- prefetch, decode there: a background thread reads, checks and decodes (torch.load, dtype
  conversion, decompression, normalising) two shards ahead;
- prefetch, fetch only: the thread reads and checks bytes only; the training thread decodes
  (what edgeflux does: torch ops on a second thread slow every step on a 2-core CPU).

Each case trains a model on the batches (SGD, one step per batch); the figure is ms per step,
the fastest of the repetitions (interleaved, so drifts hit every variant alike), and its ratio
to "no prefetch" measured in the same run.

    python -m bench.prefetch                  # full run, results in bench/results/prefetch.{json,md}
    python -m bench.prefetch --quick --out /tmp/bench
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from torch import nn

from bench.common import BenchResult, bench_argparser
from edgeflux.data import load_raw, prepare, tensors
from edgeflux.models import build_model
from edgeflux.neuroflux.cache import ActivationCache, Batches, CacheWriter, TensorSource

NAME = "prefetch"
FULL = {"samples": 12_800, "steps": 100, "reps": 3}
QUICK = {"samples": 1_024, "steps": 6, "reps": 1}
SHARD_BYTES = 4 * 2**20   # params.yaml neuroflux.cache.shard_size


class DecodeOnPrefetchThread:
    """A source whose fetch does the whole read, so Batches' thread decodes (the old behaviour)."""

    def __init__(self, source) -> None:
        self.source = source

    def __getattr__(self, name):
        return getattr(self.source, name)

    def fetch_shard(self, i: int):
        return self.source.read_shard(i)

    def decode_shard(self, i: int, fetched):
        return fetched


VARIANTS = {"no prefetch": (lambda s: s, 0), "prefetch, decode there": (DecodeOnPrefetchThread, 2),
            "prefetch, fetch only": (lambda s: s, 2)}


def head(channels: int) -> nn.Module:
    """A later block: two 3x3 convolutions and a linear classifier (what trains on a cache)."""
    return nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(4 * channels, 10))


def cases(images, labels, workdir: Path) -> list[tuple[str, object, nn.Module, int]]:
    """(name, source, model, batch): block 0 on the dataset, and a later block on two kinds of cache."""
    per_image = images.shape[1] * images.shape[2] * images.shape[3] * 4
    out = [("dataset, uint8 images (VGG-16 w0.25)", TensorSource(images, labels, SHARD_BYTES // per_image),
            build_model("vgg16", width=0.25, in_channels=1, num_classes=10, seed=0), 68)]
    torch.manual_seed(0)
    first = nn.Sequential(nn.Conv2d(1, 32, 3, stride=2, padding=1), nn.ReLU()).eval()  # outputs 32x16x16
    for storage in ("float16", "bittrain"):
        directory = workdir / storage
        with CacheWriter(directory, "bench", (32, 16, 16), storage=storage,
                         shard_samples=SHARD_BYTES // (32 * 16 * 16 * 4)) as writer, torch.no_grad():
            for i in range(0, len(labels), 512):
                writer.append(first(images[i:i + 512]), labels[i:i + 512])
        torch.manual_seed(0)
        out.append((f"{storage} cache, 32x16x16 (two-conv block)", ActivationCache.open(directory, "bench"),
                    head(32), 125))
    return out


def time_steps(source, model: nn.Module, batch: int, prefetch: int, steps: int) -> tuple[float, int]:
    """ms per training step over `steps` batches (after one warm-up batch), and a checksum of the labels seen."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    seen, n, start = 0, 0, None
    for xb, yb in Batches(source, batch, shuffle=True, seed=0, prefetch=prefetch):
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(xb), yb).backward()
        optimizer.step()
        seen += int((yb * torch.arange(1, len(yb) + 1)).sum())
        if start is None:
            start = time.perf_counter()
            continue
        n += 1
        if n == steps:
            break
    return (time.perf_counter() - start) / n * 1e3, seen


def main(argv=None) -> None:
    parser = bench_argparser(__doc__)
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    if args.threads:
        torch.set_num_threads(args.threads)
    images, labels = tensors(prepare(load_raw("fashion-mnist"), image_size=32), "train", limit=cfg["samples"])
    rows = []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with tempfile.TemporaryDirectory() as tmp, Progress(*columns) as progress:
        all_cases = cases(images, labels, Path(tmp))
        task = progress.add_task("prefetch", total=len(all_cases) * cfg["reps"] * len(VARIANTS))
        for name, source, model, batch in all_cases:
            times = {v: [] for v in VARIANTS}
            checks = {v: set() for v in VARIANTS}
            for _ in range(cfg["reps"]):
                for v, (wrap, prefetch) in VARIANTS.items():
                    ms, seen = time_steps(wrap(source), model, batch, prefetch, cfg["steps"])
                    times[v].append(ms)
                    checks[v].add(seen)
                    progress.advance(task)
            base = min(times["no prefetch"])
            same = len(set.union(*checks.values())) == 1
            for v in VARIANTS:
                rows.append({"case": name, "variant": v, "batch": batch, "threads": torch.get_num_threads(),
                             "ms_per_step": min(times[v]), "ms_per_step_all": times[v],
                             "ratio_to_no_prefetch": min(times[v]) / base, "same_batches": same})
    result = BenchResult()
    for r in rows:
        result.add(**r)
    md_rows = [{**r, "ms_per_step": f"{r['ms_per_step']:.1f}", "ratio_to_no_prefetch": f"x{r['ratio_to_no_prefetch']:.3f}"}
               for r in rows]
    notes = (f"{cfg['steps']} training steps per measurement after one warm-up batch, {cfg['reps']} interleaved "
             f"repetitions, fastest shown (all in the JSON). Fashion-MNIST training images at 32x32 "
             f"({cfg['samples']} of them), shards of {SHARD_BYTES // 2**20} MiB in float32 as in params.yaml. "
             "same batches: every variant trained on the same labels in the same order (a checksum).")
    json_path, md_path = result.write(
        NAME, args.out, title="Batch reading: where shards are decoded, and the training step time",
        columns={"case": "case", "variant": "variant", "batch": "batch", "threads": "torch threads",
                 "ms_per_step": "ms/step", "ratio_to_no_prefetch": "vs no prefetch", "same_batches": "same batches"},
        notes=notes, md_rows=md_rows, extra={"config": cfg})
    print(md_path.read_text())
    print(f"wrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
