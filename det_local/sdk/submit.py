"""client.create_experiment: submit a config and a model directory and return at once.

To a running engine (the daemon, or a `det-local run` in another terminal) the submission is
a spool request as the caller, as `det-local run --detach` sends it. With none running, the
SDK starts one for this experiment in the background (`det-local run --quiet`, in a session
of its own so that it outlives a notebook kernel, as a Determined cluster would): it runs the
experiment, collects its checkpoints and exits; its output goes to a file in the system's
temporary directory, named in the error should it fail before the experiment exists.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterable
from typing import Any

from det_local.errors import ConfigError, DetLocalError
from det_local.sdk._session import Session

STARTUP_TIMEOUT_S = 120.0
_CREATED = re.compile(rb"Created experiment (\d+)")


def load(config: str | pathlib.Path | dict[str, Any]) -> dict[str, Any]:
    from det_local.config import load_yaml

    if isinstance(config, (str, pathlib.Path)):
        try:
            text = pathlib.Path(config).read_text(encoding="utf-8")
        except OSError as err:
            raise ConfigError(f"{config}: cannot read the config ({err.strerror})") from None
        data = load_yaml(text, str(config))
        if not isinstance(data, dict):
            raise ConfigError(f"{config}: an experiment config is a YAML mapping")
        return data
    if isinstance(config, dict):
        return dict(config)
    raise ValueError("config parameter must be dictionary or path")


def create(
    session: Session,
    config: str | pathlib.Path | dict[str, Any],
    model_dir: str | pathlib.Path | None = None,
    includes: Iterable[str | pathlib.Path] | None = None,
    project_id: int | None = None,
    template: str | None = None,
) -> int:
    """The new experiment's id."""
    from det_local.config import parse_config

    if template is not None:
        raise DetLocalError(
            f"create_experiment(template={template!r}): det-local has no config templates; "
            "merge the template's settings into the config"
        )
    if project_id is not None:
        warnings.warn(
            f"create_experiment(project_id={project_id}): det-local has no projects; the "
            "experiment is created without one",
            stacklevel=3,
        )
    data = load(config)
    source = str(config) if not isinstance(config, dict) else "<config dict>"
    cfg = parse_config(data, source=source)  # a bad config fails here, naming the field
    with tempfile.TemporaryDirectory(prefix="det-local-sdk-") as tmp:
        context = _context(pathlib.Path(tmp), model_dir, includes)
        from det_local.client.requester import retrying
        from det_local.sched.enginelock import lock_free

        def attempt() -> int:
            if not lock_free(session.paths):
                return _submit_remote(session, cfg.to_dict(), context, source)
            return _start_engine(session, data, context, pathlib.Path(tmp))

        return retrying(session.paths, attempt)


def _context(
    tmp: pathlib.Path,
    model_dir: str | pathlib.Path | None,
    includes: Iterable[str | pathlib.Path] | None,
) -> pathlib.Path:
    """The directory to snapshot: model_dir; with includes, a copy of it with each included
    file or directory at its top (as Determined adds them to the model definition); with
    neither, an empty one (the entrypoint is then found on the machine's own path)."""
    extra = [pathlib.Path(i) for i in includes or []]
    if model_dir is not None and not extra:
        return pathlib.Path(model_dir).resolve()
    ctx = tmp / "context"
    if model_dir is not None:
        shutil.copytree(pathlib.Path(model_dir), ctx, symlinks=True)
    else:
        ctx.mkdir()
    for inc in extra:
        if not inc.exists():
            raise DetLocalError(f"create_experiment(includes=...): {inc} does not exist")
        dest = ctx / inc.resolve().name
        if inc.is_dir():
            shutil.copytree(inc, dest, symlinks=True, dirs_exist_ok=True)
        else:
            shutil.copy2(inc, dest)
    return ctx


def _submit_remote(
    session: Session, config: dict[str, Any], context: pathlib.Path, source: str
) -> int:
    from det_local.client.requester import remote_request
    from det_local.sched.run.launchplan import allowed_submitter_vars
    from det_local.sched.run.userfiles import current_umask

    payload = {
        "config": config,
        "context": str(context),
        "source": source,
        "test_mode": False,
        "env": allowed_submitter_vars(os.environ),
        "umask": current_umask(),
    }
    return int(remote_request(session.paths, "submit", payload))


def _start_engine(
    session: Session, data: dict[str, Any], context: pathlib.Path, tmp: pathlib.Path
) -> int:
    import yaml

    cfg_path = tmp / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(data, sort_keys=False))
    fd, out_name = tempfile.mkstemp(prefix="det-local-sdk-run-", suffix=".log")
    env = dict(os.environ, DET_LOCAL_HOME=str(session.paths.home))
    with os.fdopen(fd, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "det_local.cli.main",
                "run",
                "--quiet",
                str(cfg_path),
                str(context),
            ],  # fmt: skip
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        text = pathlib.Path(out_name).read_bytes()
        found = _CREATED.search(text)
        if found:
            return int(found.group(1))
        code = proc.poll()
        if code is not None:
            lines = text.decode(errors="replace").strip().splitlines()
            raise DetLocalError(
                lines[-1]
                if lines
                else f"det-local run exited with {code} before the "
                f"experiment was created (its output: {out_name})"
            )
        if time.monotonic() > deadline:
            raise DetLocalError(
                f"det-local run did not create the experiment in {STARTUP_TIMEOUT_S:.0f}s; "
                f"its output is in {out_name}"
            )
        time.sleep(0.05)
