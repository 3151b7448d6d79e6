"""The policy update and what it writes: loss, output head, packing, optimizer, the trainable model, checkpoints."""
