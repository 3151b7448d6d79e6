"""plainrl's shared library: one module per noun."""
