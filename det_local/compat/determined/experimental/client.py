"""`determined.experimental.client`: det_local.sdk.client itself (not a copy of its names:
login() sets the module's default client, which the module functions read)."""

import sys

from det_local.sdk import client as _client

sys.modules[__name__] = _client
