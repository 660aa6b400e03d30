"""One rank against two: TTFT, per-token decode time and the communication share, over loopback.

    .venv/bin/python bench/distributed.py [--rounds 3] [--tokens 64] [--prompt 512]   # ~3 min on an idle machine

Runs the benchmarks' ~29M-parameter Qwen3 model (bench/_common.py) in a chat session in one process,
then sharded by tensor parallelism over two ranks (``mlx.launch -n 2 --backend ring`` on 127.0.0.1).
Each rank gets one BLAS thread (OPENBLAS_NUM_THREADS=1) in both runs, so that the two ranks of the
second run do not fight over this machine's two cores. Per round: a fresh turn (``session.clear()``)
on a ``--prompt``-token prompt, ``--tokens`` greedy tokens (EOS biased -1e9); TTFT is the time to the
first chunk, decode the time per token after it; medians of ``--rounds`` rounds after a warm-up.

Communication, measured on the two ranks: the latency of one ``all_sum`` of a decode step's
activation (1 x hidden float32), of a prefill chunk's (prompt x hidden) and of a scalar (the lockstep
token and stop vote), each the median of many evaluated in a row. A tensor-parallel decode step runs
2 activation all_sums per layer (attention and MLP outputs), plus chatkit's token broadcast and stop
vote: "comm" is that count times the measured latencies, and its share of the measured decode time.
The tokens of the two runs must be equal.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def worker(out: Path, rounds: int, tokens: int, prompt_tokens: int, quick: bool = False) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import chatkit
    from chatkit import ChatSession, GenerateParams
    from chatkit.testing import tiny_model_path

    import mlx.core as mx
    from _common import MODEL_CONFIG, median, n_params

    path = tiny_model_path("qwen3", "bpe", 0, **({} if quick else MODEL_CONFIG))
    sharded = int(os.environ.get("MLX_WORLD", "1")) > 1
    # A generous bound: on a busy machine two ranks sharing its cores can be very slow (not hung).
    lm = chatkit.load(path, distributed="tensor" if sharded else None, distributed_timeout=1800.0)
    group = lm.distributed
    eos = sorted(int(e) for e in lm.tokenizer.eos_token_ids)
    params = GenerateParams(max_tokens=tokens, temperature=0.0, logit_bias={e: -1e9 for e in eos})
    session = ChatSession.builder(lm).generate_params(params).build()
    words = "the quick brown fox jumps over a lazy dog while seven wise owls count stars".split()
    text = " ".join(words[i % len(words)] for i in range(prompt_tokens))
    while len(lm.tokenizer.encode(text)) > prompt_tokens - 12:  # the template adds about a dozen tokens
        text = text.rsplit(" ", 1)[0]
    ttft, decode, runs = [], [], []
    for r in range(rounds + 1):
        session.clear()
        t0 = time.perf_counter()
        times, ids = [], []
        with session.stream_respond(text) as stream:
            for chunk in stream:
                times.append(time.perf_counter())
                ids.append(chunk.token)
        if r == 0:
            continue  # warm-up
        ttft.append(times[0] - t0)
        decode.append((times[-1] - times[0]) / (len(times) - 1))
        runs.append(ids)
    result = {
        "ranks": group.size if group is not None else 1,
        "params": n_params(lm),
        "prompt_tokens": session.last_stats.prompt_tokens,
        "ttft_s": median(ttft),
        "decode_ms": median(decode) * 1e3,
        "tokens": runs[0],
        "same_each_round": all(ids == runs[0] for ids in runs),
    }
    if sharded:
        hidden, layers = lm.config["hidden_size"], lm.config["num_hidden_layers"]

        def latency(shape: tuple[int, ...], n: int) -> float:
            x = mx.ones(shape, dtype=mx.float32)
            mx.eval(mx.distributed.all_sum(x))
            t = []
            for _ in range(n):
                t0 = time.perf_counter()
                mx.eval(mx.distributed.all_sum(x))
                t.append(time.perf_counter() - t0)
            return median(t)

        step, scalar = latency((1, 1, hidden), 400), latency((1,), 400)
        chunk = latency((1, result["prompt_tokens"], hidden), 40)
        comm = 2 * layers * step + 2 * scalar
        result.update(
            allsum_step_us=step * 1e6, allsum_scalar_us=scalar * 1e6, allsum_prefill_ms=chunk * 1e3,
            comm_ms=comm * 1e3, comm_share=comm / (result["decode_ms"] / 1e3),
            prefill_comm_share=2 * layers * chunk / result["ttft_s"],
            bytes_per_token=2 * layers * hidden * 4, hidden=hidden, layers=layers,
        )
    if group is None or group.leader:
        out.write_text(json.dumps(result))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true", help="seconds on the tests' tiny model: checks the script end to end")
    args = p.parse_args()
    if args.quick and not args.worker:
        args.rounds, args.tokens, args.prompt = 1, 8, 64
    if args.worker:
        worker(Path(args.worker), args.rounds, args.tokens, args.prompt, args.quick)
        return

    sys.path.insert(0, str(HERE))
    from _common import _cpu_times, describe, load_model, quick, wait_until_quiet

    quick(args)
    print(describe(load_model()))
    print(wait_until_quiet(max_wait=60))
    busy0, wall0, kids0 = _cpu_times()[0], time.time(), os.times()
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), str(HERE), env.get("PYTHONPATH", "")])
    me = [sys.executable, str(Path(__file__).resolve()), "--rounds", str(args.rounds), "--tokens", str(args.tokens),
          "--prompt", str(args.prompt), *(["--quick"] if args.quick else []), "--worker"]
    from chatkit.testing.launch import ring_launch

    launch = [*ring_launch(), "--env", "MLX_WORLD=2",
              "--env", "OPENBLAS_NUM_THREADS=1", "--"]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for ranks in (1, 2):
            out = Path(tmp) / f"ranks{ranks}.json"
            cmd = [*me, str(out)] if ranks == 1 else [*launch, *me, str(out)]
            subprocess.run(cmd, env=env, check=True, timeout=1800)
            results.append(json.loads(out.read_text()))
    one, two = results
    print(f"run     : {args.rounds} rounds (+1 warm-up), prompt {one['prompt_tokens']} tokens, {args.tokens} "
          "greedy tokens; one BLAS thread per rank; two ranks = mlx.launch -n 2 --backend ring on 127.0.0.1")
    print(f"{'ranks':>5} {'TTFT s':>8} {'decode ms/token':>16} {'tokens/s':>9}")
    for r in results:
        print(f"{r['ranks']:>5} {r['ttft_s']:>8.3f} {r['decode_ms']:>16.2f} {1e3 / r['decode_ms']:>9.1f}")
    print(f"two ranks / one: TTFT x{two['ttft_s'] / one['ttft_s']:.2f}, decode time x{two['decode_ms'] / one['decode_ms']:.2f}")
    print(f"all_sum latency on loopback: {two['allsum_step_us']:.0f} us for a decode step's activation "
          f"(1 x {two['hidden']} float32), {two['allsum_scalar_us']:.0f} us for a scalar, "
          f"{two['allsum_prefill_ms']:.1f} ms for a prefill's ({two['prompt_tokens']} x {two['hidden']})")
    print(f"communication per decoded token: {2 * two['layers']} activation all_sums + token broadcast + stop vote "
          f"= {two['comm_ms']:.2f} ms, {two['comm_share']:.0%} of the decode time; prefill: "
          f"{two['prefill_comm_share']:.0%} of TTFT; {two['bytes_per_token']:,} bytes summed per token")
    same = one["tokens"] == two["tokens"] and one["same_each_round"] and two["same_each_round"]
    print(f"tokens  : {'identical' if same else 'DIFFERENT'} in one process and over two ranks")
    kids1, hz = os.times(), os.sysconf("SC_CLK_TCK")
    mine = (kids1.children_user + kids1.children_system) - (kids0.children_user + kids0.children_system)
    others = max(0.0, (_cpu_times()[0] - busy0) / hz - mine) / ((time.time() - wall0) * (os.cpu_count() or 1))
    print(f"CPU used by other processes during the run: {others:.0%} of the machine")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
