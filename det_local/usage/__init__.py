"""Who used which GPU, and how well (issue 30): the daemon's sampler of system metrics
(`sampler.py`, reading `gpus.py` and `proctree.py`), idle reservations, and usage reports
(`report.py`) over the store's allocation records (`det_local/store/tables/usage.py`)."""
