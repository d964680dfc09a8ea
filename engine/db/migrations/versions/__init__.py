"""One file per schema revision, oldest first: v0001_baseline.py, v0002_..."""
