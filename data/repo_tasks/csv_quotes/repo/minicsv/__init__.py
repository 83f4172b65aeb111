"""Reading and writing CSV lines."""
