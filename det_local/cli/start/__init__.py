"""How the `det-local` command starts: its entry (`entry.py`), help from a cache (`helpcache.py`),
the top group whose commands load when invoked (`lazy.py`), and the few hot commands parsed
without typer (`fast.py`)."""
