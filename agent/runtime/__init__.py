"""The middle layer: scheduling, events, health, the state store, blocking calls, systemd.

It imports only agent.contracts; the program hands it the collectors and sinks to run."""
