"""Time formats."""
