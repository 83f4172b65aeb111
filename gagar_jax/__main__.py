"""`python -m gagar_jax` runs the trainer's CLI (the same as the `gagar-train` entry point)."""
from gagar_jax.run.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
