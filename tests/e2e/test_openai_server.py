"""vLLM's OpenAI server, started with the quick start's CPU command as written, through a real tiercache
server: the same answers after a restart with the prompts' KV loaded from tiercache, and serving on
through a tiercache outage.

The CPU command is parsed out of docs/quickstart.md (its install lines are checked, not re-run) and
run with only its placeholders substituted (``MODEL``, the documented socket), test-environment
flags appended (port, model length, dtype, seed, eager mode, a small KV cache, prompt token details
in the usage) and one connector setting added (a round-trip bound for a shared, noisy machine).
The model is the tiny seeded Llama with :func:`write_tokenizer`'s word-level tokenizer, so a prompt
is text ("t17 t403 ...") that encodes to known token ids.

Three vLLM server starts (each a fresh engine with an empty local prefix cache), ~20-50 s each on
two cores; the module takes ~3-4 minutes:

1. *cold*: completions and chat completions (greedy, logprobs) through tiercache, which stores the
   prompts' full chunks;
2. *restart*: the same requests load those chunks from tiercache and give the same text and
   logprobs (within :data:`LOGPROB_TOLERANCE`); vLLM's ``/metrics`` and ``tiercache inspect
   summary`` count the hits;
3. *outage*: tiercache is down when vLLM starts: vLLM starts and serves (misses, same answers), the
   connector warns once; a tiercache server started later on the same endpoint and disk is found
   without restarting vLLM (hits from its disk tier). This start names the connector by its plugin
   alone (no ``kv_connector_module_path``), with a :data:`RETRY_S` far beyond the test's wait: the
   connector must listen for the server, not wait out ``retry_s`` between attempts.

Chunk 64, vLLM blocks 32. Prompts of 200, 150, 257 and 130 tokens (chat adds ``<s>``): a fresh
engine can take 192, 128, 256 and 128 prompt tokens of each kind from tiercache.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from tests.docs.quickstart import (
    MODEL_PLACEHOLDER,
    QUICKSTART,
    SOCKET_PLACEHOLDER,
    cpu_vllm_block,
    parse_blocks,
    shell_commands,
)
from tests.e2e.engine_run import make_prompts, write_served_tiny_llama
from tests.e2e.openai_server import EXTERNAL_HITS, EXTERNAL_QUERIES, Completion, OpenAIServer
from tests.e2e.setup import MiB, cli_json, engine_stats, wait_for, wait_for_stores
from tests.server.serverproc import ServerProcess, ServerSpec
from tiercache.keys.tenant import tenant_id, tenant_label
from tiercache.testing.checkpoints import token_text
from tiercache.testing.poll import wait_until

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
CHUNK = 64
VOCAB = 512  # the tiny Llama's
LENGTHS = [200, 150, 257, 130]
MAX_TOKENS = 8
#: Completions and chats of a fresh engine from tiercache: every full chunk but the one holding the
#: last prompt token (vLLM computes at least one token). A chat prompt is ``<s>`` + the same words.
EXPECTED_CACHED = [((n - 1) // CHUNK) * CHUNK for n in LENGTHS]  # [192, 128, 256, 128]
EXPECTED_CACHED_CHAT = [(n // CHUNK) * CHUNK for n in LENGTHS]  # n + 1 tokens: [192, 128, 256, 128]
#: One-chunk prompts the cold server also stores: after the outage each is sent once (vLLM's own
#: prefix cache has never seen it) until one is served from tiercache again.
PROBES = 24
PROBE_LENGTH = CHUNK + 1
STORED_CHUNKS = sum(n // CHUNK for n in LENGTHS) + sum((n + 1) // CHUNK for n in LENGTHS) + PROBES
#: Same engine and kernels, the prompt alone in its batch: float32 logprobs of a loaded prefix match a
#: computed one to ~1e-6; 1e-3 leaves room for the server's scheduling, and a wrong KV moves them by ~1.
LOGPROB_TOLERANCE = 1e-3
RETRY_S = 600.0
#: What the scheduler and the worker half each log once when the server cannot be reached at start
#: (tiercache/client/link.py, ``ServerLink.start``), and once per outage when a call fails.
UNREACHABLE_WARNING = "is not reachable"
FAILED_WARNING = "treating the cache as unavailable"
#: Flags this test adds to the documented command; none of them is one of the documented flags.
TEST_FLAGS = [
    "--max-model-len",
    "1024",
    "--dtype",
    "float32",
    "--seed",
    "0",
    "--enforce-eager",
    "--num-gpu-blocks-override",
    "128",  # 4096 tokens: the four prompts of both kinds fit, nothing is evicted
    "--enable-prompt-tokens-details",  # usage.prompt_tokens_details.cached_tokens
]
#: Connector settings this test adds to the documented ``--kv-transfer-config`` (none of them is
#: documented there). A round trip the tiercache server answers late takes the connector's link down
#: (misses, no stores) for the next half second: two vLLM shards on two shared CPUs once made a
#: lookup miss the 2 s default and the cold run lost its probes' stores. The engine-run tests allow
#: 5 s for the same reason; this module's vLLM servers wait at most this long at start when
#: tiercache is down (the outage).
TEST_CONNECTOR = {"timeout_s": 10.0}


@dataclass
class Answers:
    """One vLLM server's answers to every prompt, as completions and as chats."""

    completions: list[Completion] = field(default_factory=list)
    chats: list[Completion] = field(default_factory=list)

    def all(self) -> list[Completion]:
        return [*self.completions, *self.chats]


