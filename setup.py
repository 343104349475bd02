"""Packages: det_local, plus the `determined` import name it provides (det_local/compat)."""

from setuptools import find_packages, setup

COMPAT = "det_local/compat"
compat = find_packages(COMPAT, include=["determined", "determined.*"])

setup(
    packages=find_packages(include=["det_local", "det_local.*"]) + compat,
    package_dir={name: f"{COMPAT}/{name.replace('.', '/')}" for name in compat},
)
