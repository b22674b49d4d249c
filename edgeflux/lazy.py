"""Package namespaces that import a submodule when one of its names is first used (PEP 562).

    __getattr__, __dir__, __all__ = lazy_exports(__name__, {"budget": ["BudgetTooSmallError", ...], ...})

A package's options (what params.yaml's schema is built from) sit in torch-free modules, and importing
`edgeflux.memory.options` runs `edgeflux/memory/__init__.py` first: were that file to import the
package's torch modules, checking params would import torch (~350 MB and seconds on a Pi). So the
package's names resolve on first use instead; `from edgeflux.memory import measure_step` works as
before, and imports torch then.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_exports(package: str, modules: dict[str, list[str]]) -> tuple[Callable, Callable, list[str]]:
    """The module-level __getattr__ and __dir__ of `package`, and its __all__: each name of `modules`
    (submodule -> the names it defines) imported from its submodule when first asked for."""
    where = {name: module for module, names in modules.items() for name in names}

    def __getattr__(name: str):
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = where[name]   # a submodule's name, or a whole module path for a name another module defines
        return getattr(importlib.import_module(module if "." in module else f"{package}.{module}"), name)

    def __dir__() -> list[str]:
        return sorted(where)

    return __getattr__, __dir__, sorted(where)
