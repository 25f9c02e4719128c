"""What is not the algorithm: benchmark sweeps, evaluation, hub upload."""
