"""DeepSpeed on a CPU builds its shared-memory comm op just in time (torch.utils.cpp_extension),
into ~/.cache/torch_extensions/<python>_cpu/deepspeed_shm_comm/ (or $TORCH_EXTENSIONS_DIR), and
every process that starts DeepSpeed's comm takes that directory's ``lock`` file while ninja checks
the build (~1 s; ~40 s for the first build). A process killed meanwhile (a test stopping the
other ranks when one fails, a pause, a kill) leaves the lock behind, and every later DeepSpeed
start of that user waits for it forever (seen: each later DeepSpeed test hung 120 s).

Between tests nothing of an earlier test runs (each cleans up its processes), so a lock found as
a test starts is such a leftover: removed."""

from __future__ import annotations

import glob
import os
import pwd

PATTERN = ".cache/torch_extensions/*/*/lock"


def homes() -> set[str]:
    """Every account's home directory that has a torch extensions cache (root's, test users')."""
    found = set()
    for entry in pwd.getpwall():
        home = entry.pw_dir
        if home and home != "/" and os.path.isdir(os.path.join(home, ".cache", "torch_extensions")):
            found.add(home)
    return found


def stale_locks() -> list[str]:
    paths: list[str] = []
    for home in sorted(homes()):
        paths += glob.glob(os.path.join(home, PATTERN))
    override = os.environ.get("TORCH_EXTENSIONS_DIR")
    if override:
        paths += glob.glob(os.path.join(override, "*", "lock"))
    return paths


def clear_stale_locks() -> list[str]:
    """Remove the build locks left by killed processes; the paths removed."""
    removed = []
    for path in stale_locks():
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed
