"""Imported at interpreter start when this folder is on PYTHONPATH (scripts/mutants.py):
``kvoffload.*`` then resolves to the mutated scratch copy named by ``KVOFFLOAD_MUTANT_ROOT``,
ahead of the editable install of the real checkout (child processes inherit it)."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType

_ROOT = os.environ.get("KVOFFLOAD_MUTANT_ROOT", "")
_ROOTS = {"kvoffload": "kvoffload", "kvoffload.daemon": "daemon", "kvoffload.events": "events",
          "kvoffload.connector": "connector", "kvoffload.bench": "bench"}


class _ScratchFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: object = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        folder = _ROOTS.get(name)
        if folder is None:
            return None
        where = os.path.join(_ROOT, folder)
        return importlib.util.spec_from_file_location(
            name, os.path.join(where, "__init__.py"), submodule_search_locations=[where])


if _ROOT:
    sys.meta_path.insert(0, _ScratchFinder())
