"""The walls (issue 26): no folder of det_local/ over 20 modules, no module over 600 lines,
except the few listed in tools/walls.py, which may only shrink."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from tests.support import paths

ROOT = paths.REPO


def _walls():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("walls", ROOT / "tools" / "walls.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["walls"] = module
    spec.loader.exec_module(module)
    return module


def test_the_house_is_within_its_walls() -> None:
    walls = _walls()
    assert walls.breaches(walls.measure(ROOT)) == []


def test_a_new_big_module_a_full_folder_and_a_grown_one_are_named(tmp_path: Path) -> None:
    walls = _walls()
    pkg = tmp_path / "det_local"
    (pkg / "crowded").mkdir(parents=True)
    for i in range(21):
        (pkg / "crowded" / f"m{i}.py").write_text("x = 1\n")
    (pkg / "big.py").write_text("x = 1\n" * 601)
    (pkg / "listed.py").write_text("x = 1\n" * 700)
    (pkg / "shrunk.py").write_text("x = 1\n" * 10)
    known = {"det_local/listed.py": 650, "det_local/shrunk.py": 900, "det_local/gone.py": 700}
    assert walls.breaches(walls.measure(tmp_path), known) == [
        "det_local/big.py: 601 lines, over 600: split it (`tools/walls.py`)",
        "det_local/crowded: 21 modules, over 20: split it (`tools/walls.py`)",
        "det_local/listed.py: 700 lines, grew past its listed 650: split it",
        "det_local/shrunk.py: 10 lines, within the walls now: remove it from KNOWN",
        "det_local/gone.py: listed in KNOWN but gone: remove it from KNOWN",
    ]
