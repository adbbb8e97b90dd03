"""The client: distributed models whose transformer blocks run in a swarm of servers."""
