"""p2ptrain.net.dht.node: The run's DHT: keys, versioned signed records, validators, admission, the node and the bootstrap peer."""
