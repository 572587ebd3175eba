"""Gated delta rule op (GDN)."""
