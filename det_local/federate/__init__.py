"""Federation: det-local daemons on one LAN find each other and form an authenticated cluster.

- `keys`: the cluster key (`cluster.key`), join tokens, the cluster id, node ids.
- `settings`: the `federation:` section of daemon.yaml and its environment variables.
- `transport`: the peer link: handshake, MAC'd session frames (on `rpc`'s framing).
- `schema`: what each peer message may hold.
- `service`: the daemon-side service (listener, dialler, heartbeats, membership, queries).
- `discovery`: mDNS announce and browse (python-zeroconf; imported only when multicast is on).
- `client`: what the CLI uses to ask its own daemon for the cluster view.

`sched` never imports this package: `det-local daemon` hands `service.extension` to the daemon.
"""
