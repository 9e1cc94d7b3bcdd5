"""One run's driver: the loop, the placements, the gates and the record."""
