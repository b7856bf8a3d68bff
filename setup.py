"""Package discovery for the wheel: every folder with an ``__init__.py`` under the five source
folders ships, under the ``kvoffload.*`` name its folder maps to.

pyproject.toml cannot compute this (a hand-kept list missed ``kvoffload.daemon.tiers`` once),
and setuptools' ``find`` cannot rename a top-level folder into a namespace, so the walk lives
here; everything else about the project is in pyproject.toml. A test (tests/test_packaging.py)
builds the wheel and checks that every package folder is inside it.
"""

from __future__ import annotations

from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent
# kvoffload.<name> -> folder at the repo root; never installed as top-level modules.
ROOTS = {"kvoffload": "kvoffload", "kvoffload.daemon": "daemon", "kvoffload.events": "events",
         "kvoffload.connector": "connector", "kvoffload.bench": "bench"}


def discover() -> list[str]:
    packages = []
    for name, folder in ROOTS.items():
        for init in sorted((HERE / folder).rglob("__init__.py")):
            rel = init.parent.relative_to(HERE / folder)
            if "__pycache__" in rel.parts or any(p.startswith(".") for p in rel.parts):
                continue
            packages.append(".".join([name, *rel.parts]))
    return packages


setup(packages=discover(), package_dir=ROOTS)
