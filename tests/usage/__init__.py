"""Usage reports and system metrics (det_local/usage/)."""
