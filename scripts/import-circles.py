#!/usr/bin/env python3
"""Finds import circles between the source files of each crate, and reports each crate's largest
file and longest function.

For every crate of the workspace (each package's `src/`, from its crate root `lib.rs` or `main.rs`)
the script builds the module tree from `mod` declarations (`#[path]` alternates and inline `mod x {}`
blocks included) and a graph of files: file A depends on file B when A names an item that B
defines, through `use crate::…`, `use super::…`, `use self::…`, a `use` of a child module, or the
same paths written inline in code (`crate::model::stage::ModelError::Shape`). A path is resolved
through the module tree to the file that defines its item, following `pub use` re-exports (a
re-exported name counts as the re-exporting file's dependency, not as a definition of it); a path
that ends at a module points at that module's file. Declaring a child module (`mod x;`) is not a
dependency. Comments and string literals are ignored. Test code counts as much as production code:
a test module that imports back up still closes a circle.

An import circle is a strongly connected component of more than one file. The script prints each
crate's circles (and one edge list per circle, to say which names close it), then the largest file
and the longest function outside test code, and exits 1 when any crate has a circle.

Usage: scripts/import-circles.py [WORKSPACE_DIR]   (default: the repository this script is in)
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
ITEM_KINDS = ("fn", "struct", "enum", "trait", "type", "const", "static", "union", "macro_rules!")


def strip(text: str) -> str:
    """The text with comments, string and char literals blanked out (newlines kept, so line numbers
    stay right)."""
    out: list[str] = []
    i, n = 0, len(text)

    def blank(s: str) -> str:
        return "".join("\n" if c == "\n" else " " for c in s)

    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(blank(text[i:j]))
            i = j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(blank(text[i:j]))
            i = j
        elif (m := re.match(r'b?r(#*)"', text[i:i + 300])) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            end = '"' + m.group(1)
            j = text.find(end, i + m.end())
            j = n if j < 0 else j + len(end)
            out.append('""' + blank(text[i + 2:j]))
            i = j
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            out.append('""' + blank(text[i + 2:j]))
            i = j
        elif c == "'":
            # A char literal ('x', '\n', '\u{1F600}') or a lifetime ('a): only the literal is blanked.
            m = re.match(r"'(\\u\{[0-9a-fA-F]+\}|\\x[0-9a-fA-F]{2}|\\.|[^\\'])'", text[i:i + 12])
            if m:
                out.append(" " * m.end())
                i += m.end()
            else:
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def match_brace(code: str, open_at: int) -> int:
    """The index of the `}` closing the `{` at `open_at` (or the end of the text)."""
    depth = 0
    for j in range(open_at, len(code)):
        if code[j] == "{":
            depth += 1
        elif code[j] == "}":
            depth -= 1
            if depth == 0:
                return j
    return len(code)


def split_use_tree(tree: str) -> list[tuple[list[str], str | None]]:
    """`a::{b, c::{self, D as E}}` -> [(['a','b'], None), (['a','c','self'], None), (['a','c','D'], 'E')]."""
    # `X as Y` becomes `X\0Y`, then whitespace goes.
    tree = re.sub(r"\s+", "", re.sub(r"\s+as\s+", "\x00", tree.strip()))
    result: list[tuple[list[str], str | None]] = []

    def walk(prefix: list[str], s: str) -> None:
        if not s:
            return
        brace = s.find("{")
        if brace < 0:
            body, _, alias = s.partition("\x00")
            result.append((prefix + [p for p in body.split("::") if p], alias or None))
            return
        head = s[:brace].rstrip(":")
        inner = s[brace + 1:s.rfind("}")]
        new_prefix = prefix + [p for p in head.split("::") if p]
        depth, start = 0, 0
        for k, ch in enumerate(inner):
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
            elif ch == "," and depth == 0:
                walk(new_prefix, inner[start:k])
                start = k + 1
        walk(new_prefix, inner[start:])

    walk([], tree.lstrip(":"))
    return result


@dataclass
class Module:
    path: tuple[str, ...]
    files: list[Path]
    parent: "Module | None"
    test: bool = False
    children: dict[str, "Module"] = field(default_factory=dict)
    items: dict[Path, set[str]] = field(default_factory=dict)
    # (name or '*', path segments, public) of every `use`: a name the module's children and
    # (when public) everyone else can reach through it.
    reexports: list[tuple[str, list[str], bool]] = field(default_factory=list)
    # Every path this module's own code names: file, path segments, line, whether it is a
    # `use`, whether it is a `pub use`, whether it is test code.
    refs: list[tuple[Path, list[str], int, bool, bool, bool]] = field(default_factory=list)


@dataclass
class Function:
    file: Path
    name: str
    line: int
    lines: int


class Crate:
    def __init__(self, name: str, root: Path) -> None:
        self.name = name
        self.root = root
        self.files: list[Path] = []
        self.functions: list[Function] = []
        self.line_counts: dict[Path, int] = {}
        self.top = self.load(("crate",), [root], None, False)

    # --- the module tree ---

    def load(self, path: tuple[str, ...], files: list[Path], parent: Module | None, test: bool) -> Module:
        module = Module(path, files, parent, test)
        for file in files:
            text = file.read_text()
            self.files.append(file)
            self.line_counts[file] = text.count("\n") + (0 if text.endswith("\n") else 1)
            code = strip(text)
            self.scan(module, file, code, 0, len(code), test)
        return module

    def child_dir(self, module: Module, file: Path) -> Path:
        """Where the files of `module`'s child modules declared in `file` live."""
        if file == self.root or file.name == "mod.rs":
            return file.parent
        return file.parent / file.stem

    def scan(self, module: Module, file: Path, code: str, start: int, end: int, test: bool,
             inline_dir: Path | None = None) -> None:
        """Reads the items, `mod`s, `use`s and paths of `module` in `code[start:end]` (its body in `file`)."""
        items = module.items.setdefault(file, set())
        base_dir = inline_dir if inline_dir is not None else self.child_dir(module, file)
        i = start
        use_spans: list[tuple[int, int]] = []
        # Skip the bodies of nested items' blocks only for `mod` (everything else is the module's own code).
        pattern = re.compile(
            r"(?P<attrs>(?:#!?\[[^\]]*\]\s*)*)(?P<vis>pub(?:\s*\([^)]*\))?\s+)?"
            r"(?:(?P<mod>mod)\s+(?P<modname>" + IDENT + r")\s*(?P<modend>[;{])"
            r"|(?P<use>use)\s+(?P<tree>[^;]+);"
            r"|(?P<kind>fn|struct|enum|trait|type|const|static|union|macro_rules!)\s*(?P<name>" + IDENT + r"))")
        while i < end:
            m = pattern.search(code, i, end)
            if not m:
                break
            # Only whole words: the keyword must not be the tail of an identifier.
            if m.start() > 0 and (code[m.start() - 1].isalnum() or code[m.start() - 1] == "_"):
                i = m.start() + 1
                continue
            attrs = m.group("attrs") or ""
            is_test = test or "cfg(test)" in attrs.replace(" ", "")
            line = code.count("\n", 0, m.start("attrs") if attrs else m.start()) + 1
            if m.group("mod"):
                name = m.group("modname")
                if m.group("modend") == ";":
                    path_attr = re.search(r'#\[path\s*=\s*"([^"]*)"\]', self.raw_attrs(file, m.start(), m.start("mod")))
                    if path_attr:
                        child_files = [file.parent / path_attr.group(1)]
                    else:
                        candidates = [base_dir / f"{name}.rs", base_dir / name / "mod.rs"]
                        child_files = [c for c in candidates if c.exists()][:1]
                    if child_files:
                        existing = module.children.get(name)
                        if existing is not None:
                            # A `#[cfg]` alternate of the same module: one module, several files.
                            for f in child_files:
                                if f not in existing.files:
                                    sub = self.load(existing.path, [f], module, is_test)
                                    existing.files.extend(sub.files)
                                    existing.items.update(sub.items)
                                    existing.reexports.extend(sub.reexports)
                                    existing.refs.extend(sub.refs)
                                    for k, v in sub.children.items():
                                        existing.children.setdefault(k, v)
                                        v.parent = existing
                        else:
                            module.children[name] = self.load(module.path + (name,), child_files, module, is_test)
                    items.add(name)
                    i = m.end()
                else:
                    close = match_brace(code, m.end() - 1)
                    child = module.children.get(name)
                    if child is None:
                        child = Module(module.path + (name,), [file], module, is_test)
                        module.children[name] = child
                    self.scan(child, file, code, m.end(), close, is_test, base_dir / name)
                    items.add(name)
                    i = close + 1
            elif m.group("use"):
                public = m.group("vis") is not None
                for segs, alias in split_use_tree(m.group("tree")):
                    if not segs:
                        continue
                    if segs[-1] == "self":
                        segs = segs[:-1]
                    if not segs:
                        continue
                    module.refs.append((file, segs, line, True, public, is_test))
                    module.reexports.append((alias or segs[-1], segs, public))
                use_spans.append((m.start(), m.end()))
                i = m.end()
            else:
                name = m.group("name")
                if name and not self.inside_fn_body(code, start, m.start()):
                    items.add(name)
                if m.group("kind") == "fn":
                    self.record_function(file, code, m, is_test, attrs, line)
                i = m.end()
        # Inline paths in code: `crate::a::B`, `super::a::B`, `self::a::B`, `child::B`.
        body = list(code[start:end])
        for a, b in use_spans:
            body[a - start:b - start] = " " * (b - a)
        body = "".join(body)
        for pm in re.finditer(r"(?<![\w:])((?:" + IDENT + r"\s*::\s*)+" + IDENT + r")", body):
            segs = [s.strip() for s in pm.group(1).split("::")]
            at = start + pm.start()
            line = code.count("\n", 0, at) + 1
            # Code inside an inline `#[cfg(test)] mod` was scanned as that module's: skip it here.
            module.refs.append((file, segs, line, False, False, test or self.in_test_block(code, start, at)))

    def in_test_block(self, code: str, start: int, at: int) -> bool:
        """Whether `at` lies inside an inline `#[cfg(test)] mod … { }` opened after `start`."""
        for m in re.finditer(r"#\[cfg\(test\)\]\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+\w+\s*\{", code[start:at]):
            if match_brace(code, start + m.end() - 1) > at:
                return True
        return False

    def raw_attrs(self, file: Path, begin: int, end: int) -> str:
        # Attributes were kept by strip() except for their string contents: re-read them from the file.
        return file.read_text()[begin:end]

    def inside_fn_body(self, code: str, start: int, at: int) -> bool:
        """Whether `at` is nested in braces below the module level (an item inside a function or impl)."""
        depth = 0
        for ch in code[start:at]:
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
        return depth > 0

    def record_function(self, file: Path, code: str, m: re.Match, test: bool, attrs: str, line: int) -> None:
        if test or "#[test]" in attrs.replace(" ", "") or "cfg(test)" in attrs.replace(" ", ""):
            return
        # The body: the first `{` after the signature, unless a `;` comes first (a trait method's
        # declaration).
        j = m.end()
        depth = 0
        while j < len(code):
            ch = code[j]
            if ch in "([<":
                depth += 1
            elif ch in ")]>":
                depth -= 1
            elif ch == ";" and depth <= 0:
                return
            elif ch == "{" and depth <= 0:
                break
            j += 1
        close = match_brace(code, j)
        lines = code.count("\n", m.start("kind"), close) + 1
        self.functions.append(Function(file, m.group("name"), line, lines))

    # --- resolution ---

    def start_module(self, module: Module, head: str) -> Module | None:
        if head == "crate":
            return self.top
        if head == "self":
            return module
        if head == "super":
            return module.parent
        return module.children.get(head)

    def resolve(self, module: Module, segs: list[str], seen: frozenset = frozenset()) -> set[Path]:
        """The files that define what `segs` (a path written in `module`) names; empty for another
        crate's path."""
        cur = self.start_module(module, segs[0])
        if cur is None:
            return set()
        rest = segs[1:]
        while rest and rest[0] == "super":
            cur = cur.parent
            if cur is None:
                return set()
            rest = rest[1:]
        for seg in rest:
            if seg in cur.children:
                cur = cur.children[seg]
                continue
            return self.resolve_name(cur, seg, seen)
        # The path names a module, not an item: no file is needed for it yet.
        return set()

    def resolve_name(self, module: Module, name: str, seen: frozenset) -> set[Path]:
        key = (module.path, name)
        if key in seen:
            return set()
        seen = seen | {key}
        for file, names in module.items.items():
            if name in names:
                return {f for f, ns in module.items.items() if name in ns}
        found: set[Path] = set()
        for exported, segs, _ in module.reexports:
            if exported == name:
                found |= self.resolve(module, segs, seen)
        if found:
            return found
        for exported, segs, _ in module.reexports:
            if exported == "*":
                target = self.resolve_module(module, segs[:-1])
                if target is not None:
                    found |= self.resolve_name(target, name, seen)
        # Unknown (a macro's output, an enum variant path): the module's own files.
        return found or set(module.files)

    def resolve_module(self, module: Module, segs: list[str]) -> Module | None:
        if not segs:
            return None
        cur = self.start_module(module, segs[0])
        for seg in segs[1:]:
            if cur is None:
                return None
            cur = cur.parent if seg == "super" else cur.children.get(seg)
        return cur

    def modules(self) -> list[Module]:
        found, todo = [], [self.top]
        while todo:
            m = todo.pop()
            found.append(m)
            todo.extend(m.children.values())
        return found

    def graph(self) -> dict[Path, dict[Path, set[str]]]:
        """file -> file it depends on -> the paths that make it depend."""
        edges: dict[Path, dict[Path, set[str]]] = {f: {} for f in self.files}
        for module in self.modules():
            ancestors: set[Path] = set()
            up = module.parent
            while up is not None:
                ancestors.update(up.files)
                up = up.parent
            # Names brought in by `use` (a module, or an item whose own path continues).
            aliases = {name: segs for name, segs, _ in module.reexports if name != "*"}
            for file, segs, line, is_use, public, test in module.refs:
                if test or public or segs[-1] == "*":
                    continue
                if not is_use and segs[0] not in ("crate", "super", "self") and segs[0] not in module.children:
                    if segs[0] not in aliases:
                        continue
                    segs = aliases[segs[0]] + segs[1:]
                targets = self.resolve(module, segs)
                for t in targets:
                    if t != file and t in edges and t not in ancestors:
                        edges[file].setdefault(t, set()).add(f"{'::'.join(segs)} (line {line})")
        return edges


