"""Transports: one class per module, all implementing ``base.Transport``."""
