"""det-local's pytest plugin (registered under the pytest11 entry point).

* The ``det_local_test_mode`` fixture runs an experiment config in test mode (one batch,
  validate, checkpoint, restore in a new process, one more batch) on a throwaway
  DET_LOCAL_HOME and returns the ``TestReport`` (steps, metrics, checkpoint path) for
  assertions; by default a failed step fails the test with the step and the trial's traceback.
* ``pytest --det-configs PATH...`` collects each experiment config as a test item that runs it
  in test mode, with the config's directory as the context (its id: ``PATH::det-config[NAME]``).

A failed run keeps its DET_LOCAL_HOME (removed only when the run passed), and the failure says
how to read the trial's logs there. The plugin needs pytest itself: ``pip install pytest`` (the
``examples`` and ``test`` extras have it).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from det_local.client.testmode import TestReport


class TestModeFailed(AssertionError):
    """A test-mode step failed; the message is the report (steps and traceback)."""


_CONFIGS = pytest.StashKey[dict[str, bool]]()  # --det-configs paths -> collected yet


def _failed(report: TestReport, home: Path) -> TestModeFailed:
    """The report, and where the trial's logs are (its home is kept)."""
    text = report.format()
    if report.trial_id is not None:
        text += f"\nits home is kept: DET_LOCAL_HOME={home} det-local trial logs {report.trial_id}"
    return TestModeFailed(text)


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
        home = tmp_path_factory.mktemp("det-local-home")  # kept by pytest (its basetemp)
        report = _run(Path(config), Path(context) if context is not None else None, home)
        if check and not report.passed:
            raise _failed(report, home)
        return report

    yield run


class DetConfigItem(pytest.Item):
    def __init__(self, *, config_path: Path, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.config_path = config_path
        self.report: TestReport | None = None

    def runtest(self) -> None:
        home = Path(tempfile.mkdtemp(prefix="det-local-home-"))
        self.report = _run(self.config_path, None, home)
        if not self.report.passed:
            raise _failed(self.report, home)  # the home stays for its logs
        shutil.rmtree(home, ignore_errors=True)

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str:
        if isinstance(excinfo.value, TestModeFailed):
            return str(excinfo.value)
        from det_local.errors import DetLocalError

        if isinstance(excinfo.value, DetLocalError):
            return f"error: {excinfo.value}"
        return str(super().repr_failure(excinfo))

    def reportinfo(self) -> tuple[Path, int | None, str]:
        return self.config_path, None, f"det-local test mode: {self.config_path}"


class DetConfigFile(pytest.File):
    """An experiment config named by --det-configs: one test item, its test-mode run."""

    def collect(self) -> Iterator[pytest.Item]:
        yield DetConfigItem.from_parent(
            self, name=f"det-config[{self.path.name}]", config_path=self.path
        )


def pytest_configure(config: pytest.Config) -> None:
    """--det-configs paths are collected like files named on the command line (counted in
    "collected N items", ids with their path)."""
    paths = [str(Path(raw).absolute()) for raw in config.getoption("det_configs") or []]
    config.stash[_CONFIGS] = dict.fromkeys(paths, False)
    config.args.extend(p for p in paths if p not in config.args)


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    configs = parent.config.stash.get(_CONFIGS, {})
    key = str(file_path)
    if configs.get(key) is False:  # once, though a directory walk may find it again
        configs[key] = True
        # its id names it from the rootdir ("../configs/const.yaml" outside it), never ""
        nodeid = os.path.relpath(file_path, parent.config.rootpath)
        return DetConfigFile.from_parent(parent, path=file_path, nodeid=nodeid)
    return None
