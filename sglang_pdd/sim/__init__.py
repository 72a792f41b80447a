"""Cluster-scale discrete-event model of PDD, its baselines and its economics (BCR)."""
