"""Nothing outside sched/engine.py reaches into the engine's private state (issue 26): every
component talks to the engine through its public methods or a Protocol of it (a host), so a
name such as `engine._out`, `view._engine._tasks` or `host._idle` anywhere else fails here."""

from __future__ import annotations

import re
from pathlib import Path

# the checkout: the first folder above this file that holds det_local/ (tests/ or a folder in it)
ROOT = next(p for p in Path(__file__).resolve().parents if (p / "det_local").is_dir())
ENGINE = ROOT / "det_local" / "sched" / "engine.py"

# the engine under the names components give it: `engine`, `EngineView._engine`, a `host`
PRIVATE = re.compile(r"\b(?:engine|_engine|host)\._[a-z]\w*")


def private_uses(text: str) -> list[str]:
    return PRIVATE.findall(text)


def test_no_private_member_of_the_engine_is_used_outside_it() -> None:
    found = []
    for folder in ("det_local", "bench", "examples"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == ENGINE:
                continue
            for lineno, line in enumerate(path.read_text().splitlines(), 1):
                for name in private_uses(line):
                    found.append(f"{path.relative_to(ROOT)}:{lineno}: {name}")
    assert found == [], "private members of the engine used outside sched/engine.py: " + str(found)


def test_the_check_sees_each_form() -> None:
    assert private_uses("engine._out('x')") == ["engine._out"]
    assert private_uses("self._engine._tasks") == ["_engine._tasks"]
    assert private_uses("self.host._idle.set()") == ["host._idle"]
    assert private_uses("engine.say('x'); self._engine.runs; host.__class__") == []
