#!/usr/bin/env python3
"""Lists, per crate, the production functions (outside tests) longer than a limit, longest first,
with each crate's largest file: where to look for functions that mix several concerns. Length
alone is not the fault (llm.c's `gpt2_forward` is 133 lines); one function doing setup, work and
report at once is.

It reuses `import-circles.py`'s reading of the crates (module tree, test code left out).

Usage: scripts/long-functions.py [--over N] [--crate NAME] [WORKSPACE]   (default: 80 lines)
"""

import argparse
import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def load_reader():
    spec = importlib.util.spec_from_file_location("import_circles", HERE / "import-circles.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["import_circles"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--over", type=int, default=80, help="list functions longer than this")
    parser.add_argument("--crate", action="append", help="only this crate (repeatable)")
    parser.add_argument("workspace", nargs="?", default=str(HERE.parent))
    args = parser.parse_args()
    reader = load_reader()
    workspace = Path(args.workspace).resolve()
    total = 0
    for name, root in reader.crates(workspace):
        if args.crate and name not in args.crate:
            continue
        crate = reader.Crate(name, root)
        rel = lambda p: str(p.relative_to(workspace))  # noqa: E731
        long = sorted((f for f in crate.functions if f.lines > args.over), key=lambda f: -f.lines)
        total += len(long)
        biggest = max(crate.files, key=lambda f: crate.line_counts[f])
        print(f"{name}: {len(long)} function(s) over {args.over} lines; "
              f"largest file {rel(biggest)} ({crate.line_counts[biggest]} lines)")
        for f in long:
            print(f"  {f.lines:4d}  {f.name}  {rel(f.file)}:{f.line}")
    print(f"total: {total} function(s) over {args.over} lines")
    return 0


if __name__ == "__main__":
    sys.exit(main())
