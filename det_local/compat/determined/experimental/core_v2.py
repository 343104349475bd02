"""`determined.experimental.core_v2`: det_local.trial.core_v2 itself (not a copy of its names:
init() sets module-level singletons, core_v2.train etc., that scripts read from this module)."""

import sys

from det_local.trial import core_v2 as _core_v2

sys.modules[__name__] = _core_v2
