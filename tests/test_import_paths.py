"""The module paths of earlier releases (`memwal_df.region`, `memwal_df.exec.knn`, ...) still import:
each resolves to the module at its new path, the same object, with a DeprecationWarning naming it."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from memwal_df._moved import MOVED, new_path

DOCUMENTED = {
    "memwal_df.writer": "group_by_region",
    "memwal_df.snapshot": "pin",
    "memwal_df.search": "plan_vector_search",
    "memwal_df.planner": "plan_scan",
    "memwal_df.sqlexpr": "parse_filter",
    "memwal_df.lease": "Lease",
    "memwal_df.region": "RegionWriter",
    "memwal_df.dataset": "MemWalTable",
    "memwal_df.region_spec": "bucket",
}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_every_old_module_path_is_the_new_module(old: str) -> None:
    sys.modules.pop(f"memwal_df.{old}", None)
    with pytest.warns(DeprecationWarning, match=new_path(f"memwal_df.{old}") or "?"):
        module = importlib.import_module(f"memwal_df.{old}")
    assert module is importlib.import_module(f"memwal_df.{MOVED[old]}")


@pytest.mark.parametrize("old", sorted(DOCUMENTED))
def test_documented_names_keep_their_old_paths(old: str) -> None:
    name = DOCUMENTED[old]
    code = f"import warnings; warnings.simplefilter('ignore'); from {old} import {name}; "
    code += f"print({name}.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == name


def test_submodules_of_an_old_package_path_resolve() -> None:
    assert new_path("memwal_df.exec.knn") == "memwal_df.read.exec.knn"
    assert new_path("memwal_df.exec.lookup_plan") == "memwal_df.read.lookup_planner"
    assert new_path("memwal_df.errors") is None
    assert new_path("memwal_df.read.exec.knn") is None


def test_a_submodule_of_an_old_package_path_is_the_same_module() -> None:
    code = (
        "import sys, warnings; warnings.simplefilter('ignore');"
        "import memwal_df.exec.knn as old; import memwal_df.read.exec.knn as new;"
        "print(old is new, old is sys.modules['memwal_df.read.exec.knn'], old.__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "True", "memwal_df.read.exec.knn"]
