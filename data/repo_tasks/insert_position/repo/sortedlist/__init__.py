"""Keeping lists sorted."""
