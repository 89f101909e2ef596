"""Training: the loop (trainer), optimiser and schedule, loss, metrics."""
