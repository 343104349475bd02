"""Trial-side APIs (det_local/trial/, compat/): Core API, PyTorch, DeepSpeed, test mode."""
