"""Every Lua script has exactly one caller module, ``dtq/calls.py``, and one function there.

Read from the sources (``ast``), not by importing: a script call is a ``.call(...)``,
``.call_many(...)``, ``.call_many_wait(...)`` or ``.evalsha(...)``, a script's
``sha``/``source`` looked up, or a ``(name, keys, args)`` tuple whose name is a script's (a
:data:`dtq.scripts.Call` built by hand).
``dtq/scripts.py`` is the machinery these go through and is not a caller.
"""

from __future__ import annotations

import ast
from pathlib import Path

from dtq.scripts import SCRIPT_NAMES

SRC = Path(__file__).resolve().parents[2] / "src"
CALLS = Path("dtq/calls.py")
MACHINERY = Path("dtq/scripts.py")
CALL_METHODS = {"call", "call_many", "call_many_wait", "evalsha", "evalsha_ro", "eval", "eval_ro"}


def script_calls(tree: ast.AST) -> list[str]:
    """What in ``tree`` runs a script or builds a script call, as "line: what"."""
    found: list[str] = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in CALL_METHODS
        ):
            found.append(f"{node.lineno}: .{node.func.attr}(...)")
        elif isinstance(node, ast.Attribute) and node.attr in {"sha", "source"}:
            found.append(f"{node.lineno}: .{node.attr}")
        elif (
            isinstance(node, ast.Tuple)
            and len(node.elts) == 3
            and isinstance(node.elts[0], ast.Constant)
            and node.elts[0].value in SCRIPT_NAMES
        ):
            found.append(f"{node.lineno}: ({node.elts[0].value!r}, ...)")
    return found


def sources() -> dict[Path, ast.Module]:
    return {
        path.relative_to(SRC): ast.parse(path.read_text(encoding="utf-8"), str(path))
        for path in sorted(SRC.rglob("*.py"))
    }


def test_only_the_calls_module_calls_scripts() -> None:
    strays = {
        str(path): found
        for path, tree in sources().items()
        if path not in (CALLS, MACHINERY) and (found := script_calls(tree))
    }
    assert strays == {}, "script calls outside dtq/calls.py"


def test_the_calls_module_calls_every_script_in_order() -> None:
    tree = sources()[CALLS]
    assert script_calls(tree), "dtq/calls.py calls no script"
    functions = [
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and not node.name.startswith("_")
    ]
    names_used = {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }
    first: dict[str, int] = {}
    for name in SCRIPT_NAMES:
        mine = [i for i, f in enumerate(functions) if f == name or f.startswith(name + "_")]
        assert mine, f"no function for {name}.lua in dtq/calls.py"
        assert name in names_used, f"dtq/calls.py never sends {name!r}"
        first[name] = mine[0]
    assert sorted(SCRIPT_NAMES, key=first.__getitem__) == list(SCRIPT_NAMES), (
        "the functions of dtq/calls.py are not in the order of SCRIPT_NAMES"
    )
