"""How deeply data nests, found without recursion: for bounding what users send (configs,
requests) before any recursive code (validation, serialisation) walks it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def short_path(parts: Sequence[object], keep_head: int = 4, keep_tail: int = 2) -> str:
    """`hyperparameters.a.a.a.(57 more).a.a`: a long field path, readable on one line."""
    names = [str(p) if len(str(p)) <= 40 else str(p)[:37] + "..." for p in parts]
    if len(names) <= keep_head + keep_tail + 1:
        return ".".join(names)
    hidden = len(names) - keep_head - keep_tail
    return ".".join([*names[:keep_head], f"({hidden} more)", *names[-keep_tail:]])


def deep_path(value: Any, limit: int) -> list[object] | None:
    """The path (keys and list indexes) to the first mapping or list nested deeper than
    `limit` levels in `value` (the outermost counting as level 1), None when within it.
    Iterative and O(size): one stack of iterators, as deep as the nesting; the path is built
    only for the answer, never per node. Shared substructures are walked where they occur."""
    if not isinstance(value, (dict, list)):
        return None
    if limit < 1:
        return []
    keys: list[object] = []  # the key or index of each open container below the top
    stack: list[Any] = [iter(value.items()) if isinstance(value, dict) else enumerate(value)]
    while stack:
        for key, child in stack[-1]:
            if isinstance(child, (dict, list)):
                keys.append(key)
                if len(stack) >= limit:
                    return keys
                stack.append(iter(child.items()) if isinstance(child, dict) else enumerate(child))
                break
        else:
            stack.pop()
            if keys:
                keys.pop()
    return None
