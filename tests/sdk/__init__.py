"""The Python SDK (det_local/sdk/) and the model registry."""
