"""Numeric helpers."""
