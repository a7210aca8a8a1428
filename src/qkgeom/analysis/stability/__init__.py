"""Stability: attention-entropy collapse, its remedies, and the alerts (docs/stability.md)."""
