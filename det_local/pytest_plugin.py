"""det-local's pytest plugin (registered under the pytest11 entry point).

* The ``det_local_test_mode`` fixture runs an experiment config in test mode (one batch,
  validate, checkpoint, restore in a new process, one more batch) on a throwaway
  DET_LOCAL_HOME and returns the ``TestReport`` (steps, metrics, checkpoint path) for
  assertions; by default a failed step fails the test with the step and the trial's traceback.
* ``pytest --det-configs PATH...`` collects each experiment config as a test item that runs it
  in test mode, with the config's directory as the context.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from det_local.sched.testmode import TestReport


class TestModeFailed(AssertionError):
    """A test-mode step failed; the message is the report (steps and traceback)."""


def _run(config: Path, context: Path | None, home: Path) -> TestReport:
    from det_local import api

    context = context if context is not None else config.parent
    return api.test_experiment(config, context, home=home)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("det-local")
    group.addoption(
        "--det-configs",
        nargs="+",
        action="extend",
        default=[],
        metavar="PATH",
        help="experiment configs to run in det-local test mode, one test item each (the "
        "config's directory is the context)",
    )


@pytest.fixture
def det_local_test_mode(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[..., TestReport]]:
    """run(config, context=None, *, check=True) -> TestReport, on a fresh DET_LOCAL_HOME."""

    def run(
        config: str | Path, context: str | Path | None = None, *, check: bool = True
    ) -> TestReport:
        home = tmp_path_factory.mktemp("det-local-home")
        report = _run(Path(config), Path(context) if context is not None else None, home)
        if check and not report.passed:
            raise TestModeFailed(report.format())
        return report

    yield run


class DetConfigItem(pytest.Item):
    def __init__(self, *, config_path: Path, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.config_path = config_path
        self.report: TestReport | None = None

    def runtest(self) -> None:
        with tempfile.TemporaryDirectory(prefix="det-local-home-") as home:
            self.report = _run(self.config_path, None, Path(home))
        if not self.report.passed:
            raise TestModeFailed(self.report.format())

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str:
        if isinstance(excinfo.value, TestModeFailed):
            return str(excinfo.value)
        from det_local.errors import DetLocalError

        if isinstance(excinfo.value, DetLocalError):
            return f"error: {excinfo.value}"
        return str(super().repr_failure(excinfo))

    def reportinfo(self) -> tuple[Path, int | None, str]:
        return self.config_path, None, f"det-local test mode: {self.config_path}"


def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    for raw in config.getoption("det_configs") or []:
        path = Path(raw).absolute()
        items.append(
            DetConfigItem.from_parent(session, name=f"det-config[{raw}]", config_path=path)
        )
