"""A request's path as the routes see it: behind a proxy that serves the app under a prefix
(--root-path, vLLM's flag), uvicorn puts the prefix before every path and starlette's router
takes it off again; the middlewares and error shapes must read the path the same way."""

from __future__ import annotations

from starlette.types import Scope


def route_path(scope: Scope) -> str:
    """scope's path without its root_path prefix."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if root and (path == root or path.startswith(f"{root}/")):
        return path[len(root):] or "/"
    return path
