"""Sessions over a model sharded with mx.distributed (issue 16).

Two ranks run on this machine over loopback (``mlx.launch -n 2 --backend ring``); their greedy tokens
must equal those of the same session in one process (invariant 8). The fault cases start the two
ranks as mlx.launch does (MLX_RANK + MLX_HOSTFILE) but without the launcher, which would otherwise
terminate the surviving rank before it can report.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import chatkit
from chatkit import ChatSession, GenerateParams, InvalidParamsError, ModelLoadError
from chatkit.decode.local import LocalSource
from chatkit.decode.sources import source_for
from chatkit.distributed import Group, shard_path
from chatkit.testing import tiny_model_path
from chatkit.testing.launch import free_ring_port, ring_launch

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "helpers" / "distributed_session.py"
LIMIT = 300  # seconds: every run here ends well within it, or the test fails


def _env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def _launch(*command: str, stdin: str | None = None, limit: float = LIMIT) -> subprocess.CompletedProcess[str]:
    args = [*ring_launch(), "--", sys.executable, *command]
    return subprocess.run(args, input=stdin, capture_output=True, text=True, timeout=limit, env=_env(), cwd=ROOT)


PLAIN = [("llama", "tensor"), ("qwen3", "tensor"), ("qwen3_5", "tensor"), ("qwen3_5", "pipeline")]
EXTRAS = [("qwen3", "tensor", "2"), ("qwen3_5", "pipeline", "6")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Every sharded case below in one mlx.launch run, and their one-process references in one process
    (tests/helpers/distributed_session.py ``cases``): the ranks start and connect once, not six times.
    ``runs / "one" / case`` and ``runs / "two" / case`` hold what each wrote."""
    out = tmp_path_factory.mktemp("distributed")
    sharded = [f"{a}-{s}" for a, s in PLAIN] + [f"extras-{a}-{s}-{n}" for a, s, n in EXTRAS]
    alone = [*dict.fromkeys(f"{a}-none" for a, _ in PLAIN), *(f"extras-{a}-none-{n}" for a, _, n in EXTRAS)]
    done = subprocess.run([sys.executable, str(SCRIPT), "cases", str(out / "one"), *alone], capture_output=True,
                          text=True, timeout=LIMIT, env=_env(), cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    done = _launch(str(SCRIPT), "cases", str(out / "two"), *sharded, limit=len(sharded) * LIMIT)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("arch, strategy", PLAIN)
def test_two_ranks_give_the_tokens_of_one_process(arch, strategy, runs):
    reference = json.loads((runs / "one" / f"{arch}-none" / "tokens.rank0.json").read_text())
    out = runs / "two" / f"{arch}-{strategy}"
    names = [t["turn"] for t in reference]
    for rank in (0, 1):
        turns = json.loads((out / f"tokens.rank{rank}.json").read_text())
        assert [t["turn"] for t in turns] == names
        for got, want in zip(turns, reference, strict=True):
            assert got["tokens"] == want["tokens"], (rank, got["turn"])
            assert (got["reused"], got["finish"]) == (want["reused"], want["finish"]), (rank, got["turn"])
    by_name = {t["turn"]: t for t in reference}
    assert by_name["reuse"]["reused"] > 0 and by_name["restored"]["reused"] > 0  # the cache was reused
    assert len(by_name["closed early"]["tokens"]) == 3  # rank 1 iterated on: it stopped with rank 0
    assert (out / "chat.safetensors").exists() and (out / "chat.rank1.safetensors").exists()
    # A restore that fails on rank 1 only fails on every rank, as the same error class.
    failures = [json.loads((out / f"restore-failures.rank{r}.json").read_text()) for r in (0, 1)]
    for case, cls in (("missing on rank 1", "CacheFileError"), ("another save on rank 1", "IncompatibleCacheError")):
        assert [f[case].split(":")[0] for f in failures] == [cls, cls], (case, failures)
    assert "on rank 1 of 2" in failures[0]["missing on rank 1"]
    assert "rank(s) 1 hold another conversation" in failures[0]["another save on rank 1"]
    # A shard restored into one process (another layout) is refused, not misread.
    lm = chatkit.load(tiny_model_path(arch=arch, tokenizer="bpe", seed=0))
    with pytest.raises(chatkit.IncompatibleCacheError, match="differ"):
        ChatSession.builder(lm).cache(out / "chat.safetensors").build()


@pytest.mark.slow
@pytest.mark.parametrize("arch, strategy, layers", EXTRAS)
def test_tool_guided_async_and_pooled_turns_over_two_ranks_equal_one_process(arch, strategy, layers, runs):
    """Every path above a plain turn (tests/helpers/distributed_session.py extras). Six qwen3_5 layers
    split 3 + 3 give the ranks caches of unequal size (1 vs 2 KV layers)."""
    one, two = runs / "one" / f"extras-{arch}-none-{layers}", runs / "two" / f"extras-{arch}-{strategy}-{layers}"
    reference = {t["turn"]: t for t in json.loads((one / "extras.rank0.json").read_text())}
    ranks = [{t["turn"]: t for t in json.loads((two / f"extras.rank{r}.json").read_text())} for r in (0, 1)]
    early = "astream closed early"  # where rank 0's worker stopped depends on timing: the ranks must agree
    assert ranks[0][early] == ranks[1][early] and len(ranks[0][early]["tokens"]) >= 3
    # Eviction follows the largest rank's bytes: both ranks evicted x, one process (exactly at budget) did not.
    uneven = [r["uneven pool"] for r in ranks]
    assert uneven[0] == uneven[1] and uneven[0]["tokens"] == reference["uneven pool"]["tokens"]
    if uneven[0]["sizes_differ"]:
        assert uneven[0]["evicted"] == ["x"] and reference["uneven pool"]["evicted"] == []
    assert uneven[0]["sizes_differ"] == (arch == "qwen3_5")
    for turns in ranks:
        assert list(turns) == list(reference)
        for name, want in reference.items():
            if name == "pool files":
                assert turns[name]["files"] == [f.replace(".safetensors", s) for f in want["files"]
                                                for s in (".rank1.safetensors", ".safetensors")], turns[name]
            elif name not in (early, "uneven pool"):
                assert turns[name] == want, name
    assert reference["tool loop"]["rounds"] == 2 and "tool_result" in reference["tool loop"]["kinds"]
    assert reference["tool loop"]["reused"] > 0 and reference["manual tool result"]["reused"] > 0
    assert reference["guided"]["value"]["name"] and reference["after guided"]["reused"] > 0
    assert all(reference[f"pool {k} {i}"]["reused"] > 0 for k, i in (("ada", 2), ("bob", 3), ("ada", 4)))
    assert reference["pool ada 4"]["evicted"] == ["bob"]
    assert len(reference["pool files"]["files"]) == 1  # ada's file; bob's was removed (on every rank)


def _run_ranks_without_launcher(fault: str, out: Path, port: int) -> list[subprocess.Popen[str]]:
    hostfile = out / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]]))
    procs = []
    for rank in (0, 1):
        env = dict(_env(), MLX_RANK=str(rank), MLX_HOSTFILE=str(hostfile))
        procs.append(subprocess.Popen([sys.executable, str(SCRIPT), "qwen3", "tensor", str(out), fault], env=env,
                                      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


@pytest.fixture(scope="module")
def faults(tmp_path_factory) -> Iterator[dict[str, list[subprocess.Popen[str]]]]:
    """The ``die`` and the ``hang`` pair of ranks, started together: most of each run is rank 0 waiting
    out its 10 s watchdog, which the two pairs now wait at the same time."""
    ports: list[int] = []
    while len(ports) < 2:
        port = free_ring_port()
        if all(abs(port - p) > 1 for p in ports):  # each pair takes port and port + 1
            ports.append(port)
    runs = {fault: _run_ranks_without_launcher(fault, tmp_path_factory.mktemp(fault), port)
            for fault, port in zip(("die", "hang"), ports)}
    yield runs
    for procs in runs.values():
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdout.close(), proc.stderr.close()


@pytest.mark.slow
def test_a_killed_rank_gives_a_clear_error(faults):
    rank0, rank1 = faults["die"]
    try:
        _, err = rank0.communicate(timeout=LIMIT)
    finally:
        rank1.kill()
        rank1.wait()
    assert rank1.returncode == -signal.SIGKILL
    # A collective evaluated on its own raises at once (the backend reports the lost peer); one inside a
    # step's graph leaves the step waiting, which the watchdog ends.
    lost = "chatkit.errors.DistributedError: rank 0 of 2 lost rank 1 while "
    silent = "chatkit: error: rank 0 of 2: no answer from rank 1 within 10 s while "
    assert (rank0.returncode, lost in err) == (1, True) or (rank0.returncode, silent in err) == (75, True), err[-3000:]


@pytest.mark.slow
def test_a_hung_rank_stops_the_others_after_the_timeout(faults):
    rank0, rank1 = faults["hang"]
    try:
        _, err = rank0.communicate(timeout=LIMIT)
    finally:
        rank1.kill()
        rank1.wait()
    assert rank0.returncode == 75, err[-3000:]  # the watchdog's exit code
    assert "chatkit: error: rank 0 of 2: no answer from rank 1 within 10 s while generating" in err, err[-3000:]


CHAT_INPUT = "Hello there.\n\nWhat next?\n/undo\n/retry\n/save {save}\n/load {save}\nAnd after loading?\n/stats\n/quit\n"  # mlx.launch never closes the ranks' stdin


@pytest.mark.slow
def test_the_cli_over_two_ranks_prints_the_one_process_conversation_once(tmp_path):
    path = tiny_model_path(arch="qwen3", tokenizer="bpe", seed=0)
    common = ["-m", "chatkit", "chat", "--model", str(path), "--max-tokens", "10"]
    one = subprocess.run([sys.executable, *common], input=CHAT_INPUT.format(save=tmp_path / "one.safetensors"),
                         capture_output=True, text=True, timeout=LIMIT, env=_env(), cwd=ROOT)
    two = _launch(*common, "--distributed", "tensor", stdin=CHAT_INPUT.format(save=tmp_path / "two.safetensors"))
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-3000:]
    assert "error" not in one.stderr and "error" not in two.stderr, two.stderr[-3000:]

    def conversation(stdout: str, save: str) -> list[str]:  # /stats speeds and file sizes differ
        lines = [line.replace(save, "FILE") for line in stdout.splitlines() if not line.startswith(("last turn", "cache:"))]
        return [line.split(" (")[0] if line.startswith("saved") else line for line in lines]

    assert conversation(two.stdout, str(tmp_path / "two.safetensors")) == conversation(
        one.stdout, str(tmp_path / "one.safetensors"))
    assert "undone: 'What next?'" in two.stdout
    assert (tmp_path / "two.rank1.safetensors").exists()


# -- in one process ------------------------------------------------------------------------------------------


def test_tool_call_ids_follow_the_conversation_so_every_rank_renders_the_same_prompt(tiny):
    """Ids are rendered by some templates (tests/helpers/distributed_session.py IDS_TEMPLATE): random ids would
    make every rank's next prompt differ (a DistributedError), and greedy turns irreproducible."""
    from chatkit.testing import Scripted

    def get_weather(city: str) -> str:
        """The weather.

        Args:
            city: A city.
        """
        return "Sunny."

    lm = tiny(tokenizer="bpe-think")
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    calls = f"{call}\n{call}"
    seen = []
    for _ in range(2):
        params = GenerateParams(max_tokens=60, logits_processors=[Scripted(lm.tokenizer, [calls, calls])])
        session = ChatSession.builder(lm).tools([get_weather], tool_execution="manual").generate_params(params).build()
        session.respond("Weather?")
        first = [c.id for c in session.pending_tool_calls]
        for call in session.pending_tool_calls:
            session.respond("Sunny.", role="tool", tool_call_id=call.id)
        seen.append((first, [c.id for c in session.pending_tool_calls]))
    assert seen[0] == seen[1]  # the same conversation, the same ids
    first, later = seen[0]
    assert len(set(first + later)) == 4  # two identical calls in a reply, and again later: all differ


def test_a_world_of_one_loads_and_answers_as_today():
    path = tiny_model_path(arch="qwen3", tokenizer="bpe", seed=0)
    plain = chatkit.load(path)
    solo = chatkit.load(path, distributed="auto")
    assert solo.distributed is not None and (solo.distributed.size, solo.distributed.rank) == (1, 0)
    assert solo.fingerprint == plain.fingerprint  # caches move freely between the two
    params = GenerateParams(max_tokens=16, temperature=0.0)
    a = ChatSession.builder(plain).generate_params(params).build()
    b = ChatSession.builder(solo).generate_params(params).build()
    assert isinstance(b._state.source, LocalSource)
    for prompt in ("Hello there.", "And then?"):
        with a.stream_respond(prompt) as sa, b.stream_respond(prompt) as sb:
            assert list(c.token for c in sb) == list(c.token for c in sa)


def test_an_unknown_strategy_is_refused():
    with pytest.raises(ModelLoadError, match="tensor, pipeline, auto"):
        chatkit.load(tiny_model_path(arch="qwen3", tokenizer="bpe", seed=0), distributed="data")


def test_speculative_decoding_over_a_sharded_model_is_refused():
    group = Group(group=None, strategy="tensor", rank=0, size=2)
    with pytest.raises(InvalidParamsError, match="sharded"):
        source_for(object(), group, speculative=object())


def test_each_rank_has_its_own_cache_file():
    two = [Group(group=None, strategy="tensor", rank=r, size=2) for r in (0, 1)]
    assert [Path(shard_path(g, "dir/chat.safetensors")) for g in two] == [
        Path("dir/chat.safetensors"), Path("dir/chat.rank1.safetensors")]
    # Rank 0 hands the path on untouched: the store still sees a trailing separator and refuses it.
    assert shard_path(None, "chat.safetensors/") == "chat.safetensors/"
