"""Feeding data in batches."""
