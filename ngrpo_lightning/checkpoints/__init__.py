"""Checkpoints of a run: writing, resuming, the trained policy out of one, export to Hugging Face."""
