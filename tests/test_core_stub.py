"""python/algenta/_core.pyi, the compiled module's type stub, names what the module has: every
public function, constant and class of _core and its submodules (written there as classes, see
tools/core-stub), and every public method of those classes, no more and no fewer. A binding added
or removed without rerunning tools/core-stub fails here."""

import ast
import os
import types

import pytest

import algenta
from algenta import _core

pytestmark = pytest.mark.smoke

STUB = os.path.join(os.path.dirname(algenta.__file__), "_core.pyi")


def module_names(obj, prefix=""):
    out = set()
    for name in dir(obj):
        if name.startswith("_"):
            continue
        value = getattr(obj, name)
        out.add(prefix + name)
        if isinstance(value, types.ModuleType):
            out |= module_names(value, f"{prefix}{name}.")
        elif isinstance(value, type):
            out |= {f"{prefix}{name}.{a}" for a in vars(value) if not a.startswith("_")}
    return out


def stub_names(body, prefix=""):
    out = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            name = node.name
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            name = node.target.id
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and \
                isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
        else:
            continue
        if name.startswith("_"):
            continue
        out.add(prefix + name)
        if isinstance(node, ast.ClassDef):
            out |= stub_names(node.body, f"{prefix}{name}.")
    return out


def test_the_stub_names_what_the_compiled_module_has():
    if not os.path.exists(STUB):
        pytest.fail(f"{STUB} is missing: the wheel and the tree ship it (tools/core-stub)")
    with open(STUB) as f:
        tree = ast.parse(f.read())
    have, stub = module_names(_core), stub_names(tree.body)
    assert not have - stub, f"in _core, not in the stub (tools/core-stub): {sorted(have - stub)}"
    assert not stub - have, f"in the stub, not in _core (tools/core-stub): {sorted(stub - have)}"
