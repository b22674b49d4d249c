import json

from edgeflux.report import time_to_target


def test_time_to_target_is_the_first_time_the_curve_reaches_it():
    assert time_to_target([1.0, 2.0, 3.0], [0.5, 0.86, 0.84], 0.85) == 2.0
    assert time_to_target([1.0, 2.0], [0.5, 0.6], 0.85) is None


HEAD = {"test_acc": 0.9, "train_time_s": 80.0, "train_cpu_s": 150.0, "peak_mib": 22.0, "budget_mib": 61.0,
        "batch": 45, "trainable_params": 1000, "params": 1000}


def _stage_files():
    """Headline and details of a pipeline that ran every method (the figures made up, the shapes real)."""
    head = {"train_bp": HEAD, "train_blocks": {**HEAD, "peak_mib": 60.0, "test_acc": 0.89, "trainable_params": 1500},
            "select_exit": {"test_acc": 0.885, "params": 300},
            "finetune/mobiletl": {**HEAD, "peak_mib": 24.0, "test_acc": 0.87, "trainable_params": 200, "params": 700},
            "finetune/ft_all": {**HEAD, "peak_mib": 58.8, "test_acc": 0.86, "params": 700},
            "finetune/elastic-mobiletl": {**HEAD, "peak_mib": 24.5, "test_acc": 0.86, "params": 700},
            "meanet_edge": {**HEAD, "peak_mib": 30.0, "hard_test_acc": 0.7},
            "evaluate_edge_cloud": {"edge_acc": 0.88, "edge_cloud_acc": 0.91, "cloud_frac": 0.25}}
    detail = {"train_bp": {"model": "vgg11-w0.25"}, "train_blocks": {"model": "vgg16-w0.25", "batch_sizes": [65, 199]},
              "select_exit": {"exit_unit": "conv6", "params": 300, "test_acc": 0.885},
              **{k: {"model": "mobilenet_v2-w0.5"} for k in head if k.startswith("finetune/")},
              "meanet_cloud": {"main": "mobilenet_v2-w0.5"}, "meanet_edge": {}, "evaluate_edge_cloud": {}}
    return head, detail


def method_rows(head, detail, bittrain, finetune_model):
    """The report's rows: every registered stage's summary_rows, in dvc.yaml's order."""
    from edgeflux.rows import RowInputs
    from stages.report import collect_rows

    return collect_rows(RowInputs(head, detail, bittrain, finetune_model))


def test_every_method_gets_a_row_with_its_own_figures():
    head, detail = _stage_files()
    rows = {r.method: r for r in method_rows(head, detail, {"finetune": False, "neuroflux": True}, "mobilenet_v2-w0.5")}
    assert list(rows) == ["backprop", "NeuroFlux, full model + BitTrain", "NeuroFlux, exit conv6 + BitTrain",
                          "MobileTL", "FT-All", "ElasticTrainer on MobileTL", "MEANet, edge only",
                          "MEANet, edge + cloud (25% sent)"]
    exit_ = rows["NeuroFlux, exit conv6 + BitTrain"]   # trained as the full model: its peak and time, its own size
    assert (exit_.peak_mib, exit_.batch, exit_.params, exit_.test_acc) == (60.0, "65/199", 300, 0.885)
    assert (rows["MobileTL"].trainable_params, rows["MobileTL"].starts_from) == (200, "pretrained mobilenet_v2-w0.5")
    assert rows["MEANet, edge + cloud (25% sent)"].test_acc == 0.91 and rows["MEANet, edge only"].test_acc == 0.88
    assert rows["MEANet, edge only"].peak_mib == 30.0 and rows["backprop"].cpu_s == 150.0


