"""Slurm pools (det_local/slurm/) against a private single-host Slurm (marker `slurm`)."""
