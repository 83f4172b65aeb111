"""The Gagar math as pure functions: grading (tier/rank -> factor), advantages, the loss, \
step metrics."""
