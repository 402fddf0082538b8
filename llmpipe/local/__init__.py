"""One machine's whole stack: ``llmpipe up``, its supervisor and restart policy, the embedded Redis."""
