"""`determined.exec`: the modules Determined runs with `python3 -m` (the Trial harness)."""
