"""edgeflux: train and adapt CNNs on edge devices inside a hard memory budget."""

__version__ = "0.1.0"
