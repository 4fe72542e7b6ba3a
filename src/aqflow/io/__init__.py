"""Files between stages: atomic, checksummed artifacts (`artifacts`), tensor files, fetching from package registries, finiteness checks."""
