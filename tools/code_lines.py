"""Python code lines under a folder, as issue 58 counts them: no blank, comment-only or docstring line.

    python tools/code_lines.py [src/hicache] [-v]

A line counts when a token other than a comment, newline or indent stands on it and it is not part of a
module, class or function docstring. ``-v``: totals per subpackage and the 40 largest files.
"""

from __future__ import annotations

import ast
import collections
import io
import pathlib
import sys
import tokenize

_LAYOUT = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}


def code_lines(source: str) -> int:
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            value = first.value if isinstance(first, ast.Expr) else None
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                docstrings.update(range(first.lineno, first.end_lineno + 1))
    lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in _LAYOUT:
            lines.update(range(tok.start[0], tok.end[0] + 1))
    return len(lines - docstrings)


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "-v"]
    root = pathlib.Path(args[0] if args else "src/hicache")
    per_file = {p: code_lines(p.read_text(encoding="utf-8")) for p in sorted(root.rglob("*.py"))}
    print("total", sum(per_file.values()))
    if "-v" in sys.argv:
        per_package: collections.Counter = collections.Counter()
        for p, n in per_file.items():
            parts = p.relative_to(root).parts
            per_package[parts[0] if len(parts) > 1 else "."] += n
        for name, n in per_package.most_common():
            print(f"{n:6d} {name}")
        for p, n in sorted(per_file.items(), key=lambda kv: -kv[1])[:40]:
            print(f"{n:6d} {p}")


if __name__ == "__main__":
    main()
