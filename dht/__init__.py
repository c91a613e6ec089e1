"""atoll.dht."""
