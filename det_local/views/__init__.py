"""Read models: what the CLI's lists and the dashboard show, read from the store as the caller
(read-only) and from the files the daemon writes. Commands that change things are in `api.py`."""
