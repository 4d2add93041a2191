"""Orchard: a sandbox environment layer for training and evaluating AI agents."""

__version__ = "0.1.0"
