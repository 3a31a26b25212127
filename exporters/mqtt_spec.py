"""The [mqtt] sink as the registry sees it: its settings and a factory that imports the sink
(exporters/mqtt.py) only when [mqtt] is enabled.

[mqtt] is off in the embedded defaults, and the sink with its client libraries (aiomqtt, paho
with the urllib, http and email modules it imports, tenacity) holds about 2.7 MB for the
daemon's whole life once imported (traced; docs/MEASUREMENTS.md, "What the daemon loads"): a
daemon that never publishes never loads them. Enabled at start or by a reload, the first factory call imports them.
"""

from __future__ import annotations

from agent.contracts.sink import Sink, SinkContext, SinkSpec
from exporters.mqtt_settings import MqttSettings


def create(settings: MqttSettings, runtime: SinkContext) -> Sink:
    from exporters.mqtt import MqttSink  # noqa: PLC0415 - only for an enabled sink: see above

    return MqttSink(settings, runtime)


SPEC = SinkSpec(
    name="mqtt",
    description="MQTT push: status with birth and Will, heartbeat, events, metric snapshots",
    settings_type=MqttSettings,
    factory=create,
)
