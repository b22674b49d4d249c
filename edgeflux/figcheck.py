"""The mechanical rules every figure edgeflux draws keeps, checked on the matplotlib figure as it is saved:

* no text is clipped: every title, label, tick label, annotation and legend entry lies inside the canvas;
* no two texts overlap (tick labels crowding each other, annotations on top of one another);
* no legend covers data: no line vertex or scatter point lies under a legend drawn inside an axes;
* one colour per method: a legend entry named after a method (edgeflux.colours) has that method's colour.

``figure_problems(fig)`` lists what breaks them; ``checked_savefig()`` makes every Figure.savefig in its block
record its figure's problems, so that a test can render the figures of the report and the benchmarks and
check all of them.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

from edgeflux.colours import known_method, method_colour

OVERLAP = 0.15   # texts overlap when they share more than this share of the smaller one's box


def _texts(fig, renderer) -> list:
    """(text, its box) of every text drawn: an axis keeps the labels of ticks outside its view (stale
    positions, not drawn), and a hidden axis (a twin's) its labels, which are left out."""
    from matplotlib.text import Text

    tick_labels, drawn = set(), set()
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            for tick in [*axis.majorTicks, *axis.minorTicks]:
                tick_labels |= {id(tick.label1), id(tick.label2)}
            for tick in axis._update_ticks() if axis.get_visible() else []:   # the ticks the axis draws
                drawn |= {id(tick.label1), id(tick.label2)}
    out = []
    for t in fig.findobj(Text):
        if id(t) in tick_labels and id(t) not in drawn:
            continue
        if t.get_visible() and t.get_text().strip() and (not t.axes or t.axes.get_visible()):
            out.append((t, t.get_window_extent(renderer)))
    return out


def _overlap(a, b) -> float:
    w = min(a.x1, b.x1) - max(a.x0, b.x0)
    h = min(a.y1, b.y1) - max(a.y0, b.y0)
    smaller = min(a.width * a.height, b.width * b.height)
    return (w * h) / smaller if w > 0 and h > 0 and smaller > 0 else 0.0


def _texts_overlap(a, box_a, b, box_b, renderer) -> bool:
    """Whether two drawn texts overlap: their boxes, or for two texts turned by the same slant (rotated tick
    labels, whose upright boxes overlap while the texts do not) their turned rectangles."""
    angle = a.get_rotation()
    if angle != b.get_rotation() or angle % 90 == 0:
        return _overlap(box_a, box_b) > OVERLAP
    (wa, ha, _), (wb, hb, _) = (renderer.get_text_width_height_descent(t.get_text(), t.get_fontproperties(), False)
                                for t in (a, b))
    dx = (box_b.x0 + box_b.x1 - box_a.x0 - box_a.x1) / 2
    dy = (box_b.y0 + box_b.y1 - box_a.y0 - box_a.y1) / 2
    cos, sin = math.cos(math.radians(angle)), math.sin(math.radians(angle))
    along, across = abs(dx * cos + dy * sin), abs(-dx * sin + dy * cos)
    return along < (wa + wb) / 2 and across < (1 - OVERLAP) * (ha + hb) / 2


def _handle_colour(handle) -> str | None:
    from matplotlib.colors import to_hex

    for getter in ("get_color", "get_facecolor"):
        if hasattr(handle, getter):
            colour = getattr(handle, getter)()
            if hasattr(colour, "ndim") and colour.ndim == 2:   # a collection: one row per item
                colour = colour[0] if len(colour) else None
            return None if colour is None else to_hex(colour, keep_alpha=False)
    return None


def _legend_problems(fig, renderer) -> list[str]:
    import numpy as np

    found = []
    legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend())]
    for legend in legends:
        for handle, text in zip(legend.legend_handles, legend.get_texts()):
            label, colour = text.get_text(), _handle_colour(handle)
            if known_method(label) and colour and colour != method_colour(label):
                found.append(f"legend entry {label!r} is {colour}, the method's colour is {method_colour(label)}")
        box = legend.get_window_extent(renderer)
        for ax in fig.axes:
            if not ax.bbox.overlaps(box):   # a legend outside every axes covers nothing
                continue
            points = [line.get_transform().transform(line.get_xydata()) for line in ax.get_lines()
                      if line.get_visible() and line.get_label() and len(line.get_xydata())]
            points += [c.get_offset_transform().transform(c.get_offsets()) for c in ax.collections
                       if c.get_visible() and len(c.get_offsets())]
            for xy in points:
                inside = (xy[:, 0] > box.x0) & (xy[:, 0] < box.x1) & (xy[:, 1] > box.y0) & (xy[:, 1] < box.y1)
                if np.any(inside):
                    found.append(f"the legend ({', '.join(t.get_text() for t in legend.get_texts()[:3])}...) "
                                 f"covers data in {ax.get_title()!r}")
                    break
    return found


def figure_problems(fig) -> list[str]:
    """What in ``fig`` breaks the rules of the module docstring (its text, as drawn now)."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    canvas = fig.bbox
    texts = _texts(fig, renderer)
    found = [f"text {t.get_text()!r} is clipped by the figure's edge" for t, box in texts
             if box.x0 < canvas.x0 - 1 or box.y0 < canvas.y0 - 1 or box.x1 > canvas.x1 + 1 or box.y1 > canvas.y1 + 1]
    for i, (a, box_a) in enumerate(texts):
        for b, box_b in texts[i + 1:]:
            if _texts_overlap(a, box_a, b, box_b, renderer):
                found.append(f"texts {a.get_text()!r} and {b.get_text()!r} overlap")
    return found + _legend_problems(fig, renderer)


@contextlib.contextmanager
def checked_savefig() -> Iterator[dict[str, list[str]]]:
    """{path: its problems} for every figure saved in the block (each still saved)."""
    from matplotlib.figure import Figure

    found: dict[str, list[str]] = {}
    original = Figure.savefig

    def savefig(self, fname, *args, **kwargs):
        found[str(fname)] = figure_problems(self)
        return original(self, fname, *args, **kwargs)

    Figure.savefig = savefig
    try:
        yield found
    finally:
        Figure.savefig = original
