"""Serving and weight sync: both engines' speed, kept sets, the weight check, pause modes, disk vs memory, LoRA."""
