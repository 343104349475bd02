"""The store (det_local/store/): state tables, the jobs mirror, logs, checkpoints and their GC."""