def test_pareto_front_is_the_rows_no_other_row_dominates():
    from edgeflux.rows import MethodRow
    from edgeflux.summary import mark_pareto

    def row(name, peak, acc):
        return MethodRow(name, "s", "scratch", "m", 64.0, "1", peak, 1, 1, 1.0, 1.0, acc)

    rows = mark_pareto([row("small", 20.0, 0.80), row("best", 50.0, 0.90), row("worse", 30.0, 0.79),
                        row("tie-acc-bigger", 55.0, 0.90), row("mid", 25.0, 0.85), row("unmeasured", None, 0.99)])
    assert [r.method for r in rows if r.pareto] == ["small", "best", "mid"]


def test_summary_says_whether_the_methods_shared_one_budget(tmp_path):
    from edgeflux.summary import plot_pareto, summary_markdown

    head, detail = _stage_files()
    rows = method_rows(head, detail, {}, "mobilenet_v2-w0.5")
    same = summary_markdown(rows, {"train_bp": 61.0, "finetune": 61.0}, 0.85)
    assert "Every method under the same budget: **61.0 MiB**" in same
    assert "| MobileTL | pretrained mobilenet_v2-w0.5 | mobilenet_v2-w0.5 | 45 | 24.0 | 200 / 700 | 80.0 | 150.0 |" in same
    assert same.count("\n| ") == len(rows) + 1    # header + one line per row
    differ = summary_markdown(rows, {"train_bp": 22.9, "finetune": 61.0}, 0.85)
    assert "different budgets" in differ and "train_bp: 22.9 MiB, finetune: 61.0 MiB" in differ
    plot_pareto(rows, tmp_path / "pareto.png", 61.0)
    assert (tmp_path / "pareto.png").stat().st_size > 10_000


def test_composition_names_are_checked_and_labelled():
    import pytest

    from edgeflux.finetune import parse_method
    from edgeflux.finetune import finetune_label

    assert parse_method("elastic-mobiletl-bittrain") == ("elastic", "mobiletl", True, ())
    assert finetune_label("elastic-mobiletl-bittrain") == "ElasticTrainer on MobileTL + BitTrain"
    assert finetune_label("ft_all", bittrain=True) == "FT-All + BitTrain"
    for bad in ("mobiletl-elastic", "ft_all-ft_bn", "mobiletl-bittrain-bittrain", "elastic-elastic", "ft-all"):
        with pytest.raises(ValueError, match="optionally followed by -bittrain"):
            parse_method(bad)


def test_curves_read_cpu_time_where_the_file_has_it(tmp_path):
    from edgeflux.report import read_curve

    new, old = tmp_path / "new.csv", tmp_path / "old.csv"
    new.write_text("step,epoch,time_s,cpu_s,train_loss,val_acc\n1,0.5,10.0,19.0,1.0,0.80\n2,1.0,20.0,39.0,0.5,0.88\n")
    old.write_text("step,epoch,time_s,train_loss,val_acc\n1,0.5,10.0,1.0,0.80\n")
    assert read_curve(new) == ([19.0, 39.0], [0.80, 0.88]) and read_curve(new, x="time_s")[0] == [10.0, 20.0]
    assert read_curve(old) == ([10.0], [0.80])


def test_report_stage_reads_the_files_dvc_yaml_lists_as_its_deps():
    """dvc reruns the report when a listed dep changes: a file read but not listed would leave it stale,
    one listed but not read would rerun it for nothing."""
    from pathlib import Path

    import yaml

    from stages import report

    deps = yaml.safe_load((Path(__file__).resolve().parents[1] / "dvc.yaml").read_text())["stages"]["report"]["deps"]
    data_deps = {Path(d) for d in deps if not d.startswith(("stages/", "edgeflux/"))}
    reads = {report.METRICS_DIR, report.DETAILS_DIR, *report.curves(), report.TRAIN_BP_MEMORY}
    assert reads == data_deps


