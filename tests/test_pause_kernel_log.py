"""Kernel-log GPU findings logged while the GPUs are paused (`gpuwarden pause`): a GPU reset or a
MIG change logs the very lines that mean a broken GPU, and they must neither drain the node nor
page anyone, nor be lost.

The class: every GPU finding the kernel-log matchers make (every Xid and SXid of the catalog,
a GPU fallen off the bus) whose record was logged within a pause is stored and sent, marked
`during_pause`, at severity info with repair action none; it opens no repair in the ledger,
runs no hook, counts in no Xid/SXid counter nor as a critical event. Judged by when the record
was logged: read after the resume, or by an agent restarted after it, it is still the pause's;
logged before the pause or after the resume, it acts as usual, and so does every host finding
(disks, file systems, crashes) during the pause.

The agent is the real runtime with the real kernel_log collector reading a /dev/kmsg stand-in
(tests/support/kmsg.py) whose records carry the kernel's own stamp (microseconds of the
monotonic clock), the gpu collector on the fake NVML, and the real [actions.exec] hook program.
The alert rules are run by promtool on the series that agent gives before, during and after
the pause.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.contracts.collector import SharedServices
from agent.contracts.model import Event, RepairAction, Severity
from agent.contracts.pause import DURING_PAUSE, PauseHistory, PauseWindow
from agent.program import config_file as config
from agent.program import registry
from agent.program.diagnose.check import CheckOptions, run_check
from agent.program.diagnose.findings import Status
from agent.program.diagnose.kernel_findings import classify_kernel_log, scan_kernel_log
from agent.runtime.core import Runtime
from agent.runtime.state import StateStore
from collectors._nvml import NvmlBackend
from collectors._repair import repair_for
from collectors._xid import XidCorrelator, XidObservation
from collectors._xid_catalog import known_codes, known_sxid_codes, lookup_event, lookup_sxid
from collectors.gpu.collector import GpuSettings
from collectors.kernel_log.collector import KernelLogSettings
from collectors.kernel_log.matchers import PAUSABLE_KINDS
from exporters.heartbeat import heartbeat_payload
from tests.support.diag import load, make_proc_tree, write_config
from tests.support.kmsg import FakeKmsg, capture_records, kernel_log_spec, write_boot_id
from tests.support.nvml import fake_gpus
from tests.support.nvml_fake import FakeNvml
from tests.support.rules import METRIC, RULES, promtool
from tests.support.waiting import until
from tests.test_kernel_log_records import HOST_FAULTS
from tests.test_kmsg_collector import PCI, Harness, value

GPU = GpuSettings(interval=0.2, event_thread=True, event_wait_ms=50, sysfs_root="/nonexistent")
XID_GPU = "0000:3b:00"
BUS_GPU = "0000:86:00.0"
SWITCH = "0000:c6:00.0"
XID79 = f"NVRM: Xid (PCI:{XID_GPU}): 79, pid=2314, name=python3, GPU has fallen off the bus."
XID48 = f"NVRM: Xid (PCI:{XID_GPU}): 48, pid=1, name=x, An uncorrectable double bit error"
XID154_NONE = (
    f"NVRM: Xid (PCI:{XID_GPU}): 154, GPU recovery action changed from 0x1 (GPU Reset Required) "
    "to 0x0 (None)"
)
HELD = {a for a in RepairAction if a not in (RepairAction.NONE, RepairAction.RESTART_APPLICATION)}


def xid_lines() -> list[str]:
    """One line per Xid of the catalog, and the per-line readings of the two that have them
    (NVLink5 fatal, Xid 154 to a reboot)."""
    lines = [
        f"NVRM: Xid (PCI:{XID_GPU}): {code}, pid=4242, name=python3, test fault"
        for code in known_codes()
    ]
    lines.append(f"NVRM: Xid (PCI:{XID_GPU}): 149, NETIR_LINK_EVT  Fatal   XC0 i0 Link 01")
    lines.append(
        f"NVRM: Xid (PCI:{XID_GPU}): 154, GPU recovery action changed from 0x0 (None) to 0x2 "
        "(Node Reboot Required)"
    )
    return lines


def sxid_lines() -> list[str]:
    """One line per SXid of the catalog, fatal and non-fatal in turn."""
    return [
        f"nvidia-nvswitch3: SXid (PCI:{SWITCH}): {code}, "
        f"{'Fatal' if i % 2 else 'Non-fatal'}, test fault"
        for i, code in enumerate(known_sxid_codes())
    ]


BUS_LINE = f"NVRM: GPU {BUS_GPU}: GPU has fallen off the bus."
INIT_LINE = f"NVRM: GPU {BUS_GPU}: RmInitAdapter failed! (0x62:0xffff:1785)"
GPU_AER_LINE = (
    f"nvidia {BUS_GPU}: AER: PCIe Bus Error: severity=Uncorrected (Fatal), type=Transaction "
    "Layer, (Receiver ID)"
)


def expected_outside_a_pause(event: Event) -> tuple[str, str]:
    """(severity, repair action) the catalog gives the event's line outside a pause."""
    code = event.attributes.get("xid")
    text = str(event.attributes.get("text", ""))
    if event.kind == "xid":
        assert isinstance(code, int)
        info = lookup_event(code, text)
    elif event.kind == "sxid":
        assert isinstance(code, int)
        info = lookup_sxid(code, text)
    else:
        return Severity.CRITICAL.label, RepairAction.REBOOT_NODE.value
    return info.severity.label, repair_for(info).value


