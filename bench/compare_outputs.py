"""Compare the pipeline's committed outputs at two git revisions: what changed besides wall-clock figures.

    python -m bench.compare_outputs REV_A REV_B            # every JSON value that differs
    python -m bench.compare_outputs REV_A REV_B --peaks    # every measured peak side by side (markdown)

Reads every stage's figures (every details/*.json either revision has, metrics/*.json before those existed),
memory/*.json, profile/memory.json, partition/blocks.json and reports/summary.json with `git show`, so
two `dvc repro` runs committed one after the other can be compared without checking either out. Times,
throughputs and process RSS/USS are left out: they move from run to run.
"""
from __future__ import annotations

import argparse
import json
import subprocess

FILES = ("metrics/pretrain.json", "metrics/train_bp.json", "metrics/profile.json", "metrics/partition.json",
         "metrics/train_blocks.json", "metrics/select_exit.json", "memory/train_bp.json", "profile/memory.json",
         "partition/blocks.json")
# wall-clock figures and what is computed from them (an energy is a power times a measured time; elastic's
# timing profile is measured backward times)
TIMING = ("time_s", "cpu_s", "seconds", "overhead", "throughput", "per_s", "latency", "rss", "uss", "speedup",
          "round_trip", "train_s", "energy_j", ".timing.")


def read(rev: str, path: str) -> dict:
    """A file at a revision. metrics/<stage>.json became the headline and every figure moved to
    details/<stage>.json: that is read where the revision has it, so old and new revisions compare."""
    if path.startswith("metrics/"):
        detail = subprocess.run(["git", "show", f"{rev}:details/{path.removeprefix('metrics/')}"],
                                capture_output=True, text=True)
        if detail.returncode == 0:
            return json.loads(detail.stdout)
    return json.loads(subprocess.run(["git", "show", f"{rev}:{path}"], check=True, capture_output=True, text=True).stdout)


def leaves(x, path: str = ""):
    if isinstance(x, dict):
        for k, v in x.items():
            yield from leaves(v, f"{path}.{k}" if path else k)
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from leaves(v, f"{path}[{i}]")
    else:
        yield path, x


def tracked(rev: str) -> set[str]:
    """The JSON files of a stage's figures that `rev` holds."""
    out = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, "details", "memory"], check=True,
                         capture_output=True, text=True).stdout.split()
    return {p for p in out if p.endswith(".json")}


def differences(a: str, b: str, stages: list[str] | None = None) -> None:
    same = diff = 0
    details = tracked(a) | tracked(b)
    files = [*FILES, *sorted(details - {f"details/{f.removeprefix('metrics/')}" for f in FILES} - set(FILES)),
             "reports/summary.json"]
    if stages:   # the files of these stages only (profile/memory.json: profile's, partition/blocks.json: partition's)
        files = [f for f in files if any(f"/{s}." in f or f"/{s}/" in f or f.startswith(f"{s}/") for s in stages)]
    for path in files:
        la, lb = (dict(leaves(_read_or_empty(rev, path))) for rev in (a, b))
        for key in sorted(set(la) | set(lb)):
            if any(t in key.lower() for t in TIMING):
                continue
            if la.get(key) == lb.get(key):
                same += 1
            else:
                diff += 1
                print(f"{path}: {key}: {la.get(key, '(absent)')} -> {lb.get(key, '(absent)')}")
    print(f"{same} values equal, {diff} differ (wall-clock figures left out)")


def _read_or_empty(rev: str, path: str) -> dict:
    try:
        return read(rev, path)
    except subprocess.CalledProcessError:   # a stage one revision does not have
        return {}


def peaks(a: str, b: str) -> None:
    rows = []
    for ua, ub in zip(read(a, "profile/memory.json")["units"], read(b, "profile/memory.json")["units"]):
        rows += [("profile", f"unit {ua['index']} {ua['name']}", n, x, y)
                 for n, x, y in zip(ua["batches"], ua["peak_bytes"], ub["peak_bytes"])]
    fa, fb = (dict(map(tuple, read(r, "memory/train_bp.json")["batch_fit"]["measurements"])) for r in (a, b))
    rows += [("train_bp", "measured batch", n, fa[n], fb[n]) for n in sorted(set(fa) & set(fb))]
    pa, pb = read(a, "metrics/pretrain.json"), read(b, "metrics/pretrain.json")
    rows += [("pretrain", key, pa[key]["batch_size"], pa[key]["peak_mem_bytes"], pb[key]["peak_mem_bytes"]) for key in pa]
    print(f"| stage | what | batch | {a} | {b} | change |\n|---|---|---|---|---|---|")
    for stage, what, n, x, y in rows:
        print(f"| {stage} | {what} | {n} | {x:,} | {y:,} | {100 * (y / x - 1):+.2f}% |")
    change = [100 * (y / x - 1) for *_, x, y in rows]
    print(f"\n{len(rows)} peaks measured at the same batch in both: {min(change):+.2f}% to {max(change):+.2f}%, "
          f"{sum(c < 0 for c in change)} lower, {sum(c == 0 for c in change)} equal")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.compare_outputs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", help="the earlier revision (e.g. a commit id)")
    parser.add_argument("b", help="the later revision (e.g. HEAD)")
    parser.add_argument("--peaks", action="store_true", help="the measured peaks side by side instead of every change")
    parser.add_argument("--stages", nargs="+", metavar="STAGE", help="compare these stages' files only")
    args = parser.parse_args()
    peaks(args.a, args.b) if args.peaks else differences(args.a, args.b, args.stages)


if __name__ == "__main__":
    main()
