"""The daemon's private files: what must never be in the database every user can read.

- ``daemon.key``: 32 random bytes, created at the first start. A trial run's token is
  HMAC-SHA256(key, "<job id>.<run id>"): nothing per run needs storing, and a restarted daemon
  recomputes the token of a trial it adopts.
- ``jobs/<id>.json``: a queued command's environment as its submitter had it (it may hold their
  cloud keys); removed once the command has started.
- ``experiments/<id>.json``: the allow-listed variables of an experiment's submitter (PATH,
  LANG...), for its trials; removed when the experiment ends.
- ``legacy-tokens.json``: tokens of trials started by a det-local that kept them in the
  database, moved here (and out of the database) at the first start after the upgrade.

Everything lives in ``DET_LOCAL_HOME/private`` (mode 0700, the daemon's user), each file 0600,
written atomically (a temporary file, then a rename) and read without following links.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
from pathlib import Path
from typing import Any

from det_local.errors import DetLocalError
from det_local.store.paths import Paths
from det_local.store.safe_open import read_bounded

MAX_ENV_BYTES = 4 * 1024 * 1024  # the spool's own bound on a request
KEY_BYTES = 32


class PrivateFiles:
    def __init__(self, paths: Paths) -> None:
        self.paths = paths
        self._key: bytes | None = None
        self._legacy: dict[int, tuple[int, str]] | None = None

    # ------------------------------------------------------------------ the directory
    def ensure(self) -> None:
        """Create (or tighten) the private directory: the daemon's user's, mode 0700."""
        for d in (self.paths.private, self.paths.job_envs, self.paths.experiment_envs):
            try:
                d.mkdir(mode=0o700)
            except FileExistsError:
                pass
            st = os.lstat(d)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                raise DetLocalError(
                    f"{d} is not a directory of uid {os.geteuid()}; det-local keeps its secrets "
                    "there: remove it and start again"
                )
            if stat.S_IMODE(st.st_mode) != 0o700:
                os.chmod(d, 0o700)

    # ------------------------------------------------------------------ tokens
    def key(self) -> bytes:
        if self._key is None:
            path = self.paths.daemon_key
            try:
                raw = read_bounded(path, 1024, owner=os.geteuid(), what="daemon key")
            except FileNotFoundError:
                self._write(path, secrets.token_hex(KEY_BYTES).encode())
                raw = read_bounded(path, 1024, owner=os.geteuid(), what="daemon key")
            text = raw.decode("ascii", "replace").strip()
            if len(text) < 2 * KEY_BYTES:
                raise DetLocalError(
                    f"daemon key {path} is damaged ({len(text)} characters); remove it and "
                    "restart the daemon (running trials then restart from their checkpoints)"
                )
            self._key = bytes.fromhex(text)
        return self._key

    def run_token(self, job_id: int, run_id: int) -> str:
        """The token of one run of a trial: derived, never stored (a legacy one where a trial
        started by an older det-local is still running with it)."""
        legacy = self._legacy_tokens().get(job_id)
        if legacy is not None and legacy[0] == run_id:
            return legacy[1]
        msg = f"{job_id}.{run_id}".encode()
        return hmac.new(self.key(), msg, hashlib.sha256).hexdigest()

    def keep_legacy_tokens(self, tokens: dict[int, tuple[int, str]]) -> None:
        """Tokens (job id -> (run id, token)) an older det-local kept in the database, for the
        trials still running with them; merged with those kept before."""
        merged = dict(self._legacy_tokens())
        merged.update(tokens)
        self._write(
            self.paths.legacy_tokens,
            json.dumps({str(k): [r, t] for k, (r, t) in merged.items()}).encode(),
        )
        self._legacy = merged

    def prune_legacy_tokens(self, live: dict[int, int]) -> None:
        """Keep only the tokens of runs still live (job id -> its run id)."""
        tokens = self._legacy_tokens()
        kept = {j: v for j, v in tokens.items() if live.get(j) == v[0]}
        if kept == tokens:
            return
        if kept:
            self._legacy = {}
            self.keep_legacy_tokens(kept)
        else:
            _unlink(self.paths.legacy_tokens)
            self._legacy = {}

    def _legacy_tokens(self) -> dict[int, tuple[int, str]]:
        if self._legacy is None:
            data = self._read_json(self.paths.legacy_tokens, "legacy token file")
            self._legacy = {int(k): (int(v[0]), str(v[1])) for k, v in (data or {}).items()}
        return self._legacy

    # ------------------------------------------------------------------ environments
    def save_job_env(self, job_id: int, env: dict[str, str]) -> None:
        self._write(self.paths.job_env(job_id), json.dumps(env).encode(), sync=False)

    def job_env(self, job_id: int) -> dict[str, str] | None:
        return _env(self._read_json(self.paths.job_env(job_id), f"job {job_id}'s environment"))

    def drop_job_env(self, job_id: int) -> None:
        _unlink(self.paths.job_env(job_id))

    def save_experiment_env(self, experiment_id: int, env: dict[str, str]) -> None:
        self._write(self.paths.experiment_env(experiment_id), json.dumps(env).encode(), sync=False)

    def experiment_env(self, experiment_id: int) -> dict[str, str] | None:
        return _env(
            self._read_json(
                self.paths.experiment_env(experiment_id),
                f"experiment {experiment_id}'s environment",
            )
        )

    def drop_experiment_env(self, experiment_id: int) -> None:
        _unlink(self.paths.experiment_env(experiment_id))

    def saved_job_envs(self) -> list[int]:
        return _ids(self.paths.job_envs)

    def saved_experiment_envs(self) -> list[int]:
        return _ids(self.paths.experiment_envs)

    # ------------------------------------------------------------------ files
    def _write(self, path: Path, data: bytes, *, sync: bool = True) -> None:
        """Atomically (a new name, then rename), mode 0600. With sync, fsync'ed before the
        caller commits what refers to it. Environments are written without: the store's own
        commits (WAL, synchronous=NORMAL) outlive a daemon crash but not a power cut, and so
        does a renamed file in the page cache; an fsync per queued command cost ~0.3 ms of the
        daemon's ~3 ms per job. A file lost with the power fails its command's start in one
        line, as a damaged one does."""
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if sync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            _unlink(tmp)
            raise
        os.close(fd)
        os.replace(tmp, path)

    def _read_json(self, path: Path, what: str) -> Any:
        try:
            raw = read_bounded(path, MAX_ENV_BYTES, owner=os.geteuid(), what=what)
        except FileNotFoundError:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            raise DetLocalError(f"{what} ({path}) is damaged; remove it") from None


def _env(data: Any) -> dict[str, str] | None:
    if data is None:
        return None
    return {str(k): str(v) for k, v in dict(data).items()}


def _ids(directory: Path) -> list[int]:
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(int(n[:-5]) for n in names if n.endswith(".json") and n[:-5].isdigit())


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
