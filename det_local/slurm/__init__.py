"""Slurm pools: trials handed to a Slurm cluster as batch jobs (one per trial run).

`config.py` (a pool's settings), `script.py` (the batch script from a launch plan),
`client.py` (sbatch/squeue/scontrol/scancel, the batched poller), `launcher.py` (the pool's
Launcher), `submit.py` (checks at submission), `notify.py` (the batch shell's time-limit note).
Plugged in through `det_local/pools/`; `sched/` never imports this package.
"""
