"""`edgeflux report`: the pipeline's summary printed, and with --open, opened with its plots."""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from .common import RAW, UsageError, wrap


def opener() -> Callable[[Path], None]:
    """The platform's way to open a file: xdg-open (Linux), open (macOS), the default app (Windows), else a
    web browser Python knows of; UsageError when there is none (a headless device: read the files over ssh)."""
    if sys.platform == "win32":
        return os.startfile   # Windows only
    tool = shutil.which("open" if sys.platform == "darwin" else "xdg-open")
    if tool:
        def run_tool(path: Path) -> None:
            done = subprocess.run([tool, str(path)], check=False, capture_output=True, text=True, timeout=60)
            if done.returncode != 0:
                why = (done.stderr.strip() or done.stdout.strip() or f"exit {done.returncode}").splitlines()[-1]
                raise UsageError(f"{Path(tool).name} could not open {path}: {why}")
        return run_tool
    import webbrowser

    try:
        browser = webbrowser.get()
    except webbrowser.Error:
        raise UsageError("no program to open files with (no xdg-open or open on PATH, no web browser): "
                         "open reports/summary.md yourself, or install xdg-utils") from None
    return lambda path: browser.open(path.resolve().as_uri())


def display_missing() -> str | None:
    """Why nothing here could show a file, or None: a Linux or BSD machine without a graphical session (neither
    DISPLAY nor WAYLAND_DISPLAY set: a device reached over ssh, a container), where xdg-open fails or a
    text-mode browser would take over the terminal."""
    if sys.platform in ("win32", "darwin") or os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"):
        return None
    return ("no display here (DISPLAY and WAYLAND_DISPLAY are unset): open these where there is one (copy them, "
            "or serve them with `python -m http.server -d reports` and browse to this machine)")


def print_paths(paths: list[Path], why: str) -> None:
    print(f"{why}:")
    for path in paths:
        print(f"  {path.resolve()}")


def cmd_report(args: argparse.Namespace) -> int:
    from stages.report import MEMORY_PLOT, PLOT, SUMMARY, show

    show()   # exits with its own error when there is no summary yet
    if not args.open:
        return 0
    paths = [path for path in (SUMMARY, PLOT, MEMORY_PLOT) if path.exists()]
    if why := display_missing():
        print_paths(paths, why)
        return 0
    try:
        open_file = opener()
        for path in paths:
            open_file(path)
    except UsageError as exc:   # the summary is printed: a file that would not open is said, with where it is
        print_paths(paths, f"not opened: {exc}; the files are")
    return 0


REPORT_EXAMPLES = """\
examples:
  edgeflux report                                # print reports/summary.md
  edgeflux report --open                         # and open it and its plots (xdg-open / open / a browser;
                                                 # with no display, their paths)
"""


def add_report(sub) -> None:
    p = sub.add_parser("report", help="print the pipeline's summary (reports/summary.md)",
                       description=wrap("Print reports/summary.md, written by the report stage."),
                       epilog=REPORT_EXAMPLES, formatter_class=RAW)
    p.add_argument("--open", action="store_true", help="also open it and its plots with the platform's opener (with no display: print their paths)")
    p.set_defaults(func=cmd_report)
