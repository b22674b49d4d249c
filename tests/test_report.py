import json

from edgeflux.report import markdown_table, summary_rows, time_to_target


def test_time_to_target_is_the_first_time_the_curve_reaches_it():
    assert time_to_target([1.0, 2.0, 3.0], [0.5, 0.86, 0.84], 0.85) == 2.0
    assert time_to_target([1.0, 2.0], [0.5, 0.6], 0.85) is None


def test_summary_rows_from_stage_outputs(tmp_path):
    common = {"batch_size": 45, "peak_mem_bytes": 2**20 * 22, "train_time_s": 80.0, "test_acc": 0.9}
    metrics = {"train_bp": {**common, "model": "vgg11-w0.25", "budget_bytes": 24_000_000},
               "pretrain": {"resnet18-w0.25": {**common, "batch_size": 128}}}
    curve = tmp_path / "train_bp.csv"
    curve.write_text("step,epoch,time_s,train_loss,val_acc\n1,0.5,10.0,1.0,0.80\n2,1.0,20.0,0.5,0.88\n")
    rows = summary_rows(metrics, {"train_bp": curve, "train_blocks": tmp_path / "not_written.csv"}, target_acc=0.85)
    assert [(r["stage"], r["batch"], r["to target s"]) for r in rows] == [("pretrain", 128, "-"), ("train_bp", 45, "20.0")]
    assert rows[1]["measured peak"] == "22.0 MiB" and rows[1]["budget"] == "22.9 MiB"
    table = markdown_table(rows)
    assert table.count("\n") == 4 and "| train_bp | target (device) | vgg11-w0.25 | 45 |" in table
    # a curve already read counts the same as its file
    assert summary_rows(metrics, {"train_bp": ([10.0, 20.0], [0.80, 0.88])}, target_acc=0.85) == rows


def test_report_stage_reads_the_files_dvc_yaml_lists_as_its_deps():
    """dvc reruns the report when a listed dep changes: a file read but not listed would leave it stale,
    one listed but not read would rerun it for nothing."""
    from pathlib import Path

    import yaml

    from stages import report

    deps = yaml.safe_load((Path(__file__).resolve().parents[1] / "dvc.yaml").read_text())["stages"]["report"]["deps"]
    data_deps = {Path(d) for d in deps if not d.startswith(("stages/", "edgeflux/"))}
    reads = {*report.METRICS.values(), *report.STAGE_CURVES.values(), *report.MEMORY_SOURCES.values(),
             *report.CURVES.values(), report.FINETUNE_METRICS, report.FINETUNE_CURVES}
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


def test_finetune_methods_get_a_row_each():
    from edgeflux.report import summary_rows

    m = {"model": "mobilenet_v2-w0.5", "batch_size": 16, "budget_bytes": 64_000_000, "peak_mem_bytes": 62_000_000,
         "train_time_s": 30.0, "test_acc": 0.87}
    rows = summary_rows({"finetune": {"mobiletl": {**m, "batch_size": 128}, "ft_all": m}},
                        {"finetune mobiletl": ([1.0, 2.0], [0.8, 0.9])}, target_acc=0.85)
    assert [(r["stage"], r["batch"], r["to target s"]) for r in rows] == [("finetune mobiletl", 128, "2.0"),
                                                                         ("finetune ft_all", 16, "-")]
