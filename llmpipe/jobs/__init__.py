"""A job's state in Redis: the record, cancel, token streams, stage memo, dead letters, the deadline watchdog, admission and lanes."""
