"""Gregorian calendar helpers."""
