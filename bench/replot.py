"""Draw the benchmarks' committed figures again from their committed JSON, with the plotting code as it is
now: after a change to a figure's code (or to edgeflux.colours), without rerunning the measurements.

Each figure here is drawn from bench/results/<name>.json alone; tests/test_figures.py draws every one and
checks the mechanical rules (edgeflux.figcheck). Figures whose data the JSON does not hold (ElasticTrainer's
selections, MEANet's sweeps, the GPU runs) are drawn only by their
benchmark.

    python -m bench.replot                     # every figure below, into bench/results/
    python -m bench.replot budget mobiletl --out /tmp/figs
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from functools import partial
from pathlib import Path

from bench.common import RESULTS_DIR


def _bittrain(d: dict, out: Path) -> None:
    from bench.bittrain import plot_panels
    from edgeflux.report import plot_bar_panels
    plot_bar_panels(plot_panels(d["rows"], d["per_seed"]["accuracy"], d["config"]["batch"],
                                d["config"]["acc_steps"]), out / "bittrain.png",
                    title=d["title"])


def _budget(d: dict, out: Path) -> None:
    from bench.budget import plot
    plot(d["rows"], out / "budget.png")


def _accumulate(d: dict, out: Path) -> None:
    from bench.accumulate import plot
    plot(d["rows"], out / "accumulate.png")


def _mobiletl(d: dict, out: Path, name: str = "mobiletl") -> None:
    from bench.mobiletl import plot
    plot(d["rows"], out / f"{name}.png", d["settings"]["block_size"])


def _elastic(d: dict, out: Path, name: str = "elastic") -> None:
    from bench.elastic import plot, plot_rho
    plot(d["curves"], d["settings"]["seeds"][0], out / f"{name}.png")
    if len(d["settings"]["rhos"]) > 1:
        plot_rho(d["per_seed"], out / f"{name}_rho.png")


def _meanet_blocks(d: dict, out: Path) -> None:
    from bench.meanet_blocks import plot
    plot(d["per_seed"], out / "meanet_blocks.png")


def _neuroflux(d: dict, out: Path) -> None:
    from bench.neuroflux import plot, plot_exits
    settings = d["settings"][0] if isinstance(d["settings"], list) else d["settings"]
    plot(d["per_seed"], out / "neuroflux.png", settings["target_acc"])
    plot_exits(d["per_seed"], out / "neuroflux_exits.png")


def _pipeline(d: dict, out: Path) -> None:
    from bench.pipeline import plot
    plot(d, d["stages"], out / "pipeline.png")


def _servers(d: dict, out: Path) -> None:
    from bench.servers import plot
    plot(d["rows"], out / "servers.png")


def _plan(d: dict, out: Path) -> None:
    from bench.plan import plot
    plot(d.get("per_repeat") or d["rows"], out / "plan.png")   # each repeat's predictions, where kept


def _realistic(d: dict, out: Path) -> None:
    from bench.realistic import plot
    plot(d["rows"], out / "realistic.png")


def _memory_baseline(d: dict, out: Path) -> None:
    from bench.memory_baseline import plot
    plot(d["rows"], d["fits"], out / "memory_baseline.png")


def _batch_throughput(d: dict, out: Path) -> None:
    from bench.batch_throughput import plot
    plot(d["rows"], out / "batch_throughput.png", tuple(d["settings"]["batches"]), d["machine"].get("device", "cpu"))


def _tricks(d: dict, out: Path) -> None:
    from bench.tricks import plot
    plot(d["rows"], d["sections"][0]["rows"], out / "tricks.png")


def _meanet(d: dict, out: Path) -> None:
    from bench.meanet import plot_summary
    plot_summary(d["rows"], out / "meanet.png")


FIGURES: dict[str, Callable[[dict, Path], None]] = {
    "accumulate": _accumulate, "batch_throughput": _batch_throughput, "bittrain": _bittrain, "budget": _budget,
    "elastic": _elastic, "elastic_realistic": partial(_elastic, name="elastic_realistic"), "meanet": _meanet,
    "meanet_blocks": _meanet_blocks,
    "memory_baseline": _memory_baseline, "mobiletl": _mobiletl,
    "mobiletl_realistic": partial(_mobiletl, name="mobiletl_realistic"), "neuroflux": _neuroflux, "pipeline": _pipeline,
    "plan": _plan, "realistic": _realistic, "servers": _servers, "tricks": _tricks,
}


def replot(names: list[str], results: Path = RESULTS_DIR, out: Path = RESULTS_DIR) -> list[str]:
    """Draw the figures of ``names`` (bench/results/<name>.json each) into ``out``; the names drawn (a benchmark
    not run yet, without its JSON, is skipped)."""
    out.mkdir(parents=True, exist_ok=True)
    drawn = []
    for name in names:
        path = results / f"{name}.json"
        if path.exists():
            FIGURES[name](json.loads(path.read_text()), out)
            drawn.append(name)
    return drawn


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", metavar="NAME",
                        help=f"benchmarks whose figures to draw (default: all of {', '.join(FIGURES)})")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="where the figures go")
    args = parser.parse_args(argv)
    if unknown := [n for n in args.names if n not in FIGURES]:
        parser.error(f"no figure to draw again for {', '.join(unknown)}: choose from {', '.join(FIGURES)}")
    drawn = replot(args.names or list(FIGURES), out=args.out)
    print(f"drew {', '.join(drawn)} into {args.out}")


if __name__ == "__main__":
    main()
