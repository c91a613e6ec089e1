"""atoll.security: identities, membership, record validation, contribution checks and
robust aggregation (built with the swarm and the trust work).

It imports only :mod:`atoll.protocol`. Empty until then: nothing here is called yet.
"""
