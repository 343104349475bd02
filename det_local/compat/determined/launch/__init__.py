"""`determined.launch`: det-local's launchers under Determined's names (det_local.launch)."""

from det_local.launch import LAUNCHERS, install_unknown_launcher_hook

__all__ = ["LAUNCHERS"]

install_unknown_launcher_hook(__name__)
