"""The house's walls, checked: no folder of det_local/ over MAX_MODULES modules, no module over
MAX_LINES lines (`make lint` runs it; so does tests/architecture/test_walls.py).

The few that are over today are listed in KNOWN with their size at the time they were listed:
each may shrink, never grow, and leaves the list once it is within the walls (a stale entry
fails too, so the list only ever gets shorter). Exit status 1 with one line per breach.

    python tools/walls.py [ROOT]
"""

from __future__ import annotations

import sys
from pathlib import Path

MAX_MODULES = 20  # .py files in one folder, __init__.py not counted
MAX_LINES = 600

# path (from the repository root) -> its size when listed: modules (a folder) or lines (a file)
KNOWN: dict[str, int] = {}


def measure(root: Path) -> dict[str, int]:
    """Every folder's module count and every module's line count, by path from `root`."""
    sizes: dict[str, int] = {}
    package = root / "det_local"
    for folder in [package, *sorted(p for p in package.rglob("*") if p.is_dir())]:
        if folder.name == "__pycache__":
            continue
        modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
        sizes[folder.relative_to(root).as_posix()] = len(modules)
        for module in modules:
            with module.open("rb") as f:
                sizes[module.relative_to(root).as_posix()] = sum(1 for _ in f)
    return sizes


def breaches(sizes: dict[str, int], known: dict[str, int] | None = None) -> list[str]:
    known = KNOWN if known is None else known
    out = []
    for path, size in sorted(sizes.items()):
        limit = MAX_LINES if path.endswith(".py") else MAX_MODULES
        unit = "lines" if path.endswith(".py") else "modules"
        if size <= limit:
            if path in known:
                out.append(f"{path}: {size} {unit}, within the walls now: remove it from KNOWN")
            continue
        if path not in known:
            out.append(f"{path}: {size} {unit}, over {limit}: split it (`tools/walls.py`)")
        elif size > known[path]:
            out.append(f"{path}: {size} {unit}, grew past its listed {known[path]}: split it")
    for path in sorted(set(known) - set(sizes)):
        out.append(f"{path}: listed in KNOWN but gone: remove it from KNOWN")
    return out


def main(argv: list[str]) -> int:
    root = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent.parent
    found = breaches(measure(root))
    for line in found:
        print(f"walls: {line}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
