"""Helpers of the reliability tests, reached through conftest's ``rel`` fixture."""
