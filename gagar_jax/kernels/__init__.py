"""Compute kernels behind one registry per family: attention/ and experts/."""
