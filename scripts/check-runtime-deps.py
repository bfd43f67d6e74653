#!/usr/bin/env python3
"""Checks that the modules of trainer/src/runtime depend on each other one way only.

A module is a file `runtime/NAME.rs` or a directory `runtime/NAME/`. It depends on module OTHER when
its text (code, tests and doc links alike: a doc link that points back up is a reader's detour too) names `super::OTHER` (from `NAME.rs` or `NAME/mod.rs`),
`super::super::OTHER` (from a file inside `NAME/`) or `crate::runtime::OTHER`. The script prints
the graph, one line per module with what it uses, and exits 1 naming every cycle it finds.

Usage: scripts/check-runtime-deps.py [RUNTIME_DIR]   (default: trainer/src/runtime)
"""

import re
import sys
from pathlib import Path


def modules(runtime: Path) -> dict[str, list[Path]]:
    """Module name -> its source files."""
    found: dict[str, list[Path]] = {}
    for path in sorted(runtime.iterdir()):
        if path.is_file() and path.suffix == ".rs" and path.name != "mod.rs":
            found.setdefault(path.stem, []).append(path)
        elif path.is_dir():
            found.setdefault(path.name, []).extend(sorted(path.rglob("*.rs")))
    return found


def uses(runtime: Path, name: str, files: list[Path], names: set[str]) -> set[str]:
    """The runtime modules that module `name` refers to."""
    used: set[str] = set()
    for path in files:
        text = path.read_text()
        inside = path.parent != runtime  # a file of a directory module
        top = inside and path.name == "mod.rs" and path.parent.name == name
        patterns = [r"crate::runtime::(\w+)"]
        if inside and not top:
            patterns.append(r"super::super::(\w+)")
        else:
            patterns.append(r"(?<!super::)super::(\w+)")
        # `use super::{a, b::c}` groups.
        groups = [r"(?<!super::)super::\{([^}]*)\}"] if not inside or top else [r"super::super::\{([^}]*)\}"]
        for pattern in patterns:
            used.update(m.group(1) for m in re.finditer(pattern, text))
        for pattern in groups:
            for m in re.finditer(pattern, text):
                used.update(re.findall(r"(?:^|,)\s*(\w+)", m.group(1)))
    return {u for u in used if u in names and u != name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def main() -> int:
    runtime = Path(sys.argv[1] if len(sys.argv) > 1 else "trainer/src/runtime")
    if not runtime.is_dir():
        print(f"check-runtime-deps: {runtime} is not a directory", file=sys.stderr)
        return 2
    mods = modules(runtime)
    names = set(mods)
    graph = {name: uses(runtime, name, files, names) for name, files in mods.items()}
    for name in sorted(graph):
        print(f"{name:16} -> {', '.join(sorted(graph[name])) or '(leaf)'}")
    found = cycles(graph)
    for component in found:
        print(f"check-runtime-deps: import cycle among {', '.join(component)}", file=sys.stderr)
    if found:
        return 1
    print(f"check-runtime-deps: {len(graph)} modules, no import cycle")
    return 0


if __name__ == "__main__":
    sys.exit(main())
