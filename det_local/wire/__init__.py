"""What crosses a trust boundary as bytes: decoding with a budget (``budget.py``)."""
