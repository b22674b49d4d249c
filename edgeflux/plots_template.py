"""What `dvc plots show` draws with: the HTML page it fills (.dvc/plots/offline.html, set as
`plots.html_template` in .dvc/config), with Vega, Vega-Lite and Vega-Embed inlined so the page draws its
charts with no network (a device), and the Vega-Lite template `stages` (.dvc/plots/stages.json) of
dvc.yaml's top-level plots, which draw one curve per training stage's CSV in one chart.

DVC's own page loads the three libraries from a CDN through its `{scripts}` placeholder: offline it is a
blank page. This template leaves that placeholder out and carries the libraries itself, bundled by
vl-convert-python (`vl_convert.javascript_bundle`: Vega, Vega-Lite and Vega-Embed with their dependencies,
no network at run time), wrapped in a function so its top-level names stay out of the page's scope (DVC's
chart scripts declare `var spec`). Both files are committed; only regenerating the page needs
vl-convert-python:

    pip install vl-convert-python && python -m edgeflux.plots_template    # writes both files

`stages` is DVC's `linear` template (its version installed here) coloured by method instead of by revision:
`linear` colours every line by its git revision and tells files apart by dash pattern only, so the
workspace's curves come out one colour. Here colour is the method (the `method` column every curve CSV
carries: the report's name of the method that trained, stages.common.write_history_csv; one file, one
method), drawn in the `colour` column's colour (edgeflux.colours: the same as in every other figure), and the
dash pattern is the revision (`dvc plots diff`).

DVC fills three placeholders with str.replace: `{plot_divs}` (required), `{refresh_tag}` and `{scripts}`;
the page has the first two, and neither the bundle nor the page's text may contain any of the three.
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

TEMPLATE = Path(".dvc/plots/offline.html")
STAGES_TEMPLATE = Path(".dvc/plots/stages.json")
VEGA_LITE = "5.21"      # DVC's vega templates are Vega-Lite v5 specs ($schema .../vega-lite/v5.json)
PLACEHOLDERS = ("{plot_divs}", "{refresh_tag}", "{scripts}")

PAGE = """<!DOCTYPE html>
<html>
<head>
<meta charset="utf-8">
@REFRESH@
<title>edgeflux: DVC plots</title>
<!-- Made by `python -m edgeflux.plots_template` (edgeflux/plots_template.py); do not edit by hand.
     Inlined below: @VERSIONS@ (BSD-3-Clause, https://vega.github.io), bundled by vl-convert-python
     @VLC@. No script is loaded from the network. -->
<script>
(function () {
@BUNDLE@
})();
</script>
<style>
  body { font-family: sans-serif; margin: 1em 2em; }
  table { border-spacing: 15px; }
  .vega-embed { margin: 0.5em 0 1.5em 0; }
</style>
</head>
<body>
<h1>edgeflux: pipeline plots</h1>
<p>The training curves (CSV plots in dvc.yaml) first, then the figures the stages draw (PNG plots).
Vega charts: hover for values; the ... menu saves a chart as SVG or PNG.</p>
@PLOTS@
</body>
</html>
"""


def stages_template() -> dict:
    """DVC's `linear` Vega-Lite template with colour by `method` (one per curve) and dash by `rev`."""
    import copy

    from dvc_render.vega_templates import LinearTemplate

    spec = copy.deepcopy(LinearTemplate.DEFAULT_CONTENT)
    # DVC's anchors for these two map colour to rev and dash to the file: dropped, set per layer below
    # (not on the chart: the hover rule's pivoted rows have neither field and would add 'undefined')
    for anchor in ("color", "strokeDash"):
        spec["encoding"].pop(anchor)
    # each curve's colour is its rows' `colour` (edgeflux.colours.method_colour, written beside `method`): the
    # colour the report and the benchmarks give that method, for any method, composition or not
    by_curve = {"color": {"field": "method", "type": "nominal", "title": "method", "scale": {"range": {"field": "colour"}},
                          "legend": {"labelLimit": 400}},
                "strokeDash": {"field": "rev", "type": "nominal", "title": "revision"}}
    for layer in spec["layer"]:
        encoding = layer.get("encoding", {})
        if encoding.get("color") == {"field": "rev", "type": "nominal"}:    # the line, raw and last-point layers
            encoding.update(copy.deepcopy(by_curve))
    return spec


def bundle(vl_version: str = VEGA_LITE) -> tuple[str, str]:
    """(the JavaScript bundle that sets window.vega, vegaLite and vegaEmbed, a line naming the versions)."""
    try:
        import vl_convert as vlc
    except ImportError as e:
        raise SystemExit("edgeflux.plots_template needs vl-convert-python: pip install vl-convert-python") from e
    js = vlc.javascript_bundle(vl_version=vl_version)
    versions = (f"Vega {vlc.get_vega_version()}, Vega-Lite {vl_version}, "
                f"Vega-Embed {vlc.get_vega_embed_version()}")
    return js, f"{versions}|{getattr(vlc, '__version__', '?')}"


def render(js: str, versions: str) -> str:
    """The template's text around the bundle `js`; versions: 'libraries|vl-convert version'."""
    for placeholder in PLACEHOLDERS:
        if placeholder in js:
            raise ValueError(f"the bundle contains DVC's placeholder {placeholder}: DVC would replace it")
    # `</script` inside the inline script would end it; `<\/script` means the same to JavaScript
    js = re.sub(r"</(script)", r"<\\/\1", js, flags=re.IGNORECASE)
    libraries, vlc_version = versions.split("|")
    return (PAGE.replace("@REFRESH@", "{refresh_tag}").replace("@PLOTS@", "{plot_divs}")
            .replace("@VERSIONS@", libraries).replace("@VLC@", vlc_version).replace("@BUNDLE@", js))


def problems(html: str) -> list[str]:
    """What keeps a page (the template or DVC's output) from working offline; [] when nothing does."""
    found = [f"loads a script from the network: {src}" for src in
             re.findall(r"<script[^>]*\bsrc\s*=\s*[\"']?((?:https?:)?//[^\"'\s>]+)", html, flags=re.IGNORECASE)]
    if "{scripts}" in html:
        found.append("has DVC's {scripts} placeholder (DVC fills it with CDN script tags)")
    if "window.vegaEmbed" not in html:
        found.append("does not carry Vega-Embed (window.vegaEmbed)")
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=TEMPLATE, help=f"default: {TEMPLATE}")
    parser.add_argument("--vega-lite", default=VEGA_LITE, help=f"Vega-Lite version bundled (default {VEGA_LITE})")
    parser.add_argument("--stages-out", type=Path, default=STAGES_TEMPLATE, help=f"default: {STAGES_TEMPLATE}")
    args = parser.parse_args(argv)
    args.stages_out.parent.mkdir(parents=True, exist_ok=True)
    args.stages_out.write_text(json.dumps(stages_template(), indent=2) + "\n", encoding="utf-8")
    print(f"{args.stages_out}: DVC's linear template, coloured by curve")
    html = render(*bundle(args.vega_lite))
    if found := problems(html):
        raise SystemExit("; ".join(found))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(html, encoding="utf-8")
    tmp.replace(args.out)
    print(f"{args.out}: {len(html) // 1024} KiB ({html.split('Inlined below: ')[1].split(' (BSD')[0]})")


if __name__ == "__main__":
    main()
