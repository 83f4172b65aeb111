"""Helpers shared by the tests (not tests themselves): trainer subprocess runs, object-store
stand-ins, NumPy references, XLA flags, and the repository paths (`paths`)."""
