"""The decisions: step records come in, limits go out. Pure Python, no torch."""
