import json

from edgeflux.report import markdown_table, summary_rows, time_to_target


def test_time_to_target_is_the_first_time_the_curve_reaches_it():
    assert time_to_target([1.0, 2.0, 3.0], [0.5, 0.86, 0.84], 0.85) == 2.0
    assert time_to_target([1.0, 2.0], [0.5, 0.6], 0.85) is None


def test_summary_rows_from_stage_outputs(tmp_path):
    metrics, plots = tmp_path / "metrics", tmp_path / "plots"
    metrics.mkdir(), plots.mkdir()
    common = {"batch_size": 45, "peak_mem_bytes": 2**20 * 22, "train_time_s": 80.0, "test_acc": 0.9}
    (metrics / "train_bp.json").write_text(json.dumps({**common, "model": "vgg11-w0.25", "budget_bytes": 24_000_000}))
    (metrics / "pretrain.json").write_text(json.dumps({"resnet18-w0.25": {**common, "batch_size": 128}}))
    (plots / "train_bp.csv").write_text("step,epoch,time_s,train_loss,val_acc\n1,0.5,10.0,1.0,0.80\n2,1.0,20.0,0.5,0.88\n")
    rows = summary_rows(metrics, plots, target_acc=0.85)
    assert [(r["stage"], r["batch"], r["to target s"]) for r in rows] == [("pretrain", 128, "-"), ("train_bp", 45, "20.0")]
    assert rows[1]["measured peak"] == "22.0 MiB" and rows[1]["budget"] == "22.9 MiB"
    table = markdown_table(rows)
    assert table.count("\n") == 4 and "| train_bp | target (device) | vgg11-w0.25 | 45 |" in table
