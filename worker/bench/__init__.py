"""``inferfleet bench``: load generation, fleet setup, the report and the naive baseline."""
