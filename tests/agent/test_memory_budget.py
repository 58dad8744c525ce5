"""Engines held to their memory budgets: the agent fails the one that outgrows it, names OOM kills.

Real processes throughout: the stub engine takes real memory, the guard puts
it in a real cgroup (v1 or v2, where the agent may make one; this kind of
machine, CI included, has v1 with root) or watches its real RSS.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from tests.agent.conftest import AgentFactory
from tests.agent.fakes import FakeControlPlane
from tests.agent.helpers import assign, cpu_slot, gemma, model
from tests.waiting import eventually_sync

from llmgw import memory
from llmgw.agent.memguard import (
    CgroupWatch,
    EngineMemory,
    MemoryGuard,
    RssWatch,
    node_memory_mib,
)
from llmgw.wire import ModelSpec, ReplicaState, WeightsSource

BUDGET_MIB = 128


def budgeted(name: str, args: list[str], memory_mib: int = BUDGET_MIB) -> ModelSpec:
    spec = model(
        "sim", name=name, weights=WeightsSource(kind="none"), gpu_classes=["cpu"], engine_args=args
    )
    return spec.model_copy(update={"memory_mib": memory_mib})


def hog(mib: int) -> subprocess.Popen[bytes]:
    """A process of the node that is not an engine, holding ``mib`` of memory."""
    code = (
        f"import time; x = bytearray(b'x' * ({mib} << 20)); print('ok', flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"ok\n"
    return proc


def cgroups_here() -> bool:
    return MemoryGuard("probe").kind.startswith("cgroup")


@pytest.mark.parametrize("mode", ["auto", "rss"])
async def test_an_engine_past_its_budget_is_failed_and_nothing_else_is_touched(
    fake_cp: FakeControlPlane, make_agent: AgentFactory, mode: str
) -> None:
    bystander = hog(64)
    try:
        agent = make_agent("n1", memory_guard=mode)
        leaky = budgeted("leaky", ["--grow-mib", "160"])
        steady = budgeted("steady", [])
        fake_cp.assignments["n1"] = [
            assign(leaky, [cpu_slot(0)], replica_id="r-leaky"),
            assign(steady, [cpu_slot(1)], replica_id="r-steady"),
        ]
        failed = await fake_cp.wait_state("r-leaky", ReplicaState.FAILED)
        guard = agent._require_deps().memory
        assert guard is not None
        kind = guard.kind
        assert kind == ("rss" if mode == "rss" else MemoryGuard("probe").kind)
        reason = failed.reason or ""
        assert reason.startswith("out of memory budget: engine used "), reason
        assert f"of its {memory.gb(BUDGET_MIB * memory.MIB)} budget ({kind}); killed." in reason
        assert "Raise the model's memory_mib (now 128 MiB)" in reason
        assert failed.pid is not None and _gone(failed.pid)
        # The node's other processes: the other engine serves on, the
        # bystander and the agent's own process are untouched.
        report = fake_cp.reports[-1]
        states = {s.replica_id: s.state for s in report.replicas}
        assert states["r-steady"] == ReplicaState.READY
        assert bystander.poll() is None
        steady_pid = next(s.pid for s in report.replicas if s.replica_id == "r-steady")
        assert steady_pid is not None and psutil.Process(steady_pid).is_running()
    finally:
        bystander.kill()
        bystander.wait()


async def test_an_adopted_engine_is_held_to_the_budget_it_was_started_with(
    fake_cp: FakeControlPlane, make_agent: AgentFactory, tmp_path: Path
) -> None:
    first = make_agent("n1")
    leaky = budgeted("leaky", ["--grow-mib", "160", "--grow-after", "2"])
    fake_cp.assignments["n1"] = [assign(leaky, [cpu_slot(0)], replica_id="r-leaky")]
    ready = await fake_cp.wait_state("r-leaky", ReplicaState.READY)
    await first.shutdown(stop_engines=False)  # as if the agent died; the engine runs on
    before = len(fake_cp.reports)
    make_agent("n1", data_dir=tmp_path / "n1")
    await fake_cp.wait_for(lambda r: len(fake_cp.reports) > before)
    failed = await fake_cp.wait_state("r-leaky", ReplicaState.FAILED)
    assert failed.pid == ready.pid  # adopted, not restarted, and still held to its budget
    assert (failed.reason or "").startswith("out of memory budget: engine used "), failed.reason


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_an_oom_kill_inside_the_engines_cgroup_is_named_as_one() -> None:
    if not cgroups_here():
        pytest.skip("no writable memory cgroup on this machine (RSS watching is tested above)")
    guard = MemoryGuard("oom-test")
    spec = budgeted("m", [])
    held = EngineMemory(guard, BUDGET_MIB, memory.advice(spec, BUDGET_MIB))
    # Far past the hard limit in one go: the kernel kills it before any
    # check of the agent could, and only inside the engine's cgroup.
    code = "import time; time.sleep(0.3); x = bytearray(b'x' * (600 << 20)); time.sleep(30)"
    engine = subprocess.Popen([sys.executable, "-c", code])
    bystander = hog(32)
    try:
        held.attach("r-oom", engine.pid)
        assert isinstance(held.watch, CgroupWatch) and held.watch.path.is_dir()
        code_ = engine.wait(timeout=30)
        assert code_ == -9
        reason = held.exit_reason(code_) or ""
        kind = held.watch.kind
        assert reason.startswith(
            f"killed by the kernel's OOM killer at its memory limit ({kind}): engine used"
        ), reason
        assert f"of its {memory.gb(BUDGET_MIB * memory.MIB)} budget." in reason
        assert "Raise the model's memory_mib" in reason
        assert bystander.poll() is None  # the kernel chose within the engine's cgroup
        path = held.watch.path
        held.close()
        assert not path.exists()
    finally:
        for proc in (engine, bystander):
            proc.kill()
            proc.wait()


def test_a_sigkill_is_an_oom_kill_only_when_the_kernel_counted_one() -> None:
    spec = budgeted("m", [])
    held = EngineMemory(None, BUDGET_MIB, memory.advice(spec, BUDGET_MIB))

    class Watch(RssWatch):
        kills = 0

        def oom_kills(self) -> int:
            return self.kills

    watch = Watch(1, BUDGET_MIB * memory.MIB)
    held.watch = watch
    assert held.exit_reason(-9) is None  # killed by someone, not the OOM killer
    watch.kills = 1
    assert held.exit_reason(-15) is None  # not a SIGKILL
    reason = held.exit_reason(-9) or ""
    assert reason.startswith("killed by the kernel's OOM killer while the node ran out of memory")


def test_rss_watch_sums_the_engines_process_tree() -> None:
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time;"
            "subprocess.Popen([sys.executable, '-c',"
            " \"x = bytearray(b'x' * (96 << 20)); import time; time.sleep(30)\"]);"
            "time.sleep(30)",
        ]
    )
    try:
        watch = RssWatch(parent.pid, 64 * memory.MIB)
        # The child's memory counts against the engine.
        eventually_sync(lambda: (watch.used() or 0) > 96 * memory.MIB, what="the tree's 96 MiB")
    finally:
        for child in psutil.Process(parent.pid).children(recursive=True):
            child.kill()
        parent.kill()
        parent.wait()


def test_node_memory_is_the_machines_or_its_cgroups_limit() -> None:
    total = node_memory_mib()
    assert 0 < total <= psutil.virtual_memory().total // memory.MIB


GGUF_MIB = 242
# What llama.cpp's budget holds besides its prompt cache: the runtime, the KV of
# 8192 tokens and the GGUF.
NOT_CACHE_MIB = 768 + 256 + GGUF_MIB
GEMMA = gemma(kv_capacity_tokens=8192)
GEMMA_BUDGET_MIB = memory.need_mib(GEMMA, GGUF_MIB * memory.MIB)


def llamacpp_argv(
    server_binary: str, engine_args: list[str], budget_mib: int | None = GEMMA_BUDGET_MIB
) -> list[str]:
    from llmgw.agent.engines.base import LaunchContext
    from llmgw.agent.engines.llamacpp import LlamaCppAdapter

    d = [cpu_slot()]
    ctx = LaunchContext(
        assignment=assign(GEMMA.model_copy(update={"engine_args": engine_args}), d),
        weights_path="/w/gemma.gguf",
        host="127.0.0.1",
        port=21000,
        devices=d,
        memory_budget_mib=budget_mib,
        weights_bytes=GGUF_MIB * memory.MIB,
    )
    return LlamaCppAdapter(server_binary=server_binary).build(ctx).argv


def test_llamacpp_is_started_to_stay_within_its_budget() -> None:
    from llmgw.agent.engines.llamacpppython import PROMPT_CACHE_N_BATCH, PROMPT_CACHE_SHARE

    budget = GEMMA_BUDGET_MIB
    assert budget == 768 + 242 + 256 + 512  # runtime, GGUF, KV of 8192 tokens, headroom

    def argv(engine_args: list[str]) -> list[str]:
        return llamacpp_argv("", engine_args)

    plain = argv([])
    # No logits kept per token, no RAM prompt cache (it does not count what it holds).
    assert plain[plain.index("--logits_all") + 1] == "false"
    assert "--cache" not in plain and "--cache_size" not in plain
    # A catalog that turns the cache on gets it sized to a share of the room left.
    cached = argv(["--cache", "true"])
    room = budget - NOT_CACHE_MIB
    assert cached[cached.index("--cache_size") + 1] == str(room * memory.MIB // PROMPT_CACHE_SHARE)
    # Its states carry n_batch rows of logits each: fewer of them, and
    # none where no cache saves states.
    assert cached[cached.index("--n_batch") + 1] == str(PROMPT_CACHE_N_BATCH)
    assert "--n_batch" not in plain
    # What the catalog says wins (and with logits_all, n_ctx rows are kept whatever n_batch).
    mine = argv(["--cache", "true", "--cache_size", "1000", "--logits_all", "true"])
    assert mine.count("--cache_size") == 1 and mine.count("--logits_all") == 1
    assert "--n_batch" not in mine
    assert argv(["--cache", "true", "--n_batch", "512"]).count("--n_batch") == 1


def test_llama_server_prompt_cache_is_sized_from_the_budget() -> None:
    # llama-server keeps up to 8 GiB of saved prompt states in RAM unless
    # told (-cram, in MiB): far past a small replica's budget.
    from llmgw.agent.engines.llamacpp import SERVER_CACHE_RAM_SHARE

    def argv(engine_args: list[str], budget_mib: int | None = GEMMA_BUDGET_MIB) -> list[str]:
        return llamacpp_argv("llama-server", engine_args, budget_mib)

    plain = argv([])
    room = GEMMA_BUDGET_MIB - NOT_CACHE_MIB
    assert plain[plain.index("--cache-ram") + 1] == str(room // SERVER_CACHE_RAM_SHARE) == "256"
    # A budget with no room left turns the cache off (0), never "no limit" (-1).
    tight = argv([], budget_mib=NOT_CACHE_MIB - 10)
    assert tight[tight.index("--cache-ram") + 1] == "0"
    # What the catalog says wins, in any spelling llama-server reads.
    for mine in (["-cram", "64"], ["--cache-ram", "64"], ["--cache_ram=64"]):
        args = argv(mine)
        assert args.count("--cache-ram") == (1 if "--cache-ram" in mine else 0), mine
        assert args[-len(mine) :] == mine
    # No budget known: llama-server's own default stands.
    assert "--cache-ram" not in argv([], budget_mib=None)


def test_cgroup_v2_files_are_written_and_read_as_the_kernel_lays_them_out(tmp_path: Path) -> None:
    # No v2 memory controller on this kind of machine: the same code on a
    # directory laid out as v2's (the kernel's files are plain text).
    from llmgw.agent.memguard import CgroupParent

    parent = CgroupParent(tmp_path, 2)
    watch = parent.attach("llmgw-x-r1", 4242, 100 * memory.MIB)
    cgroup = tmp_path / "llmgw-x-r1"
    assert (cgroup / "memory.max").read_text() == str(164 * memory.MIB)  # + the 64 MiB margin
    assert (cgroup / "memory.swap.max").read_text() == "0"
    assert (cgroup / "cgroup.procs").read_text() == "4242"
    (cgroup / "memory.stat").write_text("anon 83886080\nfile 999999999\nfile_mapped 41943040\n")
    (cgroup / "memory.peak").write_text("130023424\n")
    (cgroup / "memory.events").write_text("low 0\nhigh 0\nmax 12\noom 1\noom_kill 1\n")
    assert watch.used() == 120 * memory.MIB  # anon + mapped files; page cache does not count
    assert watch.peak() == 124 * memory.MIB and watch.oom_kills() == 1
    assert watch.kind == "cgroup v2"


def test_in_its_own_cgroup_any_oom_kill_is_the_engines(tmp_path: Path) -> None:
    # A worker of the engine is killed; the leader then exits with code 1.
    from llmgw.agent.memguard import CgroupWatch

    (tmp_path / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 0\n")
    watch = CgroupWatch(tmp_path, 1, BUDGET_MIB * memory.MIB)
    held = EngineMemory(None, BUDGET_MIB, memory.advice(budgeted("m", []), BUDGET_MIB))
    held.watch = watch
    assert held.exit_reason(1) is None
    (tmp_path / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 1\n")
    (tmp_path / "memory.max_usage_in_bytes").write_text(str(192 * memory.MIB))
    assert (held.exit_reason(1) or "").startswith(
        "killed by the kernel's OOM killer at its memory limit (cgroup v1): engine used 0.19 GB"
        " of its 0.12 GB budget."
    )


def test_a_sleeping_engines_weights_count_in_its_budget_and_cgroup_limit(tmp_path: Path) -> None:
    # vLLM's sleep copies the weights to host RAM: the budget grows by them while it
    # sleeps (no kill for doing what it was told), and shrinks back when it wakes.
    from llmgw.agent.memguard import CgroupParent

    watch = CgroupParent(tmp_path, 2).attach("llmgw-x-r1", 4242, 100 * memory.MIB)
    held = EngineMemory(None, 100, memory.advice(budgeted("m", []), 100))
    held.watch = watch
    cgroup = tmp_path / "llmgw-x-r1"
    (cgroup / "memory.stat").write_text(f"anon {300 * memory.MIB}\nfile_mapped 0\n")
    assert held.overrun() is not None  # awake, 300 MiB is over its 100
    held.hold_asleep(256)
    assert held.overrun() is None and watch.budget_bytes == 356 * memory.MIB
    assert (cgroup / "memory.max").read_text() == str(420 * memory.MIB)  # + the 64 MiB margin
    held.hold_asleep(0)  # awake again
    assert held.overrun() is not None and watch.budget_bytes == 100 * memory.MIB
