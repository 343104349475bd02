"""PyTorchTrial's checkpoints: their layout on disk, how the training loop saves and loads
them, and a trial rebuilt from one outside training."""
