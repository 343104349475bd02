"""det-local: Determined AI's training workflow on the machines a lab already has."""

__version__ = "0.1.0"