class Agent:
    """The runtime as `gpuwarden run` builds it, on a kmsg stand-in and the fake NVML, with an
    exec hook that appends each event it is run for to a file."""

    def __init__(self, tmp_path: Path, kmsg: FakeKmsg) -> None:
        self.tmp_path = tmp_path
        self.kmsg = kmsg
        self.hooked = tmp_path / "hook.jsonl"
        self.seen: list[Event] = []
        self.runtime = self._build()

    def _build(self) -> Runtime:
        hook = ["/bin/sh", "-c", f"cat >> {self.hooked}; echo >> {self.hooked}"]
        cfg = config.parse(
            {
                "prometheus": {"enabled": False},
                "state_dir": str(self.tmp_path / "state"),
                "actions": {"exec": {"command": hook, "min_severity": "info", "max_concurrent": 1}},
            }
        )
        kernel = KernelLogSettings(
            interval=0.1,
            path=Path("/dev/kmsg"),
            boot_id_path=write_boot_id(self.tmp_path / "boot_id", "boot-a"),
            repeat_holdoff=0.0,
        )
        cfg = dataclasses.replace(cfg, collectors={"gpu": GPU, "kernel_log": kernel})
        kmsg = self.kmsg
        spec = kernel_log_spec(kmsg)
        runtime = Runtime(
            cfg,
            StateStore.open(self.tmp_path / "state"),
            collectors={**registry.COLLECTORS, "kernel_log": spec},
            sinks=registry.SINKS,
            boot_id="boot-a",
        )
        runtime.shared.put(NvmlBackend, NvmlBackend(FakeNvml(fake_gpus(2))))
        runtime.enable_outbox()  # what the MQTT sink sends: every stored event is queued
        runtime.subscribe(self.seen.append)
        return runtime

    async def start(self) -> None:
        await self.runtime.start()
        await until(lambda: self.runtime.collectors["kernel_log"].rounds_done > 0, what="a read")

    async def stop(self) -> None:
        await self.runtime.stop()
        self.runtime.store.close()

    async def restart(self) -> None:
        await self.stop()
        self.seen = []
        self.runtime = self._build()
        await self.start()

    def log(self, *lines: str, at: float | None = None) -> None:
        """Records the kernel logs now, or stamped `at` (a time.monotonic() reading)."""
        usec = int((time.monotonic() if at is None else at) * 1e6)
        for line in lines:
            self.kmsg.write(line, level=3, usec=usec)

    async def findings(self, count: int, first: int | None = None) -> list[Event]:
        """Wait for `count` more kernel-log events than were told so far (or than `first`:
        after a restart, counted from 0), and return them."""
        first = len(self._kernel_events()) if first is None else first
        await until(lambda: len(self._kernel_events()) >= first + count, what=f"{count} events")
        return self._kernel_events()[first:]

    def _kernel_events(self) -> list[Event]:
        return [e for e in self.seen if e.source == "kernel_log" or e.kind == "xid"]

    def hooked_events(self) -> list[dict[str, Any]]:
        if not self.hooked.exists():
            return []
        return [json.loads(line) for line in self.hooked.read_text().splitlines() if line]

    async def hook_ran_for(self, event: Event) -> None:
        """The hook has been run for `event` (and so for every event before it: one at a
        time, in order)."""
        await until(
            lambda: any(e["id"] == event.id for e in self.hooked_events()),
            what=f"the hook run for {event.kind}",
        )

    def sample(self, name: str, **labels: str) -> float | None:
        for s in self.runtime.samples():
            if s.family.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
        return None

    def stored(self) -> dict[str, Event]:
        return {e.id: e for e in self.runtime.store.recent_events(limit=100_000)}

    def queued(self) -> set[str]:
        """Ids of the events waiting in the outbox for the MQTT sink."""
        ids = set()
        for entry in self.runtime.store.outbox_peek(limit=100_000):
            if entry.kind == "event":
                ids.add(json.loads(entry.payload)["id"])
        return ids


