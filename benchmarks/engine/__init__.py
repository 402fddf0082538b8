"""The engine defaults' trade-off: start-up seconds against tokens per second."""
