"""Small helpers over sequences."""
