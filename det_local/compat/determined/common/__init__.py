"""`determined.common`: the parts of Determined's package user scripts import (``util``)."""

from . import util

__all__ = ["util"]
