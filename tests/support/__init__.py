"""Helpers the suite shares (not tests): the det-local world a test drives (world), real Unix
users (users), paths, network namespaces (fednet), a private Slurm (slurmkit), the dashboard and
its browser (dashboard, browser), searcher drivers (searchkit), a Python other users can run
(userpython). Import them as `from tests.support.world import Env, wait_for`."""