@pytest.fixture
async def agent(tmp_path: Path) -> AsyncIterator[Agent]:
    running = Agent(tmp_path, FakeKmsg.with_records(capture_records()))
    await running.start()
    yield running
    await running.stop()


def active_repairs(agent: Agent) -> set[tuple[str, str]]:
    return {(r.kind, r.action.value) for r in agent.runtime.repairs()}


def assert_marked(events: list[Event]) -> None:
    for event in events:
        assert event.attributes[DURING_PAUSE] is True, event
        assert event.severity is Severity.INFO and event.repair_action is RepairAction.NONE
        assert "paused" in event.message
        severity, repair = expected_outside_a_pause(event)
        assert event.attributes["severity_if_not_paused"] == severity, event
        assert event.attributes["repair_action_if_not_paused"] == repair, event


def assert_acts(event: Event, severity: str, repair: str) -> None:
    assert DURING_PAUSE not in event.attributes, event
    assert event.severity.label == severity and event.repair_action.value == repair, event


class TestDuringAPause:
    async def test_every_gpu_finding_is_sent_marked_and_acts_on_nothing(self, agent: Agent) -> None:
        await agent.runtime.pause.pause(600.0, "reset GPU 0", "alice")
        lines = [*xid_lines(), *sxid_lines(), BUS_LINE, INIT_LINE, GPU_AER_LINE]
        agent.log(*lines)
        events = await agent.findings(len(lines))
        assert len(events) == len(lines)
        assert {e.kind for e in events} == PAUSABLE_KINDS
        assert_marked(events)
        # What the class is about: findings that, outside a pause, would hold a repair (a
        # drain) or page (critical).
        outside = [expected_outside_a_pause(e) for e in events]
        assert {r for _, r in outside} & {a.value for a in HELD} >= {"reset_gpu", "reboot_node"}
        assert {s for s, _ in outside} >= {"critical", "warning"}
        assert all(e.attributes["pause_reason"] == "reset GPU 0" for e in events)

        # A host finding after them: acts as usual, and is the hook's marker (one at a time).
        agent.log(HOST_FAULTS[0][0])
        (host,) = await agent.findings(1)
        await agent.hook_ran_for(host)

        assert active_repairs(agent) == {("raid_member_failed", "check_storage")}
        assert not [e for e in agent.hooked_events() if e["attributes"].get(DURING_PAUSE)]
        stored, queued = agent.stored(), agent.queued()
        for event in events:  # nothing lost: stored, and on its way out over MQTT
            assert stored[event.id].attributes[DURING_PAUSE] is True
            assert event.id in queued
        # No series a rule pages on counts them; their own counter does.
        assert agent.sample("gpuwarden_xid_errors_total") is None
        assert agent.sample("gpuwarden_sxid_errors_total") is None
        for kind in PAUSABLE_KINDS:
            assert agent.sample("gpuwarden_kernel_log_findings_total", kind=kind) == 0
            counted = agent.sample("gpuwarden_kernel_log_paused_findings_total", kind=kind)
            assert counted == sum(1 for e in events if e.kind == kind)
        critical = [
            key
            for key, n in agent.runtime.events_by_key.items()
            if key[1] in (*PAUSABLE_KINDS, "xid_confirmed", "xid_escalated")
            and key[2] != "info"
            and n
        ]
        assert critical == []
        # Nothing for the watcher either: the node is healthy, its heartbeat names no problem.
        assert agent.runtime.health().ok
        beat = json.loads(
            heartbeat_payload(
                agent.runtime, seq=1, bdseq=1, now=time.time(), outbox_depth={}, outbox_dropped={}
            )
        )
        assert beat["health"] == "ok"  # node_unhealthy comes from its problems alone

    @pytest.mark.parametrize(("line", "kind", "subject", "severity"), HOST_FAULTS)
    async def test_host_findings_act_as_usual(  # a PCIe error of a device not a GPU too
        self, agent: Agent, line: str, kind: str, subject: str, severity: Severity
    ) -> None:
        await agent.runtime.pause.pause(600.0, "reset GPU 0")
        agent.log(line)
        (event,) = await agent.findings(1)
        assert event.kind == kind and DURING_PAUSE not in event.attributes
        assert event.severity is severity
        await agent.hook_ran_for(event)
        if event.repair_action in HELD:
            assert (kind, event.repair_action.value) in active_repairs(agent)
        assert agent.sample("gpuwarden_kernel_log_findings_total", kind=kind) == 1


