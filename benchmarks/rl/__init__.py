"""Whole RL runs: the recipes, the demo's gain, the flat-group filter, the environment layer, TRL beside plainrl."""