def ask(server: OpenAIServer, prompts: list[str]) -> Answers:
    """Every prompt as a completion, then as a chat message, one request at a time."""
    return Answers(
        [server.complete(p, MAX_TOKENS) for p in prompts], [server.chat(p, MAX_TOKENS) for p in prompts]
    )


def max_diff(a: list[Completion], b: list[Completion]) -> float:
    return max(x.max_logprob_diff(y) for x, y in zip(a, b, strict=True))


def documented_command() -> list[str]:
    """The quick start's CPU ``python -m vllm.entrypoints.openai.api_server`` command, as argv (its
    install lines checked instead of run: this interpreter is that environment and has vLLM)."""
    commands = shell_commands(cpu_vllm_block(parse_blocks(QUICKSTART.read_text())).body)
    *install, serve = commands
    for words in install:
        assert words[:3] == ["python3", "-m", "venv"] or words[0].endswith("/pip"), words
    assert serve[1:3] == ["-m", "vllm.entrypoints.openai.api_server"], serve
    return serve


def interpreter_for(documented: str) -> str:
    """The documented ``.venv-vllm/bin/python``: this interpreter when it is that environment's,
    else that path in the checkout; skip when neither exists."""
    venv = Path(documented).parent.parent
    if Path(sys.prefix).name == venv.name:
        return sys.executable
    if (ROOT / documented).exists():
        return str(ROOT / documented)
    pytest.skip(f"no {documented}: the quick start's vLLM environment is not here")


def substituted(words: list[str], model: Path, endpoint: str) -> list[str]:
    """``words`` with the placeholders replaced: ``MODEL`` (a word) and the documented socket (inside
    ``--kv-transfer-config``), and the interpreter by :func:`interpreter_for`; nothing else changes."""
    out = [interpreter_for(words[0])]
    for w in words[1:]:
        w = str(model) if w == MODEL_PLACEHOLDER else w
        out.append(w.replace(SOCKET_PLACEHOLDER, endpoint))
    return out


def with_kv_config(argv: list[str], change: dict[str, Any], drop: tuple[str, ...] = ()) -> list[str]:
    """``argv`` whose ``--kv-transfer-config`` has ``change`` merged into its extra config and the
    top-level keys ``drop`` removed."""
    i = argv.index("--kv-transfer-config") + 1
    config = json.loads(argv[i])
    config["kv_connector_extra_config"].update(change)
    for key in drop:
        del config[key]
    return [*argv[:i], json.dumps(config), *argv[i + 1 :]]


@dataclass
class World:
    tmp: Path
    model: Path
    prompts: list[str]
    probes: list[str]
    spec: ServerSpec
    server: ServerProcess
    documented: list[str]  # the quick start's command, as written
    argv: list[str]  # what this test runs: substituted, test flags appended, TEST_CONNECTOR added
    ran: dict[str, list[str]] = field(default_factory=dict)  # each vLLM server's whole command line

    def vllm(self, name: str, argv: list[str] | None = None) -> OpenAIServer:
        server = OpenAIServer(argv or self.argv, self.tmp / f"vllm-{name}.log")
        self.ran[name] = server.argv
        return server


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("openai")
    model = tmp / "model"
    write_served_tiny_llama(model, seed=1234)
    prompts = [token_text(p) for p in make_prompts(LENGTHS, seed=7, vocab=VOCAB)]
    probes = [token_text(p) for p in make_prompts([PROBE_LENGTH] * PROBES, seed=11, vocab=VOCAB)]
    spec = ServerSpec(
        listen=f"unix://{tmp}/server.sock",  # the default scheme, which the documented command names
        l1_bytes=64 * MiB,
        disk_path=str(tmp / "disk"),
        options={"chunk_size": CHUNK},
    )
    documented = documented_command()
    argv = with_kv_config([*substituted(documented, model, spec.listen), *TEST_FLAGS], TEST_CONNECTOR)
    w = World(tmp, model, prompts, probes, spec, ServerProcess(spec), documented, argv)
    try:
        w.server.wait_ready()
        yield w
    finally:
        w.server.stop()  # the outage's second server, if it got that far


