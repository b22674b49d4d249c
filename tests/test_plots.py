"""`dvc plots show` as a newcomer meets it: one page (dvc_plots/index.html) that draws every plot of
dvc.yaml with no network, each chart titled and its axes named.

The page is rendered from the workspace's committed outputs (`dvc plots show -o <tmp>` reads them, reruns
nothing); the Vega libraries come from the HTML template .dvc/config names (edgeflux.plots_template).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from edgeflux.colours import method_colour

ROOT = Path(__file__).resolve().parents[1]
DVC = [sys.executable, "-m", "dvc"]


def _dvc_yaml() -> dict:
    return yaml.safe_load((ROOT / "dvc.yaml").read_text())


def _entries(section) -> dict[str, dict]:
    """dvc.yaml's list of paths or one-key mappings -> {path: options}."""
    entries = {}
    for entry in section or []:
        path, options = (entry, {}) if isinstance(entry, str) else next(iter(entry.items()))
        entries[path] = options or {}
    return entries


def _stages() -> dict[str, dict]:
    """dvc.yaml's stages with the finetune matrix expanded over params.yaml's finetune.methods."""
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    stages = {}
    for name, stage in _dvc_yaml()["stages"].items():
        if "matrix" in stage:
            assert list(stage["matrix"]) == ["method"], "a new matrix: teach this test to expand it"
            for method in params["finetune"]["methods"]:
                text = json.dumps(stage).replace("${item.method}", method)
                stages[f"{name}@{method}"] = json.loads(text)
        else:
            stages[name] = stage
    return stages


def _declared_images() -> list[str]:
    """Every .png a stage or the top-level plots declare as a plot (DVC draws those as images)."""
    stage = {p for s in _stages().values() for p in _entries(s.get("plots"))}
    return sorted(p for p in stage | set(_entries(_dvc_yaml()["plots"])) if p.endswith(".png"))


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("dvc_plots")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*DVC, "plots", "show", "-o", str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    index = out / "index.html"
    return index, index.read_text(encoding="utf-8")


def _specs(html: str) -> list[dict]:
    """The Vega-Lite specs DVC inlines, one `var spec = {...};` line per chart."""
    return [json.loads(s) for s in re.findall(r"var spec = (\{.*\});\n", html)]


def test_the_page_loads_no_script_from_the_network(page):
    from edgeflux.plots_template import problems

    _, html = page
    assert problems(html) == []
    assert not re.search(r"<script[^>]*\bsrc\s*=\s*[\"']?(https?:)?//", html, flags=re.IGNORECASE)
    assert not re.search(r"""<(link|img)[^>]*\b(href|src)\s*=\s*["']?(https?:)?//""", html, flags=re.IGNORECASE)
    # the libraries are inlined before the charts' scripts call vegaEmbed
    assert html.index("window.vegaEmbed") < html.index("vegaEmbed('#")


def test_every_declared_plot_is_on_the_page(page):
    index, html = page
    images = [p for p in _declared_images() if (ROOT / p).exists()]
    assert {"reports/memory.png", "reports/accuracy_vs_time.png", "plots/exits.png", "profile/memory.png",
            "plots/meanet_sweep.png", "plots/finetune/elastic_tensors.png"} <= set(images)
    for path in images:
        assert f"<p>{path}</p>" in html, f"{path}: declared as a plot, not on the page"
    srcs = re.findall(r'<img src="([^"]+)"', html.split("</head>", 1)[1])
    assert len(srcs) == len(images)
    for src in srcs:                       # images are copied beside the page and linked relatively
        assert not src.startswith(("http:", "https:", "/")) and (index.parent / src).stat().st_size > 5_000
    titles = {spec["title"]["text"] for spec in _specs(html)}
    top = {p: o for p, o in _entries(_dvc_yaml()["plots"]).items() if not p.endswith(".png")}
    stage_vega = {p: o for s in _stages().values() for p, o in _entries(s.get("plots")).items()
                  if not p.endswith(".png")}
    assert titles == {o["title"] for o in [*top.values(), *stage_vega.values()]}


def test_every_chart_is_titled_and_its_axes_named(page):
    _, html = page
    specs = _specs(html)
    assert len(specs) >= 3
    names = {*_entries(_dvc_yaml()["plots"]), *(p for s in _stages().values() for p in _entries(s.get("plots")))}
    for spec in specs:
        title = spec["title"]["text"]
        assert title and title not in names, f"a chart titled {title!r}: by its plot's name, or not at all"
        axes = [spec["encoding"]["x"]["title"]]
        axes += [layer["encoding"]["y"]["title"] for layer in spec["layer"] if "y" in layer.get("encoding", {})]
        fields = {spec["encoding"]["x"]["field"], "val_acc", "train_loss", "acc", "time_s", "threshold"}
        for axis in axes:
            assert axis and axis not in fields, f"{title}: axis titled by its column {axis!r}"


