"""The house rules that a reader relies on: imports run one way (type checkers' imports too),
modules stay small, a package keeps its privates to itself, the library logs rather than prints,
the front ends take from ``core`` only what is theirs, and the map of the house in
``docs/design.md`` ("Layers") names every module there is and none that is not. Only
``persist/`` is held to the rules past the first: tests and benchmarks may use backdoors and
print. (That ``core/`` does no I/O is held by
``tests/core/test_state.py::test_core_does_no_io``.)

Run as a script it checks them all and prints what breaks (exit 1), or one rule with
``--rule NAME``, or, given a package (``persist``, ``benches``), prints that package's import
cycle or "no cycle". ``--root DIR`` checks a tree other than this repository (the tests below
check that each rule fails on a bad tree). The tests run the script in a fresh interpreter:
CPython 3.11's ast.parse can fail spuriously ("AST constructor recursion depth mismatch",
gh-106905) in a process whose other threads ran a while.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# A module past this is two jobs that want splitting; a reader should hold one in their head.
MAX_LINES = 700
# The command's output and the Flight server's contract line ("persist flight serving <uri>",
# which a parent process waits for) are what these print for; everything else logs.
MAY_PRINT = frozenset({"persist/cli.py", "persist/flight/__init__.py"})


def _imports(package: str, root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports (anywhere in it, lazily too, and under
    ``if TYPE_CHECKING:``: a circle only type checkers see still ties two modules into one
    thing a reader must hold at once)."""
    base = root / package
    modules: dict[str, Path] = {}
    for path in base.rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        found: set[str] = set()
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            found.update(t for t in targets if t in modules and t != name)
        graph[name] = found
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """Some import cycle of ``graph``, or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)) is not None:
            return found
    return None


# --- the rules: each takes a root and returns its problems, "file:line: what" -----------------


def _library(root: Path) -> Iterator[tuple[str, Path]]:
    """The library's modules as (path relative to ``root``, path), in a stable order."""
    for path in sorted((root / "persist").rglob("*.py")):
        yield path.relative_to(root).as_posix(), path


def cycles(root: Path) -> list[str]:
    """No import circle in ``persist/`` or ``benches/``."""
    problems = []
    for package in ("persist", "benches"):
        if (root / package).is_dir() and (found := _cycle(_imports(package, root))):
            problems.append(f"{package}: import cycle {' -> '.join(found)}")
    return problems


