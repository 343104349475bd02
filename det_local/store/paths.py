"""Every on-disk location det-local uses. Nothing else joins paths under DET_LOCAL_HOME."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# AF_UNIX paths are limited to 108 bytes including the terminating NUL.
_MAX_SOCKET_PATH = 100


def default_home() -> Path:
    """DET_LOCAL_HOME, else /var/lib/det-local for root, else $XDG_DATA_HOME/det-local."""
    env = os.environ.get("DET_LOCAL_HOME")
    if env:
        return Path(env).expanduser().absolute()
    if os.geteuid() == 0:
        return Path("/var/lib/det-local")
    xdg = os.environ.get("XDG_DATA_HOME") or os.path.join(
        os.path.expanduser("~"), ".local", "share"
    )
    return Path(xdg) / "det-local"


@dataclass(frozen=True)
class Paths:
    home: Path

    @classmethod
    def from_env(cls) -> Paths:
        return cls(default_home())

    # -- top level -------------------------------------------------------------------------
    @property
    def db(self) -> Path:
        return self.home / "det-local.db"

    @property
    def settings(self) -> Path:
        """The daemon's settings (scheduler mode, preemption, quotas, CPU slots)."""
        return self.home / "daemon.yaml"

    @property
    def queue(self) -> Path:
        return self.home / "queue"

    @property
    def run_dir(self) -> Path:
        return self.home / "run"

    @property
    def cluster_key(self) -> Path:
        """The federation's shared secret (`det-local cluster init|join`), mode 0600."""
        return self.home / "cluster.key"

    @property
    def cluster_left(self) -> Path:
        """Present after `det-local cluster leave` (key kept): the daemon does not federate."""
        return self.home / "cluster.left"

    @property
    def cluster_socket(self) -> Path:
        """The daemon's federation socket: the cluster view for the CLI on this machine."""
        path = self.run_dir / "cluster.sock"
        if len(str(path)) <= _MAX_SOCKET_PATH:
            return path
        import hashlib  # only for a home too deep for a socket path: its import costs ms

        digest = hashlib.sha256(str(self.home).encode()).hexdigest()[:16]
        return Path("/tmp") / f"det-local-{digest}-cluster.sock"

    @property
    def dashboard_log(self) -> Path:
        """The output of the dashboard the daemon runs (daemon.yaml's `dashboard:`)."""
        return self.run_dir / "dashboard.log"

    @property
    def pid_file(self) -> Path:
        return self.run_dir / "daemon.pid"

    @property
    def socket(self) -> Path:
        """The daemon's unix socket; moved to a short /tmp path when the home is too deep."""
        path = self.run_dir / "daemon.sock"
        if len(os.fsencode(str(path))) <= _MAX_SOCKET_PATH:
            return path
        import hashlib

        digest = hashlib.sha1(os.fsencode(str(self.home))).hexdigest()[:16]
        return Path("/tmp") / f"det-local-{os.geteuid()}-{digest}.sock"

    @property
    def checkpoints(self) -> Path:
        """Default checkpoint storage (a config's checkpoint_storage overrides it)."""
        return self.home / "checkpoints"

    # -- private files: secrets never go in the (world-readable) database ---------------------
    @property
    def private(self) -> Path:
        """The daemon's own directory (mode 0700): its key, the environments captured at
        submission. Nobody else can list or read it."""
        return self.home / "private"

    @property
    def daemon_key(self) -> Path:
        """The daemon's secret (0600): per-run trial tokens are derived from it."""
        return self.private / "daemon.key"

    @property
    def legacy_tokens(self) -> Path:
        """Tokens of trials started by a det-local that kept them in the database (0600)."""
        return self.private / "legacy-tokens.json"

    @property
    def job_envs(self) -> Path:
        return self.private / "jobs"

    @property
    def experiment_envs(self) -> Path:
        return self.private / "experiments"

    def job_env(self, job_id: int) -> Path:
        """A queued command's environment, as its submitter had it (0600)."""
        return self.job_envs / f"{job_id}.json"

    def experiment_env(self, experiment_id: int) -> Path:
        """The allow-listed variables of an experiment's submitter, for its trials (0600)."""
        return self.experiment_envs / f"{experiment_id}.json"

    # -- per experiment / trial -------------------------------------------------------------
    def experiment_dir(self, experiment_id: int) -> Path:
        return self.home / "experiments" / str(experiment_id)

    def staging_dir(self, name: str) -> Path:
        """Where a context snapshot is built before its experiment exists (renamed after)."""
        return self.home / "experiments" / f".incoming-{name}"

    def context_dir(self, experiment_id: int) -> Path:
        return self.experiment_dir(experiment_id) / "context"

    def trial_dir(self, experiment_id: int, trial_id: int) -> Path:
        return self.experiment_dir(experiment_id) / "trials" / str(trial_id)

    def trial_log(self, experiment_id: int, trial_id: int) -> Path:
        """The trial's combined output (every run appends; ranks are prefixed `[rank=N] `)."""
        return self.trial_dir(experiment_id, trial_id) / "output.log"

    def metric_events_dir(self, experiment_id: int, trial_id: int) -> Path:
        """TensorBoard event files `tensorboard start` writes from a trial's stored metrics:
        in the caller's own cache (outside the home, which a shared daemon owns), one
        directory per home."""
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        import hashlib

        digest = hashlib.sha256(str(self.home).encode()).hexdigest()[:12]
        return (
            Path(cache) / "det-local" / "tensorboard" / digest
            / f"experiment_{experiment_id}" / f"trial_{trial_id}"
        )  # fmt: skip

    def trial_info_dir(self, experiment_id: int, trial_id: int, run_id: int) -> Path:
        """cluster.json / trial.json for one run of a trial (what get_cluster_info() reads)."""
        return self.trial_dir(experiment_id, trial_id) / "runs" / str(run_id)

    def unmanaged_token(self, trial_id: int, run_id: int) -> Path:
        """The session token of an unmanaged run (core_v2), readable by its requester only;
        removed once its process has connected."""
        return self.run_dir / "tokens" / f"{trial_id}-{run_id}.token"

    # -- jobs (commands, and the exit files of every job) ------------------------------------
    def job_dir(self, job_id: int) -> Path:
        return self.home / "jobs" / str(job_id)

    @property
    def exit_dir(self) -> Path:
        """Where job wrappers write exit statuses: root's in system mode, never a user's."""
        return self.run_dir / "exit"

    def job_exit_file(self, job_id: int, run_id: int) -> Path:
        """Where a job's wrapper writes its exit status (read after a daemon restart)."""
        return self.exit_dir / f"{job_id}-{run_id}"

    def legacy_job_exit_file(self, job_id: int, run_id: int) -> Path:
        """Where det-local's wrapper wrote it before the exit status moved to `exit_dir` (in
        the job's directory, which belongs to its user): read, bounded, only for jobs started
        by the old wrapper, or where setpriv is missing."""
        return self.job_dir(job_id) / f"exit-{run_id}"

    def command_log(self, job_id: int) -> Path:
        return self.job_dir(job_id) / "output.log"

    def ensure(self) -> Paths:
        for d in (self.home, self.queue, self.run_dir, self.checkpoints):
            d.mkdir(parents=True, exist_ok=True)
        return self
