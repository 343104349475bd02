"""`python3 -m determined.launch.horovod`: det_local.launch.horovod."""

import sys

from det_local.launch import _args
from det_local.launch.horovod import main, plan

__all__ = ["main", "plan"]

if __name__ == "__main__":
    sys.exit(_args.run_main(main))
