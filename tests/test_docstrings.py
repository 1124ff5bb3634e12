"""One docstring style on every public function: a summary, ``Args:`` when it takes arguments, and
``Returns:`` (or ``Yields:``), as in the house style (``pdpfast/optimizer.py``).

Reads the sources (nothing is imported). Public means a name without a leading underscore, in a module,
or a method of a public class; ``__init__`` is documented by its class, properties by their summary.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted([*ROOT.glob("pdpfast/**/*.py"), *ROOT.glob("kernels/*.py")])


def _is_property(fn: ast.FunctionDef) -> bool:
    return any(isinstance(d, ast.Name) and d.id in ("property", "cached_property")
               or isinstance(d, ast.Attribute) and d.attr == "cached_property" for d in fn.decorator_list)


def _is_accessor(fn: ast.FunctionDef) -> bool:
    return any(isinstance(d, ast.Attribute) and d.attr in ("setter", "deleter") for d in fn.decorator_list)


def undocumented(path: Path) -> list[str]:
    """'file:line name: what is missing' for each public definition of ``path`` off the style."""
    found = []

    def visit(node, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef) and not child.name.startswith("_"):
                if not ast.get_docstring(child):
                    found.append(f"{path.relative_to(ROOT)}:{child.lineno} class {child.name}: no docstring")
                visit(child, f"{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and not child.name.startswith("_"):
                if _is_accessor(child):  # a setter or deleter: documented by its property
                    continue
                doc = ast.get_docstring(child) or ""
                args = [a.arg for a in child.args.posonlyargs + child.args.args + child.args.kwonlyargs
                        if a.arg not in ("self", "cls")]
                if not doc:
                    missing = ["no docstring"]
                elif _is_property(child):
                    missing = []
                else:
                    missing = [what for what, ok in (("no Args", not args or "Args:" in doc),
                                                     ("no Returns", "Returns:" in doc or "Yields:" in doc)) if not ok]
                if missing:
                    found.append(f"{path.relative_to(ROOT)}:{child.lineno} {prefix}{child.name}: {', '.join(missing)}")

    visit(ast.parse(path.read_text(), str(path)), "")
    return found


def test_the_checker_sees_a_missing_section(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    src = tmp_path / "m.py"
    src.write_text('def f(x):\n    """Summary.\n\n    Returns:\n        x.\n    """\n    return x\n\n'
                   'class C:\n    """A class."""\n    def g(self):\n        return 1\n\n'
                   '    @property\n    def h(self):\n        """A property needs only its summary."""\n\n'
                   '    @h.setter\n    def h(self, value):\n        pass\n\n'
                   'def _private(y):\n    return y\n')
    assert undocumented(src) == ["m.py:1 f: no Args", "m.py:11 C.g: no docstring"]


def test_every_public_function_has_args_and_returns():
    problems = [line for path in SOURCES for line in undocumented(path)]
    assert not problems, f"{len(problems)} public definitions off the docstring style:\n" + "\n".join(problems)
