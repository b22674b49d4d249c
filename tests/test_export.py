"""The export stage's library: ONNX and torch.export files equal to the PyTorch model, a failed check leaves no
file, and plain MLflow (a process whose own code never imports edgeflux) loads a registered model and lists a
run's artifacts in the store a clone writes."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from edgeflux import export
from edgeflux.export import EXPORTERS, TOLERANCE, TRACE_SUFFIX, ExportCheckError, export_model, run_onnx
from edgeflux.models import build_model
from edgeflux.tracking import stage_run


@pytest.fixture(scope="module")
def model_and_batch():
    model = build_model("mobilenet_v2", num_classes=5, in_channels=3, width=0.25, image_size=32, seed=0)
    model.train()   # export must switch to eval (BatchNorm's running statistics), and restore
    torch.manual_seed(0)
    with torch.no_grad():   # running statistics away from their initial 0/1, so eval mode matters
        for _ in range(3):
            model(torch.randn(16, 3, 32, 32) * 2 + 1)
    return model, torch.randn(8, 3, 32, 32)


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_exported_files_compute_the_pytorch_logits_at_any_batch(tmp_path, model_and_batch, exporter):
    model, batch = model_and_batch
    card = {"classes": list("abcde"), "normalisation": {"mean": [0.5] * 3, "std": [0.25] * 3}, "test_acc": 0.5}
    checks = export_model(model, batch, tmp_path, "mbv2", card, exporter)
    assert model.training   # the mode is restored
    assert checks["onnx_max_abs_diff"] <= TOLERANCE and checks["trace_max_abs_diff"] <= TOLERANCE
    other = torch.randn(3, 3, 32, 32)   # another batch size than the traced one: the batch dimension is free
    with torch.no_grad():
        expected = model.eval()(other)
    model.train()
    assert torch.allclose(run_onnx(tmp_path / "mbv2.onnx", other), expected, atol=TOLERANCE)
    trace = tmp_path / f"mbv2{TRACE_SUFFIX[exporter]}"
    assert torch.allclose(export._load_trace(trace, exporter)(other), expected, atol=TOLERANCE)
    sidecar = json.loads((tmp_path / "mbv2.json").read_text())
    assert sidecar["classes"] == list("abcde") and sidecar["input"]["shape"] == ["batch", 3, 32, 32]
    assert sidecar["check"] == checks and sidecar["normalisation"]["std"] == [0.25] * 3
    assert sidecar["output"]["shape"] == ["batch", 5] and sidecar["files"]["onnx"]["file"] == "mbv2.onnx"


def test_a_file_that_computes_other_logits_fails_the_check_and_is_removed(tmp_path, model_and_batch, monkeypatch):
    model, batch = model_and_batch
    real = export.run_onnx
    monkeypatch.setattr(export, "run_onnx", lambda path, x: real(path, x) + 2 * TOLERANCE)
    with pytest.raises(ExportCheckError, match=r"mbv2\.onnx's logits differ from PyTorch's by 0\.0002"):
        export_model(model, batch, tmp_path, "mbv2", {})
    assert list(tmp_path.iterdir()) == []


PLAIN_MLFLOW = """\
import json, sys
import mlflow, numpy as np
from mlflow.tracking import MlflowClient
plugin = {"edgeflux", "edgeflux.mlflow_plugin"}   # what MLflow's entry point loads (it imports nothing else)
user_imported = sorted(m for m in sys.modules if m.split(".")[0] == "edgeflux" and m not in plugin)
x = np.load(sys.argv[1])
model = mlflow.pyfunc.load_model("models:/edgeflux-mbv2/1")
names = [a.path for a in MlflowClient().list_artifacts(sys.argv[2])]
diff = float(np.abs(model.predict(x)["logits"] - np.load(sys.argv[3])).max())
print(json.dumps({"imported": user_imported, "artifacts": names, "diff": diff}))
"""


def test_plain_mlflow_loads_the_registered_model_and_lists_artifacts(tmp_path, model_and_batch):
    import numpy as np

    model, batch = model_and_batch
    export_model(model, batch, tmp_path, "mbv2", {})
    (tmp_path / "note.txt").write_text("x")
    with stage_run("export") as run:
        run.log_onnx_model(tmp_path / "mbv2.onnx", "mbv2", batch[:2], registered_name="edgeflux-mbv2")
        run.log_artifact(tmp_path / "note.txt")
    with torch.no_grad():
        expected = model.eval()(batch).numpy()
    model.train()
    np.save(tmp_path / "x.npy", batch.numpy())
    np.save(tmp_path / "y.npy", expected)
    env = {**os.environ, "PYTHONPATH": ""}   # from another directory: edgeflux only as the installed plugin
    out = subprocess.run([sys.executable, "-c", PLAIN_MLFLOW, str(tmp_path / "x.npy"), run.run_id,
                          str(tmp_path / "y.npy")], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["imported"] == []   # before MLflow resolved a URI, nothing of edgeflux but its plugin was loaded
    assert seen["artifacts"] == ["note.txt"] and seen["diff"] <= TOLERANCE


def test_the_plugin_is_what_resolves_the_store_s_artifacts(tmp_path):
    """Without the entry point, plain MLflow cannot read a clone's artifacts: the test above depends on it."""
    code = textwrap.dedent("""
        import mlflow.store.artifact.artifact_repository_registry as r
        print(type(r.get_artifact_repository("mlflow-artifacts:/edgeflux/x")).__name__)
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "LocalArtifactRepository", out.stderr[-2000:]
