"""The fast wing (placeholder, filled in below)."""
