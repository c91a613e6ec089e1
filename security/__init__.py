"""atoll.security."""
