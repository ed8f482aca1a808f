"""``mha serve`` under concurrent clients: N clients posting at once vs the same N requests
one by one, against one in-process server (:mod:`mha.llm.server`) over SmolLM2-135M-Instruct.

Run (under the timing lock, see docs/kernel.md):
    flock -x /tmp/mha-bench.lock env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE \
        .venv/bin/python benchmarks/probes/serve_clients.py --clients 8 --new 32

Each request is a chat turn (prompts of different lengths) asking for ``--new`` tokens
(``/v1/completions`` with the chat template's token ids and no eos, so every request
generates exactly ``--new`` tokens). The two modes alternate ``--repeat`` times; printed: wall
seconds, generated tok/s and the engine's forwards per mode (medians), their ratio, and whether
every concurrent answer equals its one-by-one answer.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import threading
import time

from mha.llm.generation import chat_ids
from mha.llm.model import load
from mha.llm.server import make_server

QUESTIONS = ["What is the capital of France?", "Tell me a story about a dragon.",
             "Why is the sky blue?", "Write a poem about the sea.",
             "How do airplanes fly? Explain it to a child in a few sentences.",
             "List three fruits.", "What is 12 times 7?",
             "Give me advice for a job interview at a bank next week."]


def _post(port: int, body: dict) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    out = json.loads(conn.getresponse().read())
    conn.close()
    return out["choices"][0]["text"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--weights", default="bf16", choices=("fp32", "bf16", "int8"))
    a = ap.parse_args()
    loaded = load("fp32", "mha", a.weights)
    prompts = [chat_ids(loaded.tokenizer, [{"role": "user", "content":
                                            QUESTIONS[i % len(QUESTIONS)]}])[0].tolist()
               for i in range(a.clients)]  # (P,) each
    server = make_server(loaded.model, loaded.tokenizer, port=0, num_pages=256,
                         max_seqs=max(16, a.clients), threads=a.threads, eos_token_id=None)
    server.start()
    port = server.server_address[1]
    bodies = [{"prompt": p, "max_tokens": a.new} for p in prompts]
    _post(port, bodies[0])  # warm-up

    def one_by_one() -> list[str]:
        return [_post(port, b) for b in bodies]

    def concurrent() -> list[str]:
        out: list[str | None] = [None] * len(bodies)

        def client(i):
            out[i] = _post(port, bodies[i])

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(bodies))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out

    times: dict[str, list[float]] = {"one by one": [], "concurrent": []}
    forwards: dict[str, list[int]] = {"one by one": [], "concurrent": []}
    answers = {}
    for _ in range(a.repeat):
        for name, fn in (("one by one", one_by_one), ("concurrent", concurrent)):
            f0 = server.engine.stats["forwards"]
            t0 = time.perf_counter()
            answers[name] = fn()
            times[name].append(time.perf_counter() - t0)
            time.sleep(0.1)  # the engine's stats follow its last step
            forwards[name].append(server.engine.stats["forwards"] - f0)
    server.close()
    tokens = a.clients * a.new
    print(f"{a.clients} clients x {a.new} new tokens, weights {a.weights}, "
          f"{a.threads} threads, {a.repeat} repeats (medians)")
    rate = {}
    for name in times:
        t = statistics.median(times[name])
        rate[name] = tokens / t
        print(f"  {name:10s}: {t:7.2f} s  {rate[name]:7.1f} tok/s  "
              f"{statistics.median(forwards[name]):.0f} forwards  (runs: "
              f"{', '.join(f'{x:.2f}' for x in times[name])} s)")
    print(f"  concurrent / one by one: {rate['concurrent'] / rate['one by one']:.2f}x tok/s")
    print(f"  same answers: {answers['concurrent'] == answers['one by one']}")


if __name__ == "__main__":
    main()
