"""Federation (det_local/federate/) on loopback or in-process: link, blobs, gang protocol."""
