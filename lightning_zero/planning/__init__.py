"""Planning a run before it starts: memory per rank, the estimator, communication and time models."""
