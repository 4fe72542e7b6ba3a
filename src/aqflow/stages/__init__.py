"""Stage CLIs: each reads its inputs from files and writes its artifacts atomically."""
