"""An online shop's pricing."""
