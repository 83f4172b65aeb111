"""Contact details in free text."""