@pytest.fixture(scope="module")
def cold(world: World) -> Answers:
    """A first vLLM server's answers; tiercache stores every full prompt chunk (L1, then disk)."""
    with world.vllm("cold") as vllm:
        answers = ask(vllm, world.prompts)
        for probe in world.probes:
            vllm.complete(probe, 1)
        # Waited for while vLLM still serves: a reply leaves before its request's stores are done,
        # and a SIGTERM'd engine core that overruns vLLM's shutdown grace is killed with its queue.
        assert wait_for_stores(world.server, STORED_CHUNKS) == STORED_CHUNKS
    assert wait_for(world.server, "l2_writes", STORED_CHUNKS) == STORED_CHUNKS
    return answers


#: A tenant's cache salt: its request after the restart shares nothing with the unsalted prompts.
SALT = "tenant-acme"


@dataclass
class Restart:
    answers: Answers
    metrics: dict[str, float]
    summary: dict[str, Any]  # ``tiercache inspect summary --json`` afterwards
    chunk_hits: int  # the server's lookup_chunks_hit during the restart's requests
    salted: Completion  # the first prompt again, with SALT
    salted_summary: dict[str, Any]  # the summary once the salted request's chunks were stored


@pytest.fixture(scope="module")
def restart(world: World, cold: Answers) -> Restart:
    """A second vLLM server (fresh engine, the documented command again) asked the same."""
    before = engine_stats(world.server)["lookup_chunks_hit"]
    with world.vllm("restart") as vllm:
        answers = ask(vllm, world.prompts)
        metrics = vllm.metrics()
        hits = engine_stats(world.server)["lookup_chunks_hit"] - before
        summary = inspect_summary(world.spec.listen)
        salted = vllm.complete(world.prompts[0], MAX_TOKENS, cache_salt=SALT)
        stored = STORED_CHUNKS + LENGTHS[0] // CHUNK
        assert wait_for_stores(world.server, stored) == stored  # while vLLM serves, as in ``cold``
    return Restart(answers, metrics, summary, hits, salted, inspect_summary(world.spec.listen))


def inspect_summary(endpoint: str) -> dict[str, Any]:
    """``tiercache inspect summary --server ENDPOINT --json``, run as the CLI."""
    return cli_json("inspect", "summary", "--server", endpoint, "--json")


@pytest.mark.parametrize("name", ["cold", "restart"])
def test_the_documented_cpu_command_is_what_ran(world: World, restart: Restart, name: str) -> None:
    """Every word of the quick start's command ran unchanged but the placeholders (and the venv's
    interpreter for its path); the test's flags come after it and override none of its flags, and
    its connector settings (:data:`TEST_CONNECTOR`) add to the documented ones, changing none."""
    documented, ran = world.documented, world.ran[name]
    assert documented[0] == ".venv-vllm/bin/python"
    assert Path(ran[0]).parent.parent.name == ".venv-vllm"
    config_at = ran.index("--kv-transfer-config") + 1
    for i, (doc, run) in enumerate(zip(documented, ran, strict=False)):
        if i == 0:
            continue  # the interpreter (above)
        if i == config_at:
            want = json.loads(doc.replace(SOCKET_PLACEHOLDER, world.spec.listen))
            assert not want["kv_connector_extra_config"].keys() & TEST_CONNECTOR.keys()
            want["kv_connector_extra_config"].update(TEST_CONNECTOR)
            assert json.loads(run) == want
        elif doc == MODEL_PLACEHOLDER:
            assert run == str(world.model)
        else:
            assert run == doc.replace(SOCKET_PLACEHOLDER, world.spec.listen)
    flags = {w for w in documented if w.startswith("--")}
    assert {"--enable-prefix-caching", "--block-size", "--gpu-memory-utilization"} <= flags
    appended = ran[len(documented) :]
    assert appended[: len(TEST_FLAGS)] == TEST_FLAGS  # then OpenAIServer's --host and --port
    assert not flags & {w for w in appended if w.startswith("--")}
    config = json.loads(ran[ran.index("--kv-transfer-config") + 1])
    assert config["kv_connector_extra_config"]["server"] == world.spec.listen


