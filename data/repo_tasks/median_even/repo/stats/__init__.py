"""Descriptive statistics."""
