"""`determined.experimental`: the SDK names det-local provides (client.get_checkpoint)."""

from . import client
from .client import Checkpoint

__all__ = ["Checkpoint", "client"]
