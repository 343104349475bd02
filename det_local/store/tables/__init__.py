"""The store's tables, one module each: `db.Store` joins them, and appends each module's
`SCHEMA` in `db.py`."""