class TestWhatTheResetIsFor:
    async def test_the_drivers_all_clear_during_the_pause_still_clears(self, agent: Agent) -> None:
        """An Xid 48 held reset_gpu; the operator pauses and resets the GPU, and the driver
        says the GPU needs no recovery any more: that clears the repair (a Slurm drain with
        resume = "when_cleared" ends), though the line itself is marked and asks nothing."""
        agent.log(XID48)
        (held,) = await agent.findings(1)
        assert held.repair_action is RepairAction.RESET_GPU
        assert ("xid", "reset_gpu") in active_repairs(agent)
        await agent.runtime.pause.pause(600.0, "reset GPU 0")
        agent.log(XID154_NONE)
        (clear,) = await agent.findings(1)
        assert clear.attributes[DURING_PAUSE] is True and clear.clears == ("*",)
        assert active_repairs(agent) == set()


class TestTheBoundary:
    async def test_logged_before_the_pause_and_read_in_it_acts_as_usual(self, agent: Agent) -> None:
        before = time.monotonic() - 5.0  # logged 5 s ago, read now
        await agent.runtime.pause.pause(600.0)
        agent.log(XID79, at=before)
        (event,) = await agent.findings(1)
        assert_acts(event, "critical", "reboot_node")
        assert ("xid", "reboot_node") in active_repairs(agent)
        await agent.hook_ran_for(event)
        assert agent.sample("gpuwarden_xid_errors_total", xid="79") == 1

    async def test_logged_after_the_resume_acts_as_usual(self, agent: Agent) -> None:
        await agent.runtime.pause.pause(600.0)
        agent.log(XID79)
        assert_marked(await agent.findings(1))
        await agent.runtime.pause.resume()
        agent.log(XID79)  # the GPU came back broken
        (event,) = await agent.findings(1)
        assert_acts(event, "critical", "reboot_node")
        assert ("xid", "reboot_node") in active_repairs(agent)
        await agent.hook_ran_for(event)
        assert agent.sample("gpuwarden_xid_errors_total", xid="79") == 1

    async def test_logged_in_the_pause_and_read_after_the_resume_is_still_marked(
        self, agent: Agent
    ) -> None:
        await agent.runtime.pause.pause(600.0)
        during = time.monotonic()
        await agent.runtime.pause.resume()
        agent.log(XID79, BUS_LINE, at=during)  # read late: the reader caught up after it
        assert_marked(await agent.findings(2))
        assert active_repairs(agent) == set()

    async def test_read_by_an_agent_restarted_after_the_resume_is_still_marked(
        self, agent: Agent
    ) -> None:
        await agent.runtime.pause.pause(600.0)
        during = time.monotonic()
        await agent.runtime.pause.resume()
        await agent.stop()
        agent.log(XID79, at=during)  # logged while paused, read by the next run of the agent
        await agent.restart()
        assert_marked(await agent.findings(1, first=0))
        assert active_repairs(agent) == set()

    async def test_an_agent_restarted_while_paused_judges_its_backlog_by_the_pause(
        self, agent: Agent
    ) -> None:
        await agent.runtime.pause.pause(600.0)
        await agent.stop()
        agent.log(XID79)
        await agent.restart()
        assert_marked(await agent.findings(1, first=0))
        assert active_repairs(agent) == set()