def test_a_restarted_server_answers_the_same_text_and_logprobs(cold: Answers, restart: Restart) -> None:
    diff = max_diff(cold.all(), restart.answers.all())
    print(f"\n[openai restart] max |logprob diff| {diff:.3g} over {len(cold.all())} requests")
    assert [c.text for c in restart.answers.all()] == [c.text for c in cold.all()]
    assert all(len(c.logprobs) == MAX_TOKENS for c in restart.answers.all())
    assert diff <= LOGPROB_TOLERANCE


def test_the_cold_server_computed_every_prompt_token(cold: Answers) -> None:
    assert [c.prompt_tokens for c in cold.completions] == LENGTHS
    assert [c.prompt_tokens for c in cold.chats] == [n + 1 for n in LENGTHS]
    assert [c.cached_tokens for c in cold.all()] == [0] * 2 * len(LENGTHS)


def test_after_the_restart_the_prompts_full_chunks_come_from_tiercache(restart: Restart) -> None:
    cached = [c.cached_tokens for c in restart.answers.completions]
    cached_chat = [c.cached_tokens for c in restart.answers.chats]
    print(
        f"\n[openai restart] cached tokens {cached} / chat {cached_chat}; "
        f"{EXTERNAL_HITS} {restart.metrics.get(EXTERNAL_HITS)} of "
        f"{restart.metrics.get(EXTERNAL_QUERIES)} queried; server chunk hits {restart.chunk_hits}"
    )
    assert cached == EXPECTED_CACHED
    assert cached_chat == EXPECTED_CACHED_CHAT
    # vLLM's own count of the tokens its KV connector supplied: exactly those full chunks.
    assert restart.metrics[EXTERNAL_HITS] == sum(EXPECTED_CACHED) + sum(EXPECTED_CACHED_CHAT)
    assert restart.metrics[EXTERNAL_QUERIES] >= restart.metrics[EXTERNAL_HITS]
    assert restart.chunk_hits == (sum(EXPECTED_CACHED) + sum(EXPECTED_CACHED_CHAT)) // CHUNK


def test_tiercache_inspect_summary_shows_the_hits(restart: Restart) -> None:
    l1 = restart.summary["tiers"]["l1"]
    assert l1["hits"] >= restart.chunk_hits > 0, restart.summary
    assert l1["objects"] == STORED_CHUNKS, restart.summary
    assert restart.summary["engine"]["stores"] == STORED_CHUNKS, restart.summary


def test_a_salted_request_is_its_tenants_own_counted_by_id_and_never_shares_the_unsalted_chunks(
    restart: Restart,
) -> None:
    assert restart.salted.cached_tokens == 0  # the unsalted chunks of the same prompt are not its
    assert restart.salted.text == restart.answers.completions[0].text
    tenants = restart.salted_summary["tenants"]
    acme = tenants[tenant_label(tenant_id(SALT))]
    print(f"\n[openai tenants] {sorted(tenants)}: {SALT!r} -> {acme}")
    assert SALT not in json.dumps(restart.salted_summary)  # named by id only
    assert acme["lookups"] == 1 and acme["hit_chunks"] == 0
    assert acme["tiers"]["l1"]["objects"] == acme["tiers"]["l1"]["puts"] == LENGTHS[0] // CHUNK
    assert tenants["default"]["tiers"]["l1"]["objects"] == STORED_CHUNKS


@dataclass
class Outage:
    argv: list[str]
    down: Answers  # completions and chats while tiercache is down: all misses
    warnings_at_start: int  # UNREACHABLE_WARNING lines once vLLM was ready
    warnings_after: int  # ... after the requests
    failed_warnings: int  # FAILED_WARNING lines after the requests
    probes_missed: int  # probes sent after tiercache came back before one hit
    found_after_s: float  # from the new tiercache server's first answer to the first probe hit
    back: list[Completion]  # completions, once a probe hit
    metrics_down: dict[str, float]
    metrics_probed: dict[str, float]  # once a probe hit
    metrics_back: dict[str, float]  # after ``back``
    log: str


