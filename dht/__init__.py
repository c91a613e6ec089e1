"""atoll.dht: peer discovery over the libp2p Kademlia DHT (built with the swarm).

It will hold the key schema, typed expiring records and group declarations, and import
only :mod:`atoll.protocol`. Empty until then: nothing here is called yet.
"""
