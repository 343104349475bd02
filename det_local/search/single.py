"""The single searcher: one trial, trained for max_length (or as long as the trial decides)."""

from __future__ import annotations

from det_local.search.random_search import SingleSearch

__all__ = ["SingleSearch"]
