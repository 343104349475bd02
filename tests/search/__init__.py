"""Hyperparameter search (det_local/search/): arithmetic, simulations, through the daemon."""
