"""One entry point for the benchmarks (none runs in CI).

``python -m benchmarks`` lists them, each with the first line of its docstring;
``python -m benchmarks NAME [ARGS...]`` runs one, exactly as ``python benchmarks/NAME.py ARGS...``
would (``--help`` after the name says what it measures and takes). Run it with the interpreter the
benchmark needs: the vLLM ones from the project's ``.venv-vllm``, the SGLang one from
``.venv-sglang``. docs/benchmarks.md has the current figures and the command behind each.
"""

from __future__ import annotations

import ast
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def benchmarks() -> dict[str, str]:
    """Every module here with a ``main`` (the parts of the serving benchmark have none), by name,
    with its docstring's first line: read from the source, so listing needs none of their imports."""
    found: dict[str, str] = {}
    for path in sorted(HERE.glob("*.py")):
        tree = ast.parse(path.read_text())
        if path.stem.startswith("_") or not any(
            isinstance(node, ast.FunctionDef) and node.name == "main" for node in tree.body
        ):
            continue
        found[path.stem] = (ast.get_docstring(tree) or "").split("\n\n")[0].replace("\n", " ")
    return found


def main(argv: list[str]) -> int:
    known = benchmarks()
    if not argv or argv[0] in ("-h", "--help"):
        width = max(map(len, known))
        print("usage: python -m benchmarks NAME [ARGS...]   (NAME --help for its options)\n")
        for name, line in known.items():
            print(f"  {name:<{width}}  {line}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in known:
        print(f"no benchmark {name!r}; python -m benchmarks lists them: {', '.join(known)}", file=sys.stderr)
        return 2
    sys.argv = [str(HERE / f"{name}.py"), *rest]
    runpy.run_path(sys.argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