def test_only_elastictrainers_tensor_maps_are_drawn():
    """A map of which tensors train in which epoch says something only where the selection changes
    (ElasticTrainer); every method still writes its map (an out, logged to MLflow)."""
    methods = yaml.safe_load((ROOT / "params.yaml").read_text())["finetune"]["methods"]
    maps = {p for p in _declared_images() if p.endswith("_tensors.png")}
    assert maps == {f"plots/finetune/{m}_tensors.png" for m in methods if m.startswith("elastic")}
    outs = {p for s in _stages().values() for p in _entries(s.get("outs"))}
    assert {f"plots/finetune/{m}_tensors.png" for m in methods} <= outs


def test_the_training_curves_share_one_chart_coloured_by_method(page):
    """Every training stage's CSV curve (a stage out under plots/) is a line of both top-level charts, its
    legend entry the method's name (the report's), not the file's; a finetune method added to params.yaml
    without its line here fails."""
    curves = sorted(p for s in _stages().values() for p in _entries(s.get("outs"))
                    if p.startswith("plots/") and p.endswith(".csv"))
    assert {"plots/train_bp.csv", "plots/train_blocks.csv", "plots/meanet_edge.csv"} <= set(curves)
    top = _entries(_dvc_yaml()["plots"])
    for plot_id, column in (("accuracy_vs_time", "val_acc"), ("loss_vs_time", "train_loss")):
        assert top[plot_id]["y"] == {c: column for c in curves}, plot_id
        assert top[plot_id]["template"] == "stages"
    _, html = page
    spec = next(s for s in _specs(html) if s["title"]["text"] == top["accuracy_vs_time"]["title"])
    colours = [layer["encoding"]["color"] for layer in spec["layer"] if "color" in layer.get("encoding", {})]
    assert colours and all(c["field"] == "method" and c["title"] == "method" for c in colours)
    # each method in its own colour, the one every other figure gives it
    assert all(c["scale"] == {"range": {"field": "colour"}} for c in colours)
    assert {(r["method"], r["colour"]) for r in spec["data"]["values"]} == \
        {(m, method_colour(m)) for m in {r["method"] for r in spec["data"]["values"]}}
    drawn = {row["method"] for row in spec["data"]["values"]}
    written = [_method_of(ROOT / c) for c in curves if (ROOT / c).exists()]   # (a stage not run yet: no file)
    assert drawn == set(written) and len(set(written)) == len(written)   # a method per curve, each its own
    assert "backprop" in drawn and "NeuroFlux, full model" in drawn and not any(".csv" in m for m in drawn)


def _method_of(curve: Path) -> str:
    import csv

    with curve.open() as f:
        (method,) = {row["method"] for row in csv.DictReader(f)}
    return method


def test_the_template_dvc_reads_is_the_committed_offline_page():
    from edgeflux.plots_template import STAGES_TEMPLATE, TEMPLATE, problems

    config = (ROOT / ".dvc/config").read_text()
    setting = re.search(r"^\s*html_template\s*=\s*(\S+)", config, flags=re.MULTILINE)
    assert setting and ROOT / ".dvc" / setting.group(1) == ROOT / TEMPLATE
    html = (ROOT / TEMPLATE).read_text(encoding="utf-8")
    assert "{plot_divs}" in html and problems(html) == []
    assert json.loads((ROOT / STAGES_TEMPLATE).read_text())["data"] == {"values": "<DVC_METRIC_DATA>"}


def test_render_rejects_a_bundle_dvc_would_break():
    from edgeflux.plots_template import render

    page = render("window.vegaEmbed = 1; var s = '</script>';", "Vega x|1")
    assert "</script>'" not in page and "<\\/script>'" in page and "{plot_divs}" in page
    with pytest.raises(ValueError, match="plot_divs"):
        render("var s = '{plot_divs}';", "Vega x|1")


def test_generated_pages_stay_out_of_git():
    assert "/dvc_plots/" in (ROOT / ".gitignore").read_text().split()


@pytest.mark.skipif(shutil.which("chromium") is None, reason="no chromium (apt-get install chromium)")
def test_a_browser_with_no_network_draws_every_chart(page, tmp_path):
    index, html = page
    done = subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=10000",
                           f"--user-data-dir={tmp_path}", "--proxy-server=127.0.0.1:9", "--dump-dom",
                           index.as_uri()], capture_output=True, text=True, timeout=120)
    drawn = len(re.findall(r'<svg[^>]*class="marks"', done.stdout)) + done.stdout.count('<canvas class="marks"')
    assert drawn == len(_specs(html)), done.stderr[-2000:]
