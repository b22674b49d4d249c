"""The benchmark harness in quick mode writes its JSON and markdown side by side, with real figures."""
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_memory_baseline_quick_writes_json_and_markdown(tmp_path):
    cmd = [sys.executable, "bench/memory_baseline.py", "--quick", "--models", "vgg16", "mobilenet_v2",
           "--batches", "1", "4", "8", "--out", str(tmp_path)]
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, text=True, timeout=600)
    result = json.loads((tmp_path / "memory_baseline.json").read_text())
    table = (tmp_path / "memory_baseline.md").read_text()
    assert result["machine"]["torch"] and "--quick" in result["command"]
    rows = result["rows"]
    assert {(r["model"], r["batch"]) for r in rows} == {(m, b) for m in ("vgg16", "mobilenet_v2") for b in (1, 4, 8)}
    for r in rows:
        parts = r["param_bytes"] + r["grad_bytes"] + r["optimizer_bytes"] + r["buffer_bytes"] + r["activation_bytes"]
        assert parts == r["peak_bytes"] and r["activation_bytes"] > 0
        assert r["optimizer_bytes"] == r["param_bytes"]  # SGD momentum: one buffer per parameter
    by_model = {m: sorted((r["batch"], r["peak_bytes"]) for r in rows if r["model"] == m) for m in ("vgg16", "mobilenet_v2")}
    assert all(p1 < p4 < p8 for (_, p1), (_, p4), (_, p8) in by_model.values())
    assert "| vgg16 |" in table and "R²" in table
    assert (tmp_path / "memory_baseline.png").stat().st_size > 10_000
