"""Servers and the weights that reach them: starting or attaching servers, vLLM's command line, server/, weights/."""
