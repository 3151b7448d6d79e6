"""The trainer alone: packing, SFT, the full vocabulary's memory, the machine's limits and the MFU against them."""
