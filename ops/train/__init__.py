"""The embedded demo model's trainer (train_demo.py) and its corpus split (corpus.py)."""
