"""Calendar dates from text."""
