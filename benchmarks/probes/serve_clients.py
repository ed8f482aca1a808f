"""``mha serve`` under concurrent clients: N clients posting at once vs the same N requests
one by one, against in-process servers (:mod:`mha.llm.server`) over SmolLM2-135M-Instruct, one
per ``--impl`` (transformers' LlamaForCausalLM with mha's paged attention, or mha.models.Llama),
in one process; then a decode step's time per token of each impl's Scheduler.

Run (under the timing lock, see docs/kernel.md):
    flock -x /tmp/mha-bench.lock env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE \
        .venv/bin/python benchmarks/probes/serve_clients.py --clients 8 --new 32 \
        --impl transformers mha --threads 1

Each request is a chat turn (prompts of different lengths) asking for ``--new`` tokens
(``/v1/completions`` with the chat template's token ids and no eos, so every request
generates exactly ``--new`` tokens). The impls and the two modes alternate ``--repeat`` times;
printed per impl: wall seconds, generated tok/s and the engine's forwards per mode (medians),
their ratio, and whether every concurrent answer equals its one-by-one answer (and the first
impl's answers). Then ``--decode-rounds`` rounds of one step of each impl's Scheduler in turn:
a prefill step (every prompt in one chunk), a decode step with every request decoding, and
one with a single request: the median CPU seconds of the calling thread per step, and per
token (``--repeat 0``: these only). ``--profile N``: torch's profiler over N decode steps of
each impl, the ops of most self CPU time. ``--weights`` is transformers' (mha.models.Llama
keeps fp32 weights: compare with ``--weights fp32`` for the same arithmetic).
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import threading
import time

import torch

from _timing import interleaved
from mha.llm.generation import chat_ids
from mha.llm.model import load
from mha.llm.native import load_native
from mha.llm.server import make_server
from mha.llm.serving import Scheduler

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


def _load(impl: str, weights: str):
    if impl == "mha":
        return load_native("fp32")
    return load("fp32", "mha", weights)


def _run_http(a, loaded: dict, prompts: list[list[int]]) -> dict:
    """``{impl: {mode: (seconds list, forwards list, answers)}}``, impls and modes
    alternating."""
    servers = {impl: make_server(lo.model, lo.tokenizer, port=0, num_pages=256,
                                 max_seqs=max(16, a.clients), threads=a.threads,
                                 eos_token_id=None) for impl, lo in loaded.items()}
    for srv in servers.values():
        srv.start()
    bodies = [{"prompt": p, "max_tokens": a.new} for p in prompts]
    for srv in servers.values():
        _post(srv.server_address[1], bodies[0])  # warm-up

    def one_by_one(port: int) -> list[str]:
        return [_post(port, b) for b in bodies]

    def concurrent(port: int) -> list[str]:
        out: list[str | None] = [None] * len(bodies)

        def client(i):
            out[i] = _post(port, bodies[i])

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(bodies))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out

    modes = {"one by one": one_by_one, "concurrent": concurrent}
    res = {impl: {m: ([], [], None) for m in modes} for impl in servers}
    for _ in range(a.repeat):
        for impl, srv in servers.items():
            for name, fn in modes.items():
                f0 = srv.engine.stats["forwards"]
                t0 = time.perf_counter()
                answers = fn(srv.server_address[1])
                secs = time.perf_counter() - t0
                time.sleep(0.1)  # the engine's stats follow its last step
                times, forwards, _ = res[impl][name]
                times.append(secs)
                forwards.append(srv.engine.stats["forwards"] - f0)
                res[impl][name] = (times, forwards, answers)
    for srv in servers.values():
        srv.close()
    return res


def _decode_steps(a, loaded: dict, prompts: list[list[int]], clients: int) -> dict:
    """Median CPU seconds (this thread's) of one Scheduler.step with ``clients`` requests all
    decoding, per impl, the impls' steps in turn."""
    scheds = {}
    for impl, lo in loaded.items():
        s = Scheduler(lo.model, num_pages=256, page_size=16, max_seqs=16, max_len=512,
                      prefill_chunk=512)
        for p in prompts[:clients]:
            s.add(p, 4 * a.decode_rounds + 16)
        s.step()  # every prompt in one chunk: each request decodes from here
        scheds[impl] = s
    return interleaved({impl: s.step for impl, s in scheds.items()}, a.decode_rounds,
                       inner=1, warmup=2, clock=time.thread_time)


def _prefill_steps(a, loaded: dict, prompts: list[list[int]]) -> dict:
    """Median CPU seconds (this thread's) of one Scheduler.step that prefills every prompt in
    one chunk each (requests of one new token, which finish in that step), per impl."""
    scheds = {impl: Scheduler(lo.model, num_pages=256, page_size=16, max_seqs=16, max_len=512,
                              prefill_chunk=512) for impl, lo in loaded.items()}

    def prefill(s: Scheduler):
        for p in prompts:
            s.add(p, 1)
        s.step()
        for rid in list(s.finished):
            s.take(rid)

    return interleaved({impl: (lambda s=s: prefill(s)) for impl, s in scheds.items()},
                       a.decode_rounds, inner=1, warmup=2, clock=time.thread_time)


def _profile(a, loaded: dict, prompts: list[list[int]]) -> None:
    """torch's profiler over ``--profile`` decode steps of each impl (every request decoding):
    the ops of most self CPU time, and the total."""
    from torch.profiler import ProfilerActivity, profile

    for impl, lo in loaded.items():
        s = Scheduler(lo.model, num_pages=256, page_size=16, max_seqs=16, max_len=512,
                      prefill_chunk=512)
        for p in prompts:
            s.add(p, a.profile + 8)
        for _ in range(3):
            s.step()  # the prefill, then two decode steps
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(a.profile):
                s.step()
        ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
        total = sum(e.self_cpu_time_total for e in ops)
        print(f"--impl {impl}: {a.profile} decode steps of {len(prompts)} requests, self CPU "
              f"{total / 1e6:.3f} s in all")
        for e in ops[:8]:
            print(f"  {e.key:28s} {e.self_cpu_time_total / 1e6:7.3f} s  "
                  f"{100 * e.self_cpu_time_total / total:5.1f} %  {e.count:6d} calls")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3, help="HTTP rounds (0: none)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--weights", default="bf16", choices=("fp32", "bf16", "int8"),
                    help="transformers' projections (mha.models.Llama: fp32 always)")
    ap.add_argument("--impl", nargs="+", default=["transformers"],
                    choices=("transformers", "mha"))
    ap.add_argument("--decode-rounds", type=int, default=20,
                    help="timed decode steps per impl (0: none)")
    ap.add_argument("--profile", type=int, default=0,
                    help="decode steps per impl under torch's profiler (0: none)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    loaded = {impl: _load(impl, a.weights) for impl in dict.fromkeys(a.impl)}
    tok = next(iter(loaded.values())).tokenizer
    prompts = [chat_ids(tok, [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}])[0]
               .tolist() for i in range(a.clients)]  # (P,) each
    res = _run_http(a, loaded, prompts) if a.repeat else {}
    tokens = a.clients * a.new
    print(f"{a.clients} clients x {a.new} new tokens, transformers' weights {a.weights}, "
          f"{a.threads} threads, {a.repeat} repeats (medians)" if res else
          f"transformers' weights {a.weights}, {a.threads} threads")
    first = None
    for impl, modes in res.items():
        print(f"--impl {impl}")
        rate = {}
        for name, (times, forwards, _) in modes.items():
            t = statistics.median(times)
            rate[name] = tokens / t
            print(f"  {name:10s}: {t:7.2f} s  {rate[name]:7.1f} tok/s  "
                  f"{statistics.median(forwards):.0f} forwards  (runs: "
                  f"{', '.join(f'{x:.2f}' for x in times)} s)")
        print(f"  concurrent / one by one: {rate['concurrent'] / rate['one by one']:.2f}x tok/s")
        answers = modes["concurrent"][2]
        print(f"  same answers: {answers == modes['one by one'][2]}"
              + ("" if first is None else f"; as --impl {first[0]}'s: {answers == first[1]}"))
        first = first or (impl, answers)
    if a.decode_rounds:
        step = _prefill_steps(a, loaded, prompts)
        P = sum(len(p) for p in prompts)
        print(f"prefill step, {a.clients} prompts of {P} tokens in all ({a.decode_rounds} "
              "rounds, thread CPU time, medians):")
        for impl, t in step.items():
            print(f"  --impl {impl:12s}: {t * 1e3:7.2f} ms/step  {P / t:6.0f} tok/s")
        for clients in sorted({a.clients, 1}, reverse=True):
            step = _decode_steps(a, loaded, prompts, clients)
            print(f"decode step, {clients} requests decoding ({a.decode_rounds} rounds, "
                  "thread CPU time, medians):")
            for impl, t in step.items():
                print(f"  --impl {impl:12s}: {t * 1e3:7.2f} ms/step  "
                      f"{t * 1e3 / clients:6.2f} ms/token")
    if a.profile:
        _profile(a, loaded, prompts)


if __name__ == "__main__":
    main()
