"""Dotted version numbers."""
