"""Day-two operations of the engine (issue 27): draining slots and this node (`drain.py`),
log policies on trial output (`logpolicy.py`), log retention (`retention.py`)."""
