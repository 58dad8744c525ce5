"""``llmgw doctor``: can this node run anything, and if not, why not.

A node that registers fine and then never starts a replica is the most
confusing failure a fleet has: the control plane sees a healthy node, the
operator sees nothing happening. Doctor asks every question whose "no" means
that nothing can run -- MIG enabled with nothing carved, every GPU unhealthy,
no engine installed, a data dir that cannot be written, a control plane that
does not answer or has no leader -- and exits 1 when one of them is "no".
Given several control-plane instances, it shows each one's role.

It probes NVML and nvidia-smi separately (not just the first that answers),
because "NVML fails but nvidia-smi works" is itself worth knowing: it is what
a driver upgrade without a reboot looks like.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import tempfile
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from llmgw.agent.discovery import LastSeen, NvmlApi, cpu_devices, inventory_from
from llmgw.agent.discovery.base import CardFacts, Source, SourceReading, SourceUnavailable
from llmgw.agent.discovery.nvidia_smi import NvidiaSmiSource
from llmgw.agent.discovery.nvml import NvmlSource
from llmgw.cli.doctor_control_plane import agent_ca, judge_leadership, probe_control_plane
from llmgw.config import default_data_dir
from llmgw.errors import DiscoveryError, LlmgwError
from llmgw.wire import CPU_CLASS, Device, NodeInventory

# Engine -> how it is found. vLLM and SGLang need a GPU; llama.cpp runs anywhere.
ENGINE_PROBES: dict[str, tuple[str, str]] = {
    "vllm": ("vllm", "vllm"),
    "sglang": ("sglang", "sglang"),
    "llamacpp": ("llama-server", "llama_cpp"),
}
CPU_ENGINES = frozenset({"llamacpp"})

EngineFinder = Callable[[], dict[str, str | None]]


def find_engines() -> dict[str, str | None]:
    """Where each engine was found (a path or a module), or None."""
    found: dict[str, str | None] = {}
    for engine, (command, module) in ENGINE_PROBES.items():
        path = shutil.which(command)
        if path is None and importlib.util.find_spec(module) is not None:
            path = f"python module {module}"
        found[engine] = path
    return found


@dataclass
class SourceCheck:
    answered: bool
    detail: str


@dataclass
class CardView:
    index: int
    uuid: str
    name: str
    mode: str
    instances: list[str]
    healthy: bool
    reasons: list[str]


@dataclass
class DoctorReport:
    hostname: str
    driver_version: str | None
    cuda_version: str | None
    nvml: SourceCheck
    nvidia_smi: SourceCheck
    cards: list[CardView]
    devices: list[dict[str, Any]]
    foreign_processes: list[dict[str, Any]]
    foreign_memory_mib: int
    engines: dict[str, str | None]
    data_dir: dict[str, Any]
    control_plane: dict[str, Any] | None
    warnings: list[str] = field(default_factory=list)
    can_run: bool = False


def _probe(source: Source) -> tuple[SourceCheck, SourceReading | None]:
    try:
        snapshot = source.read()
    except SourceUnavailable as absent:
        return SourceCheck(False, absent.message), None
    except DiscoveryError as exc:
        return SourceCheck(False, f"answered, but unreadably: {exc}"), None
    return SourceCheck(True, f"{len(snapshot.cards)} GPU(s)"), snapshot


def _mode(card: CardFacts) -> str:
    if card.mig_current is None:
        return "whole card (no MIG)"
    now = "MIG" if card.mig_current else "whole card"
    if card.mig_pending is not None and card.mig_pending != card.mig_current:
        return f"{now}; MIG {'on' if card.mig_pending else 'off'} after a GPU reset"
    return now


def _cards(snapshot: SourceReading | None, devices: list[Device]) -> list[CardView]:
    if snapshot is None:
        return []
    views = []
    for card in sorted(snapshot.cards, key=lambda c: c.index):
        mine = [d for d in devices if d.mig is not None and d.mig.parent_uuid == card.uuid]
        whole = next((d for d in devices if d.uuid == card.uuid), None)
        source = whole or (mine[0] if mine else None)
        views.append(
            CardView(
                index=card.index,
                uuid=card.uuid,
                name=card.name,
                mode=_mode(card),
                instances=[f"{d.label} {d.gpu_class}" for d in mine],
                healthy=source.healthy if source else True,
                reasons=list(source.unhealthy_reasons) if source else [],
            )
        )
    return views


def _data_dir(path: Path) -> dict[str, Any]:
    state: dict[str, Any] = {"path": str(path), "writable": False, "detail": ""}
    if path.is_dir():
        try:
            with tempfile.NamedTemporaryFile(dir=path, prefix=".doctor-"):
                pass
        except OSError as exc:
            state["detail"] = f"cannot write there: {exc.strerror or exc}"
            return state
        state.update(writable=True, detail="writable")
        return state
    if path.exists():
        state["detail"] = "exists but is not a directory"
        return state
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if parent.is_dir() and os.access(parent, os.W_OK | os.X_OK):
        state.update(writable=True, detail=f"will be created (in {parent})")
    else:
        state["detail"] = f"cannot be created: {parent} is not a writable directory"
    return state


def check(
    *,
    data_dir: Path,
    control_plane: str | None = None,
    started_pids: Collection[int] = (),
    nvml: NvmlApi | None = None,
    nvidia_smi: str | None = None,
    engines: EngineFinder = find_engines,
    cpu_slots: int = 1,
) -> DoctorReport:
    """Everything doctor shows, as data (``--json`` prints exactly this)."""
    host = socket.gethostname()
    nvml_check, nvml_snap = _probe(NvmlSource(nvml))
    smi_check, smi_snap = _probe(NvidiaSmiSource(nvidia_smi))
    snapshot = nvml_snap or smi_snap
    warnings: list[str] = []
    if snapshot is not None:
        try:
            inventory = inventory_from(
                snapshot, hostname=host, cpu_slots=cpu_slots, cache=LastSeen()
            )
        except DiscoveryError as exc:
            warnings.append(f"discovery failed: {exc}")
            inventory = NodeInventory(hostname=host, source=snapshot.source)
    else:
        inventory = NodeInventory(hostname=host, devices=cpu_devices(cpu_slots, host))
        for name, probe in (("nvml", nvml_check), ("nvidia-smi", smi_check)):
            if probe.detail.startswith("answered"):
                warnings.append(f"{name} {probe.detail}")
    warnings.extend(inventory.warnings)

    found = engines()
    report = DoctorReport(
        hostname=host,
        driver_version=inventory.driver_version,
        cuda_version=inventory.cuda_version,
        nvml=nvml_check,
        nvidia_smi=smi_check,
        cards=_cards(snapshot, inventory.devices),
        devices=[d.model_dump(mode="json") for d in inventory.devices],
        foreign_processes=[
            {"device": d.label, "pid": p.pid, "name": p.name, "used_memory_mib": p.used_memory_mib}
            for d in inventory.devices
            for p in d.processes
            if p.pid not in started_pids
        ],
        foreign_memory_mib=0,
        engines=found,
        data_dir=_data_dir(data_dir),
        control_plane=(probe_control_plane(control_plane, agent_ca(data_dir))
                       if control_plane else None),
        warnings=warnings,
    )
    report.foreign_memory_mib = sum(p["used_memory_mib"] for p in report.foreign_processes)
    _judge(report, inventory.devices)
    return report


def _judge(report: DoctorReport, devices: list[Device]) -> None:
    """Add a warning for every state in which nothing can run; set can_run."""
    warn = report.warnings.append
    gpus = [d for d in devices if d.gpu_class != CPU_CLASS]
    for device in devices:
        if not device.healthy:
            warn(f"GPU {device.label} is unhealthy: {'; '.join(device.unhealthy_reasons)}")
        elif not device.placeable:
            warn(f"GPU {device.label}: {device.unplaceable_reason}")
    if gpus and not any(d.healthy for d in gpus):
        warn("every GPU is unhealthy: nothing can run on this node")
    installed = {name for name, where in report.engines.items() if where}
    if not installed:
        warn(
            "no inference engine is installed: install vllm or sglang (GPU), or llama.cpp "
            "(llama-server, or pip install 'llmgw[llamacpp]')"
        )
    elif not gpus and not installed & CPU_ENGINES:
        warn("this node has no GPU and only GPU engines are installed: install llama.cpp")

    def servable(device: Device) -> bool:
        wanted = installed & CPU_ENGINES if device.gpu_class == CPU_CLASS else installed
        return device.healthy and device.placeable and bool(wanted)

    runnable = [d for d in devices if servable(d)]
    if gpus and any(d.healthy for d in gpus) and not any(d.placeable for d in gpus):
        warn("no GPU can take work: carve MIG instances or finish the pending mode change")
    if not report.data_dir["writable"]:
        warn(f"data dir {report.data_dir['path']} {report.data_dir['detail']}")
    cp = report.control_plane
    leaderless = False
    if cp is not None:
        for instance in cp["instances"]:
            if not instance["reachable"]:
                warn(f"control plane {instance['url']} is unreachable: {instance['detail']}")
        leaderless = judge_leadership(cp["instances"], warn)
    if report.foreign_memory_mib:
        warn(
            f"{report.foreign_memory_mib} MiB of GPU memory is held by "
            f"{len(report.foreign_processes)} process(es) llmgw did not start"
        )
    report.can_run = (
        bool(runnable)
        and report.data_dir["writable"]
        and (cp is None or (bool(cp["reachable"]) and not leaderless))
    )


def _show(report: DoctorReport, console: Console) -> None:
    yes = {True: "[green]answers[/]", False: "[red]no answer[/]"}
    console.print(
        f"[bold]{report.hostname}[/]  driver {report.driver_version or '-'}"
        f"  CUDA {report.cuda_version or '-'}"
    )
    console.print(f"NVML: {yes[report.nvml.answered]} ({report.nvml.detail})")
    console.print(f"nvidia-smi: {yes[report.nvidia_smi.answered]} ({report.nvidia_smi.detail})")
    if report.cards:
        cards = Table(title="Cards")
        for column in ("GPU", "Name", "Mode", "Instances", "Health"):
            cards.add_column(column)
        for card in report.cards:
            cards.add_row(
                str(card.index),
                escape(card.name),
                card.mode,
                "\n".join(card.instances) or "-",
                "ok" if card.healthy else "[red]" + escape("; ".join(card.reasons)) + "[/]",
            )
        console.print(cards)
    devices = Table(title="Devices")
    for column in ("Device", "Class", "Memory MiB", "Health", "Placeable"):
        devices.add_column(column)
    for d in report.devices:
        memory = f"{d['memory_used_mib']}/{d['memory_total_mib']}" if d["memory_total_mib"] else "-"
        devices.add_row(
            d["label"],
            d["gpu_class"],
            memory,
            "ok" if d["healthy"] else "[red]unhealthy[/]",
            "yes" if d["placeable"] else f"[yellow]no: {escape(d['unplaceable_reason'] or '')}[/]",
        )
    console.print(devices)
    engines = ", ".join(f"{k} ({v})" for k, v in report.engines.items() if v) or "none"
    console.print(f"Engines: {engines}")
    console.print(f"Data dir: {report.data_dir['path']} ({report.data_dir['detail']})")
    if report.control_plane:
        for instance in report.control_plane["instances"]:
            console.print(f"Control plane {instance['url']}: {escape(instance['detail'])}",
                          highlight=False)
    for line in report.warnings:
        console.print(f"[yellow]warning:[/] {escape(line)}", highlight=False)
    verdict = (
        "[green]this node can run replicas[/]"
        if report.can_run
        else ("[red]nothing can run on this node[/]")
    )
    console.print(verdict)


def run_doctor(
    json_out: bool,
    data_dir: Path,
    control_plane: str | None,
    *,
    started_pids: Collection[int] = (),
    nvml: NvmlApi | None = None,
    nvidia_smi: str | None = None,
    engines: EngineFinder = find_engines,
    console: Console | None = None,
) -> int:
    """Check the node, print the result; 0 when something can run, 1 when nothing can."""
    try:
        report = check(
            data_dir=data_dir,
            control_plane=control_plane,
            started_pids=started_pids,
            nvml=nvml,
            nvidia_smi=nvidia_smi,
            engines=engines,
        )
    except LlmgwError as exc:  # e.g. a bad setting: one line, not a traceback
        (console or Console(stderr=True)).print(f"llmgw doctor: {exc}", highlight=False)
        return 2
    out = console or Console()
    if json_out:
        # Plain text, not rich's renderer: it would wrap long strings at the width.
        out.file.write(json.dumps(asdict(report), indent=2) + "\n")
    else:
        _show(report, out)
    return 0 if report.can_run else 1


def doctor(
    json_out: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    data_dir: Annotated[
        Path | None, typer.Option("--data-dir", help="The data dir to check.")
    ] = None,
    control_plane: Annotated[
        str | None,
        typer.Option(
            "--control-plane",
            help="Control plane URL to reach; several comma-separated (leader and standbys):"
            " each one's role is shown.",
        ),
    ] = None,
) -> None:
    """Check GPUs, MIG, engines and settings; exit 1 when nothing can run."""
    code = run_doctor(json_out, data_dir or default_data_dir(), control_plane)
    raise typer.Exit(code)


app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
app.command()(doctor)
