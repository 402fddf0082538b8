"""Test and benchmark support, as ``celery.contrib.testing``: fault injection and network-namespace hosts. Runtime code never imports it."""
