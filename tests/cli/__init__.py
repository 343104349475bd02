"""The real CLI end to end (det_local/cli/, client/): `run`, the read verbs, tables, reattach."""
