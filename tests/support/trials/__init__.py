"""Trial scripts that tests in several folders run, each with the config that runs it and the
readers of what it leaves (metrics, checkpoints, the facts it writes)."""