def _measured_memory_report(tmp_path, context=None):
    """memory/train_bp.json as train_bp writes it (sorted keys), from a measured step of a small VGG."""
    import torch

    from edgeflux.artifacts import write_json
    from edgeflux.memory import measure_training_peak
    from edgeflux.models import build_model

    model = build_model("vgg11", width=0.125, in_channels=1, num_classes=10, batch_norm=False)
    mem = measure_training_peak(model, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), (1, 32, 32), 10, 4,
                                context=context)
    path = tmp_path / "train_bp.json"
    write_json(path, {"step_memory": mem.to_dict(), "batch_fit": {"batch_size": 4, "budget_bytes": 3_000_000}})
    return model, mem, json.loads(path.read_text())


def test_memory_panels_show_measured_bytes_per_unit_in_model_order(tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from edgeflux.report import MiB, draw_bars, memory_panels, plot_bar_panels

    model, mem, report = _measured_memory_report(tmp_path)
    blocks = {"block_results": [{"index": 0, "units": [0, 1], "batch_size": 9, "peak_bytes": 2_500_000,
                                 "budget_bytes": 3_000_000},
                                {"index": 1, "units": [2, 8], "batch_size": 30, "peak_bytes": 2_900_000,
                                 "budget_bytes": 3_000_000}]}
    kinds, per_unit, per_block = memory_panels(report, blocks)
    assert kinds.series["measured"] == [mem.param_bytes, mem.grad_bytes, mem.optimizer_bytes, mem.activation_bytes,
                                        mem.peak_bytes]
    assert kinds.line == ("budget", 3_000_000)
    # model order survives the sorted-keys JSON; the loss's few bytes outside units are kept when non-zero
    assert per_unit.categories[:len(model.unit_names)] == list(model.unit_names)
    assert per_unit.series == {"saved for backward (measured)": [mem.saved_by_unit[u] for u in per_unit.categories]}
    assert sum(per_unit.series["saved for backward (measured)"]) == mem.saved_bytes
    assert per_block.categories[1] == "block 1\nunits 2-8\nbatch 30" and per_block.line == ("budget", 3_000_000)

    fig, ax = plt.subplots()
    bars = draw_bars(ax, per_unit)
    assert [b.get_height() for b in bars[0]] == [v / MiB for v in per_unit.series["saved for backward (measured)"]]
    plt.close(fig)
    plot_bar_panels([kinds, per_unit, per_block], tmp_path / "memory.png")
    assert (tmp_path / "memory.png").stat().st_size > 10_000


def test_memory_panels_with_bittrain_show_dense_beside_stored(tmp_path):
    from edgeflux.bittrain import BitTrainOptions
    from edgeflux.report import memory_panels

    _, mem, report = _measured_memory_report(tmp_path, context=BitTrainOptions(enabled=True).context)
    units = mem.activation_storage["units"]
    per_unit = memory_panels(report)[1]
    dense, stored = per_unit.series.values()
    assert dense == [units[u]["dense_bytes"] for u in per_unit.categories]
    assert stored == [units[u]["stored_bytes"] for u in per_unit.categories]
    assert sum(stored) < 0.8 * sum(dense)   # ReLU outputs of a VGG without BN: about half zeros


def test_bar_panel_rejects_series_of_the_wrong_length():
    import pytest

    from edgeflux.report import BarPanel

    with pytest.raises(ValueError, match="series 'a' has 1 values for 2 categories"):
        BarPanel("t", ["x", "y"], {"a": [1.0]})


def _memory_figure(n_blocks: int = 2):
    """The report's memory figure (bar_panels_figure of memory_panels: kinds, per unit, per block) from a
    made-up train_bp report and NeuroFlux blocks whose bars reach the budget line, as the real ones do."""
    from edgeflux.report import bar_panels_figure, memory_panels

    step = {"unit_order": ["conv1", "conv2", "classifier"],
            "saved_by_unit": {"conv1": 6_000_000, "conv2": 4_000_000, "classifier": 10_000},
            "param_bytes": 2_000_000, "grad_bytes": 1_000_000, "optimizer_bytes": 2_000_000,
            "activation_bytes": 17_000_000, "peak_bytes": 23_900_000}
    report = {"step_memory": step, "batch_fit": {"batch_size": 43, "budget_bytes": 24_000_000}}
    blocks = {"block_results": [{"index": i, "units": [i], "batch_size": 64, "peak_bytes": 23_950_000,
                                 "budget_bytes": 24_000_000} for i in range(n_blocks)]}
    panels = memory_panels(report, blocks)
    return panels, bar_panels_figure(panels, title="edgeflux pipeline: measured training memory")


def _drawn(fig):
    """(every Axes, every Legend) of a drawn figure, subfigures included, and its renderer."""
    from matplotlib.axes import Axes
    from matplotlib.legend import Legend

    fig.canvas.draw()
    return fig.findobj(Axes), fig.findobj(Legend), fig.canvas.get_renderer()


def test_memory_figure_fills_its_grid_with_the_panels():
    """Three panels in two columns: a row of two and one panel as wide as the row, no empty cell."""
    import matplotlib.pyplot as plt

    panels, fig = _memory_figure()
    try:
        axes, _, renderer = _drawn(fig)
        assert len(panels) == 3 and len(axes) == len(panels)
        assert all(ax.get_visible() and ax.patches for ax in axes)      # every axes has its bars
        assert [ax.get_title() for ax in axes] == [p.title for p in panels]
        width = fig.bbox.width
        rows: dict[int, float] = {}
        for ax in axes:                                               # axes' widths summed per row
            box = ax.get_window_extent(renderer)
            rows[round(box.y1 / 20)] = rows.get(round(box.y1 / 20), 0.0) + box.width
        assert len(rows) == 2 and all(w > 0.75 * width for w in rows.values()), (rows, width)
    finally:
        plt.close(fig)


def test_memory_figure_legends_cover_no_bar_and_no_budget_line():
    import matplotlib.pyplot as plt

    panels, fig = _memory_figure()
    try:
        axes, legends, renderer = _drawn(fig)
        budgets = [line for ax in axes for line in ax.get_lines() if line.get_label() == "budget"]
        assert len(budgets) == sum(p.line is not None for p in panels) == 2
        labels = [t.get_text() for legend in legends for t in legend.get_texts()]
        assert labels.count("budget") == 2 and "saved for backward (measured)" in labels
        for legend in legends:
            box = legend.get_window_extent(renderer)
            for line in budgets:
                assert not box.overlaps(line.get_window_extent(renderer)), "a legend covers the budget line"
            for ax in axes:
                assert not box.overlaps(ax.get_window_extent(renderer)), f"a legend inside {ax.get_title()!r}"
    finally:
        plt.close(fig)


def test_exits_plot_legend_names_the_parameter_bars_and_covers_no_data():
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    from edgeflux.neuroflux.plots import exits_figure

    names = ["conv1", "conv2", "conv3", "classifier"]
    fig = exits_figure(names, [0.7, 0.85, 0.9, 0.9], [0.69, 0.84, 0.89, 0.9], [10_000, 40_000, 90_000, 95_000], 2)
    try:
        axes, legends, renderer = _drawn(fig)
        assert len(legends) == 1
        entries = dict(zip((t.get_text() for t in legends[0].get_texts()), legends[0].legend_handles))
        bars = [label for label, handle in entries.items() if isinstance(handle, Rectangle)]
        assert len(bars) == 1 and "parameters" in bars[0]
        assert {"validation accuracy", "test accuracy", "chosen exit: conv3"} <= set(entries)
        box = legends[0].get_window_extent(renderer)
        assert not any(box.overlaps(ax.get_window_extent(renderer)) for ax in axes)
        accuracy, params = sorted(axes, key=lambda ax: bool(ax.patches))   # the lines' axes, the bars' twin
        assert accuracy.get_zorder() > params.get_zorder()                # the lines drawn over the bars
    finally:
        plt.close(fig)
