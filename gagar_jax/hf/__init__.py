"""Hugging Face checkpoints both ways: config.json, family tables, sharded load, \
parallel save, safetensors."""
