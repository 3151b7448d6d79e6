"""Measurements, not tests: scripts that print figures, in groups as lib/ is (trainer, rl, inference, gpu)."""
