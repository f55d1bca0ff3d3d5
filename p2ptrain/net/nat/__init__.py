"""p2ptrain.net.nat: Reaching peers behind NAT: circuit relays and forwarding through a public peer."""
