"""plainrl's shared library: three rooms (orchestrator, trainer, inference), the models, and a flat ground."""
