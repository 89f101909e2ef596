"""Memory options applied around an unmodified model: precision, activation recompute."""
