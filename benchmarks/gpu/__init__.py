"""The GPU check on a bare CUDA machine, and the wheels it carries there."""
