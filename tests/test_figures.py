"""The figures edgeflux commits keep the mechanical rules of edgeflux.figcheck: no clipped or overlapping text,
no legend over data, each method in its one colour (edgeflux.colours) in every figure. The report's figures
are drawn from the workspace's committed stage outputs, the benchmarks' from their committed JSON
(bench.replot), each with the plotting code as it is now."""
from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _problems(found: dict[str, list[str]]) -> dict[str, list[str]]:
    return {Path(path).name: problems for path, problems in found.items() if problems}


def test_the_checker_finds_clipped_overlapping_covering_and_miscoloured():
    """Each rule, broken once on purpose, is reported (and a figure that keeps them gives nothing)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from edgeflux.colours import method_colour
    from edgeflux.figcheck import figure_problems

    fig, ax = plt.subplots(figsize=(4, 3), layout="constrained")
    ax.plot([0, 1], [0, 1], color=method_colour("MobileTL"), label="MobileTL")
    ax.legend(loc="lower right")
    assert figure_problems(fig) == []
    ax.set_title("a title much too long for a figure four inches wide, so it runs off both of its edges")
    ax.annotate("one label", (0.5, 0.5))
    ax.annotate("one label too", (0.5, 0.5))
    ax.plot([0.05, 0.95], [0.05, 0.05], color=method_colour("FT-All"), label="FT-All")   # under the legend
    ax.plot([0, 1], [1, 0], color="#000000", label="ElasticTrainer")
    ax.legend(loc="lower right")
    for text in ("slanted one", "slanted two"):   # turned labels: their turned rectangles, not their boxes
        ax.text(0.3, 0.6, text, rotation=45)
    ax.text(0.7, 0.6, "slanted three", rotation=45)
    found = " | ".join(figure_problems(fig))
    assert "'slanted one' and 'slanted two' overlap" in found and "slanted three' overlap" not in found
    assert "is clipped by the figure's edge" in found
    assert "texts 'one label' and 'one label too' overlap" in found
    assert "covers data" in found
    assert f"legend entry 'ElasticTrainer' is #000000, the method's colour is {method_colour('ElasticTrainer')}" in found
    plt.close(fig)


def test_the_benchmarks_committed_figures_keep_the_rules(tmp_path):
    from bench.replot import FIGURES, replot
    from edgeflux.figcheck import checked_savefig

    with checked_savefig() as found:
        drawn = replot(list(FIGURES), out=tmp_path)
    assert set(drawn) == set(FIGURES)   # every one has its committed JSON
    assert len(found) >= len(FIGURES)
    assert _problems(found) == {}


def test_the_reports_figures_keep_the_rules(tmp_path, monkeypatch):
    from edgeflux.config import load_params
    from edgeflux.figcheck import checked_savefig
    from stages.report import draw, read_rows

    monkeypatch.chdir(ROOT)   # the committed metrics, details and curves
    params = load_params(ROOT / "params.yaml")
    rows, _, budgets = read_rows(params)
    if not rows:
        pytest.skip("no stage outputs in this workspace (make run writes them)")
    with checked_savefig() as found:
        paths = draw(rows, budgets, params.report.target_acc, tmp_path)
    assert {p.name for p in paths} >= {"pareto.png", "accuracy_vs_time.png"}
    assert _problems(found) == {}
