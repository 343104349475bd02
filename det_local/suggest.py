"""Did-you-mean suggestions for misspelt keys and values."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def closest(
    word: object, candidates: Iterable[str], aliases: dict[str, str] | None = None
) -> str | None:
    """The candidate closest to `word` (case-insensitive), or None if nothing is close enough."""
    if not isinstance(word, str):
        return None
    options = sorted(set(candidates))
    lowered = word.strip().lower().replace("-", "_")
    if aliases and lowered in aliases:
        return aliases[lowered]
    for option in options:
        if option.lower() == lowered:
            return option
    matches = difflib.get_close_matches(lowered, options, n=1, cutoff=0.7)
    if matches:
        return matches[0]
    # `seed` -> `experiment_seed`: a unique option that contains the word (or is contained).
    if len(lowered) >= 3:
        containing = [o for o in options if lowered in o.lower() or o.lower() in lowered]
        if len(containing) == 1:
            return containing[0]
    return None


def did_you_mean(
    word: object, candidates: Iterable[str], aliases: dict[str, str] | None = None
) -> str:
    """`"; did you mean 'x'?"` or `" (valid: a, b, c)"`, ready to append to a message."""
    options = sorted(set(candidates))
    guess = closest(word, options, aliases)
    if guess is not None:
        return f"; did you mean '{guess}'?"
    return f" (valid: {', '.join(options)})"


def check_section_keys(
    where: str, raw: Iterable[object], allowed: Iterable[str], source: str
) -> None:
    """The one check of a daemon.yaml section's keys (scheduler, slots, federation, dashboard,
    system_metrics, resource_pools, a pool's backend): the first unknown key is a ConfigError
    naming it with its section (`where`, e.g. "federation."), the file and a did-you-mean, or
    the valid keys when nothing is close."""
    from det_local.errors import ConfigError

    options = sorted(set(allowed))
    for key in raw:
        if key not in options:
            guess = closest(key, options)
            hint = (
                f"did you mean '{guess}'?" if guess is not None else f"valid: {', '.join(options)}"
            )
            raise ConfigError(f"unknown field '{where}{key}' in {source}; {hint}")
