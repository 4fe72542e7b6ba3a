"""Experiment grids and the paper's tables and claims, computed from evaluated variants."""
