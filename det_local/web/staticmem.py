"""The dashboard's static files (scripts, styles, the vendored chart libraries: ~1.3 MB),
read into memory when the application is built.

A dashboard started as root with a user to run as (the daemon's, `dashboard --user`) builds
its application before it drops to that user, who may not be able to read det-local's own
files (a venv under root's 0700 home): read at each request, the login's script and service
worker were refused and nobody could log in. Read once at start, they are served whatever the
user; an edit of the files shows at the dashboard's next start.
"""

from __future__ import annotations

import hashlib
import mimetypes
import os
from pathlib import Path

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

# what the browser must check again before use (the files change with det-local's version)
CACHE = "no-cache"
TYPES = {".js": "text/javascript", ".css": "text/css", ".md": "text/plain"}


class StaticFiles:
    """Every regular file under `root` (links not followed), by its path relative to it."""

    def __init__(self, root: Path) -> None:
        self.files: dict[str, tuple[bytes, str, str]] = {}
        for dirpath, _, names in os.walk(root):
            for name in names:
                path = Path(dirpath) / name
                if path.is_symlink() or not path.is_file() or "__pycache__" in path.parts:
                    continue
                rel = path.relative_to(root).as_posix()
                data = path.read_bytes()
                kind = TYPES.get(path.suffix) or mimetypes.guess_type(name)[0]
                etag = '"' + hashlib.sha256(data).hexdigest()[:32] + '"'
                self.files[rel] = (data, kind or "application/octet-stream", etag)

    def response(self, rel: str, request: Request) -> Response:
        found = self.files.get(rel)
        if found is None:
            raise HTTPException(404)  # the dashboard's own not-found page
        data, kind, etag = found
        headers = {"cache-control": CACHE, "etag": etag}
        if request.headers.get("if-none-match") == etag:
            return Response(status_code=304, headers=headers)
        return Response(data, media_type=kind, headers=headers)
