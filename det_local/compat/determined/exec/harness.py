"""`python3 -m determined.exec.harness module:TrialClass`: det_local.trial.harness."""

import sys

from det_local.trial.harness import load_trial_class, main, run

__all__ = ["load_trial_class", "main", "run"]

if __name__ == "__main__":
    sys.exit(main())
