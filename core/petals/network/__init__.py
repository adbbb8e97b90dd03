"""How peers reach each other: one home for everything network.

- ``p2p``: the options of a peer's libp2p daemon (p2pd) and its lifecycle, for servers, DHT peers
  and clients alike.
- ``client``: the client's ``P2P`` + ``DHTNode`` pair on its own event-loop thread.
- ``rpc``: calls to a server's ``TransformerConnectionHandler`` RPCs (clients' requests, servers'
  pings of their neighbours).

Nothing here imports hivemind at package import time: ``petals serve --help`` stays fast.
"""
