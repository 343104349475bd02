"""How the daemon itself is doing: the event loop's lag (``looplag.py``)."""
