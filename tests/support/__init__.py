"""Helpers the suite shares (not tests): the det-local world a test drives (world), real Unix
users (users), paths, network namespaces (fednet), a private Slurm (slurmkit), the dashboard and
its browser (dashboard, browser), searcher drivers (searchkit), a Python other users can run
(userpython), this checkout's Python opened to the test accounts while tests need it (reach), a
fake pynvml (nvml), DistributedContext ranks as processes (ranks), a Slurm node that is not this
host (slurmproxy), the CLI on a pseudo-terminal (tty), and the trial scripts several folders run
(trials/). Import them as
`from tests.support.world import Env, wait_for`; a test module never imports another
(tests/architecture/test_test_layout.py)."""
