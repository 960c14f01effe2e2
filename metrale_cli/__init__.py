"""metrale: forward, decode and verify passes on Hugging Face checkpoints, behind one logits interface."""

__version__ = "0.1.0"
