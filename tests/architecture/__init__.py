"""The house's habits: docs/architecture.md names only what exists, no import circle, the walls,
the tests' own layout."""
