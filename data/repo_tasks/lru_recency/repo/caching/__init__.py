"""Caches."""
