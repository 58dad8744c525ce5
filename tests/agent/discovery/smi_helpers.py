"""Fixture files and a stand-in nvidia-smi, shared by the discovery and doctor tests."""

from __future__ import annotations

import stat
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "nvidia-smi"

# -L companions of the real MIG XML captures (written for llmgw; see SOURCES.md).
_COMPANIONS = {
    "telegraf-a100-sxm4-80gb-mig-v12.xml": "synthetic-a100-80gb-mig-v12-L.txt",
    "netdata-a100-sxm4-40gb-mig-510-v11.xml": "synthetic-a100-40gb-mig-510-L.txt",
}


def xml_fixtures() -> list[str]:
    return sorted(p.name for p in FIXTURES.glob("*.xml"))


def xml_bytes(name: str) -> bytes:
    return (FIXTURES / name).read_bytes()


def list_text(xml_name: str) -> str:
    """The ``-L`` output that goes with an XML fixture.

    MIG captures have a companion file (the profile names and MIG UUIDs exist
    only there); for cards without MIG the ``-L`` line is derived from the XML.
    """
    companion = _COMPANIONS.get(xml_name, xml_name.removesuffix(".xml") + "-L.txt")
    if (FIXTURES / companion).exists():
        return (FIXTURES / companion).read_text()
    root = ET.fromstring(xml_bytes(xml_name))
    lines = []
    for n, gpu in enumerate(root.iterfind("gpu")):
        lines.append(
            f"GPU {n}: {(gpu.findtext('product_name') or '').strip()} "
            f"(UUID: {(gpu.findtext('uuid') or '').strip()})"
        )
    return "\n".join(lines) + "\n"


_SCRIPT = """#!{python}
import pathlib, sys, time
data = pathlib.Path(__file__).parent / "stand-in-data"
args = sys.argv[1:]
key = {{("-L",): "L", ("-q", "-x"): "qx"}}.get(tuple(args))
if key is None:
    print("stand-in nvidia-smi: unexpected arguments", args, file=sys.stderr)
    sys.exit(2)
part = data / key
if (part / "sleep").exists():
    time.sleep(float((part / "sleep").read_text()))
if (part / "out").exists():
    sys.stdout.buffer.write((part / "out").read_bytes())
if (part / "err").exists():
    sys.stderr.write((part / "err").read_text())
sys.exit(int((part / "rc").read_text()) if (part / "rc").exists() else 0)
"""


def stand_in(
    folder: Path,
    *,
    listing: str | None = None,
    xml: bytes | None = None,
    list_rc: int = 0,
    xml_rc: int = 0,
    stderr: str = "",
    sleep_s: float = 0.0,
) -> Path:
    """An executable that answers ``-L`` and ``-q -x`` the way nvidia-smi would."""
    folder.mkdir(parents=True, exist_ok=True)
    for key, out, rc in (("L", listing, list_rc), ("qx", xml, xml_rc)):
        part = folder / "stand-in-data" / key
        part.mkdir(parents=True, exist_ok=True)
        if out is not None:
            (part / "out").write_bytes(out.encode() if isinstance(out, str) else out)
        (part / "rc").write_text(str(rc))
        if stderr:
            (part / "err").write_text(stderr)
        if sleep_s:
            (part / "sleep").write_text(str(sleep_s))
    script = folder / "nvidia-smi"
    script.write_text(_SCRIPT.format(python=sys.executable))
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def fixture_stand_in(folder: Path, xml_name: str) -> Path:
    return stand_in(folder, listing=list_text(xml_name), xml=xml_bytes(xml_name))
