"""p2ptrain.net.transport.endpoint: Tensor transport over libp2p: messages and frames, the rpc endpoints, mailboxes, emulation, probes."""
