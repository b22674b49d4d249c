"""Every paper's headline beside edgeflux's measured figure: one table, made from the committed results (the
``targets`` of bench/results/<name>.json) and written into docs/benchmarks.md between its two markers.

A headline names the paper's claim as the paper states it (its figure and setting, quoted from
../shared/papers) and the targets of one benchmark that test it. Each target row brings its own figure: the
mean over seeds with the 95% interval (Student's t) of the per-seed values and the verdict judged from that
interval (bench.common.target). Results of one seed carry no interval: their verdict reads "not judged
(one seed)", whatever that seed measured.

    python -m bench.headlines            # rewrite the table in docs/benchmarks.md
    python -m bench.headlines --check    # exit 1 when docs/benchmarks.md's table is not what the results say
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.common import RESULTS_DIR, markdown_table

DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
START, END = "<!-- headlines: made by python -m bench.headlines -->", "<!-- headlines: end -->"


@dataclass(frozen=True)
class Headline:
    paper: str
    claim: str        # the paper's figure and setting, as the paper states them
    bench: str        # bench/results/<bench>.json
    prefix: str       # its targets whose text starts with this (the model may come first, as "vgg16-w0.25: ")
    also: tuple[str, ...] = ()   # more results files the same targets are read from (another workload's)


HEADLINES = (
    Headline("NeuroFlux", "trains under GPU memory budgets too small for backprop (CIFAR-10/100, Tiny ImageNet; "
             "Jetson and GPUs)", "neuroflux", "trains where backprop cannot"),
    Headline("NeuroFlux", "2.3x to 6.1x faster than backprop for the same memory budget",
             "neuroflux", "time to target, speed-up over backprop"),
    Headline("NeuroFlux", "3.3x to 10.3x faster than classic local learning for the same memory budget",
             "neuroflux", "time to target, speed-up over classic LL"),
    Headline("NeuroFlux", "early-exit models with 10.9x to 29.4x fewer parameters, accuracy not sacrificed",
             "neuroflux", "compact model"),
    Headline("BitTrain", "bitmap storage = 4 bytes x non-zeros + 1 bit x elements (Table 1)",
             "bittrain", "achieved bitmap bytes"),
    Headline("BitTrain", "up to 34% less memory at 50% activation sparsity; 18-53% less training memory overall "
             "(image classification CNNs)", "bittrain", "memory below plain autograd"),
    Headline("BitTrain", "pruning: more than 70% sparsity, up to 56% less activation memory (abstract, Section 4)",
             "bittrain", "pruning"),
    Headline("BitTrain", "safe by construction: no negative impact on accuracy", "bittrain", "exact storage"),
    Headline("BitTrain", "pruning's accuracy cost varies by model: a memory-accuracy trade-off (Figure 10, "
             "CIFAR-10)", "bittrain", "approximate storage"),
    Headline("BitTrain", "negligible computational overhead (Section 1)", "bittrain", "step-time overhead"),
    Headline("MobileTL", "46.3% less stored activation in a MobileNetV2 IRB, 53.3% in a MobileNetV3 IRB (Figure 1, "
             "expansion 6)", "mobiletl", "saved activations below the vanilla block"),
    Headline("MobileTL", "MobileTL-3BLKs 0.47 and 1.13 points above FT-3BLKs (CIFAR-10, CIFAR-100; Proxyless, "
             "224 px)", "mobiletl", "MobileTL-3BLKs minus FT-3BLKs", ("mobiletl_realistic",)),
    Headline("MobileTL", "16.7% less memory than FT-3BLKs (Table 3: 33.7 vs 40.5 MB, Proxyless, CIFAR-100)",
             "mobiletl", "MobileTL-3BLKs' peak below", ("mobiletl_realistic",)),
    Headline("MobileTL", "5 blocks: 0.6 points below FT-All with 36% fewer FLOPs (MobileNetV3, CIFAR-10)",
             "mobiletl", "MobileTL-5BLKs", ("mobiletl_realistic",)),
    Headline("MobileTL", "1.82x lower step latency than FT-All on a Raspberry Pi 4 (Table 6, batch 8, 224 px)",
             "mobiletl", "step latency", ("mobiletl_realistic",)),
    Headline("ElasticTrainer", "rho = 0.5 asks for 2x faster training steps; up to 3.5x more speed-up than existing "
             "schemes without noticeable accuracy loss (Jetson TX2, Raspberry Pi; 12 epochs)",
             "elastic", "training steps' speed-up", ("elastic_realistic",)),
    Headline("ElasticTrainer", "wall-clock speed-up of the whole fine-tuning, accuracy loss not noticeable",
             "elastic", "end-to-end speed-up", ("elastic_realistic",)),
    Headline("ElasticTrainer", "no noticeable accuracy loss at rho = 0.5 (Figures 15-17)",
             "elastic", "test accuracy minus full training's", ("elastic_realistic",)),
    Headline("ElasticTrainer", "no noticeable accuracy loss for rho >= 40%, up to 3x faster; noticeable at 35% "
             "(Figure 17: ResNet50, CUB-200, Jetson TX2)", "elastic", "rho sweep"),
    Headline("ElasticTrainer", "profiling and importance cost under 1% of training (Table 1, Section 4)",
             "elastic", "selection overhead", ("elastic_realistic",)),
    Headline("ElasticTrainer", "time-to-accuracy 1.67x to 2.94x better than the best existing scheme (Table 2)",
             "elastic", "time to", ("elastic_realistic",)),
    Headline("ElasticTrainer", "the tensor time model predicts a selection's training time (Section 5)",
             "elastic", "time model", ("elastic_realistic",)),
    Headline("MEANet", "edge-cloud several points above the edge alone, sending 15-28% of instances to the cloud "
             "(Figs. 7-8; ImageNet, CIFAR-100)", "meanet", "edge-cloud minus the edge alone"),
    Headline("MEANet", "edge-cloud close to cloud-only accuracy at a fraction of the instances sent",
             "meanet", "edge-cloud minus cloud-only"),
    Headline("MEANet", "the extension block lifts the hard classes (Table II; model B: four residual blocks on "
             "ImageNet)", "meanet", "hard-class gain", ("meanet_blocks",)),
    Headline("MEANet", "edge training needs far less memory than training the whole network (Fig. 6)",
             "meanet", "training peak saved"),
)


def _number(value) -> str:
    return "" if value is None else f"{value:.3g}"


def figure(t: dict) -> tuple[str, str, str]:
    """(the measured figure, seeds, verdict) of a target row, in either shape the results files use."""
    if "verdict" in t:       # bench.common.target: the mean, its interval, the verdict
        interval = "" if t["lo"] is None or t["lo"] == t["hi"] else f" [{_number(t['lo'])}, {_number(t['hi'])}]"
        return _number(t["mean"]) + interval, "exact" if t["n_seeds"] is None else str(t["n_seeds"]), t["verdict"]
    said = {True: "the seed met it", False: "the seed missed it"}.get(t.get("met"), "reported")
    return t["measured"], "1", f"not judged (one seed; {said})"


def label(t: dict) -> tuple[str, str]:
    """(model, target text) of a target row: its model (and MEANet's variant, NeuroFlux's budget) fields, or a one-word
    "model: " prefix of its text (the one-seed results' shape)."""
    if "model" in t:
        return " ".join(str(t[k]) for k in ("model", "variant", "budget") if k in t), t["target"]
    head, sep, rest = t["target"].partition(": ")
    return (head, rest) if sep and " " not in head else ("", t["target"])


def rows(results: Path = RESULTS_DIR) -> list[dict]:
    """The table: one row per (headline, target that tests it), in HEADLINES' order."""
    out, cache = [], {}
    for h, bench in ((headline, b) for headline in HEADLINES for b in (headline.bench, *headline.also)):
        data = cache.setdefault(bench, json.loads((results / f"{bench}.json").read_text()))
        for t in data.get("targets", []):
            model, text = label(t)
            if not text.startswith(h.prefix):
                continue
            measured, seeds, verdict = figure(t)
            out.append({"paper": h.paper, "claim": h.claim, "target": text, "model": model, "figure": measured,
                        "seeds": seeds, "verdict": verdict, "results": f"bench/results/{bench}.md"})
    return out


def table(results: Path = RESULTS_DIR) -> str:
    columns = {"paper": "paper", "claim": "the paper's headline (its setting)", "target": "edgeflux's target",
               "model": "model", "figure": "edgeflux's figure [95% interval]", "seeds": "seeds",
               "verdict": "verdict", "results": "results"}
    return markdown_table(rows(results), columns)


def rewritten(doc: str, made: str) -> str:
    if START not in doc or END not in doc:
        raise SystemExit(f"{DOC}: no {START} ... {END} markers; put them where the table goes")
    head, rest = doc.split(START, 1)
    return head + START + "\n" + made + "\n" + END + rest.split(END, 1)[1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.headlines", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only check docs/benchmarks.md; exit 1 if it differs")
    args = parser.parse_args(argv)
    doc = DOC.read_text()
    new = rewritten(doc, table())
    if args.check:
        if new != doc:
            print(f"{DOC} does not show what bench/results say: run python -m bench.headlines", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(new)
    print(f"wrote the headline table ({len(rows())} rows) into {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
