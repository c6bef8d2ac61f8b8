"""The fleet: the supervisor (processes) and the pure scaling policy."""
