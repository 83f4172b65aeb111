"""The trainer: CLI, the visible loop, the jitted step, optimizer, start-up checks, \
checkpoints, publishing, metrics."""
