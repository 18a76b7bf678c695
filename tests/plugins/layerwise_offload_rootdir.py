"""pytest plugin (loaded by pytest.ini): collect the repository root as a plain folder, never as a package.

The root ``__init__.py`` is ComfyUI's entry point for this pack. pytest collects a folder holding an ``__init__.py``
as a package and imports that file first. In a clone named ``layerwise-offload`` (what ``git clone`` and ComfyUI
Manager make) the folder name is not a Python identifier, so pytest imports the file as a lone module and its
relative imports fail, and every test errors. In an identifier-named clone it would import the pack a second time
under the folder's name. Tests import the pack as ``layerwise_offload`` instead (tests/conftest.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_collect_directory(path: Path, parent: pytest.Collector):
    if path == Path(parent.config.rootpath) and (path / "__init__.py").is_file():
        return pytest.Dir.from_parent(parent, path=path)
    return None
