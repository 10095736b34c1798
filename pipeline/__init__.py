"""AMP validation pipeline: freeze an FP32 reference, trial autocast, decide with evidence."""

__version__ = "0.1.0"