def cycles(graph: dict[Path, dict[Path, set[str]]]) -> list[list[Path]]:
    """Strongly connected components with more than one file (Tarjan, iterative)."""
    index: dict[Path, int] = {}
    low: dict[Path, int] = {}
    stack: list[Path] = []
    on_stack: set[Path] = set()
    found: list[list[Path]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    advanced = True
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
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
    return found


def crates(workspace: Path) -> list[tuple[str, Path]]:
    found = []
    for manifest in sorted(workspace.glob("*/Cargo.toml")) + [workspace / "Cargo.toml"]:
        if not manifest.is_file():
            continue
        text = manifest.read_text()
        name = re.search(r'^\s*name\s*=\s*"([^"]+)"', text, re.M)
        if "[package]" not in text or not name:
            continue
        for root in ("src/lib.rs", "src/main.rs"):
            if (manifest.parent / root).exists():
                found.append((name.group(1), manifest.parent / root))
    return found


def main() -> int:
    workspace = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent
    total = 0
    for name, root in crates(workspace):
        crate = Crate(name, root)
        graph = crate.graph()
        rel = lambda p: str(p.relative_to(workspace))  # noqa: E731
        found = cycles(graph)
        total += len(found)
        print(f"{name} ({rel(root)}): {len(crate.files)} files, {len(found)} import circle(s)")
        for component in found:
            print("  circle: " + " <-> ".join(rel(f) for f in component))
            members = set(component)
            for a in component:
                for b in sorted(graph[a]):
                    if b in members:
                        why = sorted(graph[a][b])
                        more = f" (+{len(why) - 3} more)" if len(why) > 3 else ""
                        print(f"    {rel(a)} -> {rel(b)}: {', '.join(why[:3])}{more}")
        biggest = max(crate.files, key=lambda f: crate.line_counts[f])
        print(f"  largest file: {rel(biggest)} ({crate.line_counts[biggest]} lines)")
        if crate.functions:
            longest = max(crate.functions, key=lambda f: f.lines)
            print(f"  longest function outside tests: {longest.name} in {rel(longest.file)}:{longest.line} "
                  f"({longest.lines} lines)")
    print(f"total: {total} import circle(s)")
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
