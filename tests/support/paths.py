"""Where things are, for tests and their helpers: the repository, the compat shim, and the
suite's data folders (tests/fixtures/, tests/golden/, tests/artifacts/), wherever the test that
asks lives in tests/."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
REPO = TESTS.parent
COMPAT = REPO / "det_local" / "compat"
FIXTURES = TESTS / "fixtures"  # trial scripts and configs the tests run
GOLDEN = TESTS / "golden"  # expected outputs, compared exactly
ARTIFACTS = TESTS / "artifacts"  # screenshots (git-ignored; CI keeps them)
TRAINER = FIXTURES / "trainer.py"