class TestHoldoff:
    """A storm in the pause raises one event per repeat_holdoff, every line counted; and it
    holds back nothing logged after the resume (the GPU came back broken)."""

    async def test_a_storm_in_the_pause_holds_back_nothing_after_it(self, tmp_path: Path) -> None:
        kmsg = FakeKmsg.with_records(capture_records())
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            harness = Harness(tmp_path, kmsg, pool)  # repeat_holdoff 300 s
            await harness.collect()
            now, mono = time.time(), time.monotonic()
            harness.shared.get(PauseHistory, PauseHistory).replace(
                [PauseWindow(now - 100, now - 50, "reset")]
            )
            for i in range(5):
                for line in (XID79, BUS_LINE):
                    kmsg.write(line, level=3, usec=int((mono - 90 + i) * 1e6))
            during, samples = await harness.collect()
            for line in (XID79, BUS_LINE):  # 40 s after the storm, after the resume
                kmsg.write(line, level=3, usec=int((mono - 10) * 1e6))
            after, _ = await harness.collect()
            harness.store.close()
        assert sorted(e.kind for e in during) == ["gpu_fallen_off_bus", "xid"]
        assert all(e.attributes[DURING_PAUSE] is True for e in during)
        for kind in ("xid", "gpu_fallen_off_bus"):
            counted = value(samples, "gpuwarden_kernel_log_paused_findings_total", kind=kind)
            assert counted == 5
        assert sorted(e.kind for e in after) == ["gpu_fallen_off_bus", "xid"]
        for event in after:
            assert_acts(event, "critical", "reboot_node")


class TestCorrelation:
    """The NVML event thread is stopped while paused (tests/test_pause.py), so only the kernel
    log reports an Xid of the reset. After the resume NVML reports new Xids only: one right
    after the resume must raise its own event, not pass for the twin of the paused one."""

    async def test_an_nvml_xid_right_after_a_paused_one_is_its_own_alert(
        self, tmp_path: Path
    ) -> None:
        kmsg = FakeKmsg.with_records(capture_records())
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            harness = Harness(tmp_path, kmsg, pool)
            await harness.collect()  # the backlog
            now = time.time()
            harness.shared.get(PauseHistory, PauseHistory).replace([PauseWindow(now - 10, now)])
            kmsg.write(XID79, level=3, usec=int((time.monotonic() - 1.0) * 1e6))
            events, _ = await harness.collect()
            harness.store.close()
        (paused,) = events
        assert paused.attributes[DURING_PAUSE] is True
        # The GPU came back broken: NVML reports an Xid 79 within the correlation window.
        correlator = harness.shared.get(XidCorrelator, XidCorrelator)
        nvml = XidObservation("nvml", PCI, 79, time.time(), text="GPU has fallen off the bus")
        after = correlator.observe(nvml)
        assert after is not None and after.kind == "xid", after
        assert after.severity is Severity.CRITICAL
        assert after.repair_action is RepairAction.REBOOT_NODE
        assert correlator.counts == {(PCI, 79): 1}


# -- the alert rules, on the agent's own series ----------------------------------------------

