"""Amounts of money."""
