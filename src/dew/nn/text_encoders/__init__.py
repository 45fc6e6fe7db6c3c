"""Frozen text encoders for conditioning diffusion models: CLIP's text tower and T5's encoder."""