KERNEL_SERIES = (
    "gpuwarden_xid_errors_total",
    "gpuwarden_xid_confirmed_total",
    "gpuwarden_sxid_errors_total",
    "gpuwarden_kernel_log_findings_total",
    "gpuwarden_events_total",
    "gpuwarden_repair_required",
)
"""Every series a kernel-log finding can move (its counters, the event counter, the ledger)."""
TARGET = {"job": "gpuwarden", "instance": "gpu-node-1:9400"}
MINUTES = {"before": 15, "findings": 5, "after": 20}
"""Minutes of each stage of the promtool timeline: long enough before for `offset 10m` to
see the target up, and after for every `increase(...[10m])` to have seen the findings."""


def series(name: str, labels: dict[str, str]) -> str:
    """A series in promtool's notation, with the target's labels."""
    text = ",".join(f"{k}={json.dumps(v)}" for k, v in sorted({**labels, **TARGET}.items()))
    return f"{name}{{{text}}}"


def snapshot(agent: Agent) -> dict[str, float]:
    """Every series of the agent now."""
    return {series(s.family.name, s.labels): s.value for s in agent.runtime.samples()}


def rule_suite(stages: list[dict[str, float]], alerts: list[str]) -> dict[str, Any]:
    """A promtool test: the stages' series one minute apart (absent where a stage lacks one),
    `up` throughout, and no alert of `alerts` at any minute from the findings on."""
    names = sorted({name for stage in stages for name in stage})
    counts = list(MINUTES.values())
    values = {
        name: " ".join(
            " ".join([_value(stage.get(name))] * n) for stage, n in zip(stages, counts, strict=True)
        )
        for name in names
    }
    inputs = [{"series": series("up", {}), "values": f"1x{sum(counts)}"}]
    inputs += [{"series": name, "values": text} for name, text in values.items()]
    first = MINUTES["before"]
    checks = [
        {"eval_time": f"{minute}m", "alertname": alert, "exp_alerts": []}
        for minute in range(first, sum(counts))
        for alert in alerts
    ]
    return {
        "rule_files": [str(RULES)],
        "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": inputs, "alert_rule_test": checks}],
    }


def _value(value: float | None) -> str:
    return "_" if value is None else repr(value)


def kernel_alerts() -> list[str]:
    """The alerts whose expression reads a series a kernel-log finding moves."""
    out = []
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            if "alert" in rule and set(METRIC.findall(str(rule["expr"]))) & set(KERNEL_SERIES):
                out.append(str(rule["alert"]))
    return out


RESET_LINES = [*xid_lines(), *sxid_lines(), BUS_LINE]


class TestTheRules:
    """promtool on the series the agent itself gives before, during and after a pause in which
    the reset logged every GPU finding: no alert that reads a kernel-log series fires, not
    while paused and not in the 20 minutes after the resume (the Xid rule's `increase` over 10
    minutes would still see a count that rose in the pause)."""

    async def test_no_alert_during_or_after_a_paused_reset(
        self, agent: Agent, tmp_path: Path
    ) -> None:
        alerts = kernel_alerts()
        assert {"GpuwardenCriticalXid", "GpuwardenFatalSxid", "GpuwardenRepairRequired"} <= set(
            alerts
        )
        before = snapshot(agent)
        await agent.runtime.pause.pause(600.0, "nvidia-smi -r")
        agent.log(*RESET_LINES)
        await agent.findings(len(RESET_LINES))
        during = snapshot(agent)
        await agent.runtime.pause.resume()
        after = snapshot(agent)
        assert during[series("gpuwarden_gpu_paused", {})] == 1
        assert after[series("gpuwarden_gpu_paused", {})] == 0
        path = tmp_path / "reset.test.yml"
        path.write_text(yaml.safe_dump(rule_suite([before, during, after], alerts)))
        done = promtool("test", "rules", path)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]

    @pytest.mark.parametrize(
        "alert", ["GpuwardenCriticalXid", "GpuwardenFatalSxid", "GpuwardenRepairRequired"]
    )
    async def test_the_same_findings_unpaused_fire(
        self, agent: Agent, tmp_path: Path, alert: str
    ) -> None:
        """The check can fail: logged without a pause, the same lines page."""
        before = snapshot(agent)
        agent.log(*RESET_LINES)
        await agent.findings(1)
        await until(
            lambda: (
                agent.sample("gpuwarden_kernel_log_findings_total", kind="gpu_fallen_off_bus") == 1
            ),
            what="the last finding counted",
        )
        found = snapshot(agent)
        path = tmp_path / "unpaused.test.yml"
        path.write_text(yaml.safe_dump(rule_suite([before, found, found], [alert])))
        done = promtool("test", "rules", path)
        assert done.returncode != 0 and alert in done.stdout + done.stderr


