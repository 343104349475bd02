"""The dashboard (det_local/web/) over HTTP: pages, API, limits, the daemon's dashboard."""
