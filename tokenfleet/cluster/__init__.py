"""The fleet on Ray: engine replicas as Ray actors, and the gateway's client for all of them.

    replica.py    a Ray actor: an engine (engine/process.py's loop, in a thread) behind a
                  bridge that serves any number of gateways over tcp:// and beats on its own
    wire.py       what gateways and replicas send each other
    placement.py  Ray itself: a local instance or an operator's cluster, the replica
                  actors, and finding them by name
    links.py      the gateway's connection to one replica: its socket, beats and state
    client.py     FleetClient, the gateway's ReplicaClient for the whole fleet: routing,
                  and moving a dead replica's requests to another
    scaling.py    scaling by hand: replicas added, and drained before they stop
    health.py     slow replicas (no new work) and silent ones (moved, then fenced)

Ray owns placement, restarts and node membership; tokens flow by the engine's own
one-message-per-step protocol over ZMQ, never as a Ray call per token.
"""