# -- gpuwarden check, Slurm's health check ---------------------------------------------------


class TestCheck:
    """`gpuwarden check` reads this boot's whole kernel log: a Slurm HealthCheckProgram run
    after a planned reset would fail on the reset's Xids, and Slurm drain the node, for the
    rest of the boot. It lists the GPU findings logged in the running agent's pauses, not
    judged (SKIP), and judges everything else as usual."""

    @staticmethod
    def kmsg_with(*records: tuple[str, float]) -> FakeKmsg:
        kmsg = FakeKmsg.with_records(capture_records())
        for line, at in records:
            kmsg.write(line, level=3, usec=int(at * 1e6))
        return kmsg

    def test_gpu_findings_of_a_pause_are_listed_not_judged(self, tmp_path: Path) -> None:
        now = time.monotonic()
        kmsg = self.kmsg_with(
            (XID79, now), (BUS_LINE, now), (sxid_lines()[0], now), (HOST_FAULTS[0][0], now)
        )
        kmsg.write(XID79.replace("): 79,", "): 48,"), level=3, usec=int((now - 60) * 1e6))
        pauses = PauseHistory([PauseWindow(time.time() - 10, None, "nvidia-smi -r")])
        settings = KernelLogSettings(boot_id_path=write_boot_id(tmp_path / "boot_id", "b"))
        scan = scan_kernel_log(settings, io=kmsg, pauses=pauses)
        lines = {f.name: f for f in classify_kernel_log(scan)}
        skipped = {n for n, f in lines.items() if f.status is Status.SKIP}
        assert skipped == {
            "Xid 79 0000:3b:00.0",
            f"gpu fallen off bus {BUS_GPU}",
            f"SXid {known_sxid_codes()[0]} {SWITCH}",
        }
        assert all("nvidia-smi -r" in lines[n].detail for n in skipped)
        assert lines["Xid 48 0000:3b:00.0"].status is Status.FAIL  # logged before the pause
        assert lines["raid member failed sdb1"].status is Status.FAIL  # a host finding
        assert len(scan.to_dict()["findings_during_pause"]) == 3

    def test_without_a_pause_the_same_lines_fail(self, tmp_path: Path) -> None:
        kmsg = self.kmsg_with((XID79, time.monotonic()))
        settings = KernelLogSettings(boot_id_path=write_boot_id(tmp_path / "boot_id", "b"))
        (line,) = classify_kernel_log(scan_kernel_log(settings, io=kmsg, pauses=PauseHistory()))
        assert line.status is Status.FAIL

    async def test_check_reads_the_agents_pauses_from_its_store(self, tmp_path: Path) -> None:
        cfg = load(write_config(tmp_path, proc_root=make_proc_tree(tmp_path / "proc")))
        store = StateStore.open(cfg.state_dir)
        ended = time.time() - 5  # paused, reset, resumed: check runs after it
        store.put(
            "runtime",
            "gpu_pause_history",
            [{"since": ended - 60, "ended": ended, "reason": "reset GPU 0", "by": "root"}],
        )
        store.close()
        kmsg = self.kmsg_with((XID79, time.monotonic() - 30), (XID79, time.monotonic()))
        shared = SharedServices()
        shared.put(NvmlBackend, NvmlBackend(FakeNvml(fake_gpus(2))))
        options = CheckOptions(kmsg_io=kmsg, process_gap=0.05)
        report = await run_check(cfg, options, shared=shared)
        kernel = [f for f in report.findings if f.area == "kernel"]
        by_status = {f.status: f for f in kernel}
        assert set(by_status) == {Status.SKIP, Status.FAIL}  # the reset's, and the one after
        assert "reset GPU 0" in by_status[Status.SKIP].detail
        assert by_status[Status.FAIL].data["count"] == 1