def sizes(root: Path) -> list[str]:
    """No library module over ``MAX_LINES`` lines."""
    problems = []
    for name, path in _library(root):
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES:
            problems.append(f"{name}: {lines} lines (at most {MAX_LINES}: split it by job)")
    return problems


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined(tree: ast.Module) -> set[str]:
    """The private names a module defines: functions, classes, anything assigned (a variable,
    an attribute of anything, a class-level field) and anything it imports."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.ImportFrom):
            names.update(n for a in node.names for n in (a.name, a.asname) if n)
        elif isinstance(node, ast.Import):
            names.update(a.asname or a.name.split(".")[0] for a in node.names)
    return {n for n in names if _private(n)}


def _own(node: ast.expr) -> bool:
    """Whether ``node`` is the object whose class is being written: ``self``, ``cls``,
    ``super()``."""
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"
    )


def privates(root: Path) -> list[str]:
    """No module of ``persist/`` uses a private name (``_name``) that another package of
    ``persist/`` defines and its own package does not.

    A package is a directory. What a package hides, it may change without asking anyone: a
    reach into it from outside is a caller nobody knew to keep working. A name defined nowhere
    in ``persist/`` belongs to a third party (``sys._getframe``) and is not this rule's business.
    A private module (``_stream.py``) is a private name of its package.
    """
    trees: dict[str, tuple[str, ast.Module]] = {}
    defined: dict[str, set[str]] = {}
    for name, path in _library(root):
        package = str(Path(name).parent.as_posix())
        tree = ast.parse(path.read_text())
        trees[name] = (package, tree)
        found = defined.setdefault(package, set())
        found.update(_defined(tree))
        if _private(path.stem):
            found.add(path.stem)
    owners: dict[str, list[str]] = {}
    for package, names in sorted(defined.items()):
        for n in names:
            owners.setdefault(n, []).append(package)

    problems = []
    for name, (package, tree) in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and not _own(node.value):
                others = [p for p in owners.get(node.attr, []) if p != package]
                if others and node.attr not in defined[package]:
                    where = ", ".join(others)
                    problems.append(f"{name}:{node.lineno}: .{node.attr} is private to {where}")
            elif isinstance(node, ast.Import | ast.ImportFrom):
                # An import names the package it takes from: a private part of another one is
                # a reach too, though the name it binds then counts as defined here.
                for home, hidden in _imported_privates(node, package, root):
                    if home != package:
                        problems.append(
                            f"{name}:{node.lineno}: import of {hidden} is private to {home}"
                        )
    return problems


def _imported_privates(
    node: ast.Import | ast.ImportFrom, package: str, root: Path
) -> Iterator[tuple[str, str]]:
    """(the package it is taken from, the private name) for each private part of ``persist``
    that ``node``, in a module of ``package``, imports: a private module on the way, or a
    private name."""
    if isinstance(node, ast.ImportFrom):
        base = package.split("/")[: len(package.split("/")) - node.level + 1] if node.level else []
        module = [*base, *(node.module.split(".") if node.module else [])]
        sources = [(module, [a.name for a in node.names])]
    else:
        sources = [(a.name.split("."), []) for a in node.names]
    for parts, names in sources:
        if parts and parts[0] == "persist":
            home = _package_of(parts, root)
            for hidden in [p for p in parts if _private(p)] + [n for n in names if _private(n)]:
                yield home, hidden


def _package_of(module: list[str], root: Path) -> str:
    """The package (directory) that holds the module or package named ``module``."""
    path = root.joinpath(*module)
    return (path if path.is_dir() else path.parent).relative_to(root).as_posix()


def prints(root: Path) -> list[str]:
    """No ``print(`` in the library but where printing is the job (``MAY_PRINT``): a library's
    output goes through ``logging.getLogger("persist")``, which its user can route or mute."""
    problems = []
    for name, path in _library(root):
        if name in MAY_PRINT:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "print"
            ):
                problems.append(f"{name}:{node.lineno}: print( (log to 'persist' instead)")
    return problems


# The front ends are built on the client and handles. Of ``core`` each takes only the pure parts
# its own job needs: names and frontiers (both), Arrow kernels (both: they take and give Arrow),
# the streaming ledger (Flight: it serves streamed writes) and the scan planner (Spark: it reads
# part files with its own reader). Never a shard's state or its transitions: those change only
# through ``internal/``'s commit loop.
FRONT_ENDS: dict[str, tuple[str, ...]] = {
    "persist/flight": (
        "persist.core.arrow",
        "persist.core.catalog",
        "persist.core.frontier",
        "persist.core.stream",
    ),
    "persist/spark": (
        "persist.core.arrow",
        "persist.core.catalog",
        "persist.core.frontier",
        "persist.core.read",
    ),
}


def front_ends(root: Path) -> list[str]:
    """A front end (``FRONT_ENDS``) imports no module of ``persist.core`` but those its entry
    lets it (a module, or a folder of modules)."""
    problems = []
    for name, path in _library(root):
        allowed = next((a for f, a in FRONT_ENDS.items() if name.startswith(f + "/")), None)
        if allowed is None:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            modules: list[str] = []
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                base = node.module
                # ``from persist.core import x`` takes the module ``persist.core.x``.
                modules = (
                    [f"{base}.{a.name}" for a in node.names] if base == "persist.core" else [base]
                )
            for module in modules:
                if module.startswith("persist.core") and not any(
                    module == a or module.startswith(a + ".") for a in allowed
                ):
                    problems.append(f"{name}:{node.lineno}: imports {module} (not a front end's)")
    return problems


def _map(root: Path) -> tuple[list[tuple[int, str]], list[str]]:
    """The "Layers" map of ``docs/design.md``: (line, path) for each module and folder it names,
    and what is wrong with its form.

    The map is the first ``text`` block under ``## Layers``. A line names, before its first run
    of two spaces, files (``x.py``) and folders (``x/``); its indent (two spaces a level) puts
    them in the folder named last one level up. A line indented past ``_WRAP`` columns carries on
    the words of the line before it."""
    text = (root / "docs/design.md").read_text().splitlines()
    start = text.index("## Layers")
    open_at = next(i for i in range(start, len(text)) if text[i].startswith("```text"))
    named: list[tuple[int, str]] = []
    problems: list[str] = []
    folders: list[str] = []
    for i in range(open_at + 1, len(text)):
        line = text[i]
        if line.startswith("```"):
            break
        indent = len(line) - len(line.lstrip(" "))
        if not line.strip() or indent >= _WRAP:
            continue
        level = indent // 2
        if indent % 2 or level > len(folders):
            problems.append(f"docs/design.md:{i + 1}: indent {indent} fits no folder")
            continue
        del folders[level:]
        where = "".join(folders)
        for token in line.strip().split("  ")[0].split():
            if not token.endswith((".py", "/")):
                problems.append(f"docs/design.md:{i + 1}: {token!r} is no module or folder")
                continue
            named.append((i + 1, where + token))
            if token.endswith("/"):
                folders.append(token)
    return named, problems


# Words of the map's lines start before this column; a line starting past it carries on the one
# before.
_WRAP = 16


def layers(root: Path) -> list[str]:
    """``docs/design.md``'s "Layers" map names only modules and folders that exist, and every
    module of ``persist/`` (a folder's ``__init__.py`` but the top one goes with its folder)."""
    named, problems = _map(root)
    for line, path in named:
        if not (root / path).exists():
            problems.append(f"docs/design.md:{line}: {path} does not exist")
    paths = {p for _, p in named}
    for name, path in _library(root):
        if path.name == "__init__.py" and name != "persist/__init__.py":
            continue
        if name not in paths:
            problems.append(f"{name}: not in docs/design.md's Layers map")
    return problems


RULES: dict[str, Callable[[Path], list[str]]] = {
    "cycles": cycles,
    "sizes": sizes,
    "privates": privates,
    "prints": prints,
    "front_ends": front_ends,
    "layers": layers,
}


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, __file__, *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("package", ["persist", "benches"])
def test_imports_run_one_way(package: str) -> None:
    done = _run(package)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "no cycle", done.stdout


@pytest.mark.parametrize("rule", sorted(RULES))
def test_the_house_rules_hold(rule: str) -> None:
    done = _run("--rule", rule)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_cycle_finder_finds_one() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


# A library that breaks every rule once, and what each rule must say about it. Each line it
# must not flag is a false positive the rule once could have had.
BAD_TREE = {
    "persist/__init__.py": "",
    "persist/a.py": "from persist import b\n",
    # A circle only type checkers see is a circle too.
    "persist/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from persist import a\n",
    "persist/big.py": "x = 1\n" * (MAX_LINES + 1),
    "persist/cli.py": "print('the command may print')\n",
    "persist/core/__init__.py": "",
    "persist/core/state.py": """\
        import sys
        import logging
        from dataclasses import dataclass

        class _Hidden:
            _field: int

            def _helper(self) -> None:
                self._cache = 1
                self._helper()
                super()._helper()
                print("no")

        def _free() -> None:
            sys._getframe()  # not persist's
            logging.getLogger("persist").info("yes")

        @dataclass
        class Rec:
            _slot: int = 0

        _value = Rec()._slot  # its own package
        """,
    "persist/core/_kernel.py": "",
    "persist/flight/__init__.py": "print('persist flight serving grpc://x')\n",
    "persist/flight/reads.py": """\
        from persist.core.stream import ledger
        from persist.core.frontier import frontier_le
        from persist.core import state
        from persist.core.state import State
        import persist.core.arrow.updates
        """,
    "persist/spark/__init__.py": "from persist.core.read.scan import plan_scan\n",
    "docs/design.md": """\
        # design

        ## Layers

        ```text
        persist/
          __init__.py a.py b.py big.py cli.py  the top
          ghost.py      a module that is not there
          core/         the core
            state.py    (its __init__.py goes with the folder)
          flight/
                        a line that carries on the one before: ignored.py
             odd.py     indented out of step
          internal/ notes  the wing
        ```
        """,
    "persist/internal/__init__.py": "",
    "persist/internal/machine.py": """\
        from persist.core import state
        from persist.core.state import _value
        from persist.core._kernel import thing
        import persist.core._kernel
        from ..core.state import _value as v

        class M:
            def __init__(self, other: object) -> None:
                self._cache = 2  # defines _cache here too: m._cache below is fine
                state._free()
                state._Hidden()._helper()
                other._field
                persist.core._kernel.thing
                other._cache
                other._unknown_to_persist
        """,
    # Tests and benchmarks may use backdoors and print: none of these rules is theirs.
    "tests/test_x.py": "from persist.core import state, _kernel\nprint(state._free())\n",
    "benches/x.py": "from persist.core import state, _kernel\nprint(state._free())\n",
}
SAYS = {
    "cycles": ["persist: import cycle persist.a -> persist.b -> persist.a"],
    "sizes": [f"persist/big.py: {MAX_LINES + 1} lines"],
    "privates": [
        "persist/internal/machine.py:2: import of _value is private to persist/core",
        "persist/internal/machine.py:3: import of _kernel is private to persist/core",
        "persist/internal/machine.py:4: import of _kernel is private to persist/core",
        "persist/internal/machine.py:5: import of _value is private to persist/core",
        "persist/internal/machine.py:10: ._free is private to persist/core",
        "persist/internal/machine.py:11: ._Hidden is private to persist/core",
        "persist/internal/machine.py:11: ._helper is private to persist/core",
        "persist/internal/machine.py:12: ._field is private to persist/core",
        "persist/internal/machine.py:13: ._kernel is private to persist/core",
    ],
    "prints": ["persist/core/state.py:12: print("],
    "front_ends": [
        "persist/flight/reads.py:3: imports persist.core.state",
        "persist/flight/reads.py:4: imports persist.core.state",
    ],
    "layers": [
        "docs/design.md:8: persist/ghost.py does not exist",
        "docs/design.md:13: indent 5 fits no folder",
        "docs/design.md:14: 'notes' is no module or folder",
        "persist/core/_kernel.py: not in docs/design.md's Layers map",
        "persist/flight/reads.py: not in docs/design.md's Layers map",
        "persist/internal/machine.py: not in docs/design.md's Layers map",
    ],
}


@pytest.mark.parametrize("rule", sorted(RULES))
def test_each_rule_fails_on_a_bad_tree(rule: str, tmp_path: Path) -> None:
    for name, text in BAD_TREE.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(textwrap.dedent(text))
    done = _run("--root", str(tmp_path), "--rule", rule)
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    for said in SAYS[rule]:
        assert any(line.startswith(said) for line in lines), (said, lines)
    assert len(lines) == len(SAYS[rule]), lines  # and nothing else: no false positive


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("package", nargs="?", help="print this package's import cycle")
    parser.add_argument("--rule", choices=sorted(RULES), help="check only this rule")
    parser.add_argument("--root", type=Path, default=ROOT, help="the tree to check")
    args = parser.parse_args(argv)
    if args.package:
        found = _cycle(_imports(args.package, args.root))
        print("no cycle" if found is None else " -> ".join(found))
        return 0
    problems = [p for name in ([args.rule] if args.rule else RULES) for p in RULES[name](args.root)]
    for problem in problems:
        print(problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