@pytest.fixture(scope="module")
def outage(world: World, cold: Answers, restart: Restart) -> Iterator[Outage]:
    """tiercache down while a third vLLM server starts and serves; then a new tiercache server on the
    same endpoint and disk (L1 empty) while vLLM keeps running."""
    world.server.stop()
    argv = with_kv_config(world.argv, {"retry_s": RETRY_S}, drop=("kv_connector_module_path",))
    vllm = world.vllm("outage", argv)
    try:
        vllm.wait_ready()
        warnings_at_start = vllm.log_text().count(UNREACHABLE_WARNING)
        # Chats first: the completions are kept for after the outage, so that vLLM's own prefix
        # cache has not seen them and any cached token can only come from tiercache.
        down = Answers(chats=[vllm.chat(p, MAX_TOKENS) for p in world.prompts])
        down.completions = [vllm.complete(world.prompts[0], MAX_TOKENS)]
        metrics_down = vllm.metrics()
        log = vllm.log_text()
        world.server = ServerProcess(world.spec)  # the same socket and disk; L1 empty
        world.server.wait_ready()
        ready = time.monotonic()
        probes = iter(world.probes)
        missed = 0

        def a_probe_hits() -> bool:
            nonlocal missed
            probe = next(probes, None)
            assert probe is not None, f"all {PROBES} probes missed:\n{vllm.log_tail()}"
            hit = (vllm.complete(probe, 1).cached_tokens or 0) > 0
            missed += not hit
            return hit

        # The connector's halves reconnect in the background (a ping waits for the server).
        wait_until(a_probe_hits, timeout=60, interval=0.1, what="a request served from tiercache again")
        found_after = time.monotonic() - ready
        metrics_probed = vllm.metrics()
        back = [vllm.complete(p, MAX_TOKENS) for p in world.prompts[1:]]
        yield Outage(
            argv,
            down,
            warnings_at_start,
            log.count(UNREACHABLE_WARNING),
            log.count(FAILED_WARNING),
            missed,
            found_after,
            back,
            metrics_down,
            metrics_probed,
            vllm.metrics(),
            vllm.log_text(),
        )
    finally:
        vllm.stop()


def test_the_outage_start_names_the_connector_by_its_plugin_alone(outage: Outage) -> None:
    config = json.loads(outage.argv[outage.argv.index("--kv-transfer-config") + 1])
    assert config["kv_connector"] == "TierCacheConnector"
    assert "kv_connector_module_path" not in config
    assert "Creating v1 connector with name: TierCacheConnector" in outage.log


def test_with_tiercache_down_vllm_starts_and_answers_the_same_from_scratch(
    cold: Answers, outage: Outage
) -> None:
    assert [c.cached_tokens for c in outage.down.chats] == [0] * len(LENGTHS)
    assert outage.metrics_down[EXTERNAL_HITS] == 0
    assert [c.text for c in outage.down.chats] == [c.text for c in cold.chats]
    assert max_diff(outage.down.chats, cold.chats) <= LOGPROB_TOLERANCE
    assert outage.down.completions[0].text == cold.completions[0].text
    assert outage.down.completions[0].cached_tokens == 0


def test_the_connector_warns_once_per_half_at_start_not_per_request(outage: Outage) -> None:
    """One warning from the scheduler half (engine core) and one from the worker half (its own
    process), none for the requests served while the server stayed down."""
    assert outage.warnings_at_start == 2, outage.log[-6000:]
    assert outage.warnings_after == outage.warnings_at_start
    assert outage.failed_warnings == 0


def test_a_tiercache_server_back_on_the_same_disk_serves_hits_without_restarting_vllm(
    cold: Answers, outage: Outage
) -> None:
    cached = [c.cached_tokens for c in outage.back]
    hits = outage.metrics_back[EXTERNAL_HITS] - outage.metrics_probed[EXTERNAL_HITS]
    print(
        f"\n[openai outage] {outage.probes_missed} probe(s) missed before one hit, "
        f"{outage.found_after_s:.2f} s after the new server answered; then cached tokens "
        f"{cached}, external hits {hits}"
    )
    assert cached == EXPECTED_CACHED[1:]
    assert hits == sum(EXPECTED_CACHED[1:])
    assert [c.text for c in outage.back] == [c.text for c in cold.completions[1:]]
    assert max_diff(outage.back, cold.completions[1:]) <= LOGPROB_TOLERANCE
