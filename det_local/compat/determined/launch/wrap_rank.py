"""`python3 -m determined.launch.wrap_rank RANK CMD...`: det_local.launch.wrap_rank."""

import sys

from det_local.launch.wrap_rank import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
