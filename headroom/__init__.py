"""The composition root: what sits above engine/ and bench/ and joins them (the `headroom` console script)."""
