"""API-server side of the plugin: pod watch (handshake, pool state), acks, node publication."""
