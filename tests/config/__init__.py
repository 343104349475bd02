"""Experiment configs: loading, validation messages, limits, the context, `config check`."""
