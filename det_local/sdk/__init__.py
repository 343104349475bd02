"""Determined 0.38's Python SDK (`determined.experimental.client`) over det-local: one module
per concept (experiment, trial, checkpoint, model, metrics), the enums, creating experiments
(`submit.py`) and the module functions (`client.py`). Reads go to the store; changes go to
the engine's spool as the calling user (`_session.py`)."""
