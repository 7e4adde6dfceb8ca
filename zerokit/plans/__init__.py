"""Plans for ``zerokit.parallelize``: how an unmodified model is split and placed."""
