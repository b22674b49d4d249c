"""edgeflux: train and adapt CNNs on edge devices inside a hard memory budget."""
from importlib.metadata import PackageNotFoundError, version

try:   # one place for the version: pyproject.toml, as installed
    __version__ = version("edgeflux")
except PackageNotFoundError:   # the source tree, not installed
    __version__ = "0+unknown"
