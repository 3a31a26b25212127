"""The off-node watcher (`gpuwarden watch`): silence from a node is an alert.

- payloads: topic and payload parsing; hostile input is rejected with a reason, never raised.
- fleet: the pure, clock-injected state machine (online, stale, dead, stopped, missing) and
  the alerts it raises and clears.
- metrics: the watcher's own /metrics.
- service: the MQTT loop (aiomqtt, reconnect with backoff) that feeds the state machine.
"""
