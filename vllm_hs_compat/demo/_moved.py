"""The old ``demo.*`` names of the tools that moved out of ``demo/`` (they work for one release)."""

import importlib
import warnings
from types import ModuleType


def moved(old: str, new: str) -> ModuleType:
    """Warn that ``old`` moved to ``new`` (a ``DeprecationWarning`` at the importer's line) and return ``new``'s
    module, which the old module's file puts in ``sys.modules`` under its own name: both names are one module."""
    warnings.warn(
        f"{old} moved to {new}: import it from there (the old name goes in the next release)",
        DeprecationWarning,
        stacklevel=3,
    )
    return importlib.import_module(new)
