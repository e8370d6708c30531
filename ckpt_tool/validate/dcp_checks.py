"""Shallow checks of a torch DCP checkpoint (placeholder replaced below)."""
