"""The engine simulator: a stand-in for an inference engine such as vLLM, for benchmarking a
KV cache server where no real engine can run (no GPU, no model weights). It is NOT an engine:
it runs no model and its answers are filler. What it does for real is the cache traffic:

- It speaks OpenAI's HTTP API (`/v1/models`, `/v1/chat/completions`, `/v1/completions`, with
  `stream: true` server-sent events and `stream_options.include_usage`), as vLLM does.
- It tokenizes each prompt with a Hugging Face tokenizer directory (`--model`; see
  make_tokenizer.py), the same one the bench loads, so both count the same tokens.
- It keeps a real paged KV cache (torch tensors, `--num-blocks` blocks of `--block-size`
  tokens) and moves it through an LMCache MP server with vLLM's own MP adapters (LMCache
  0.5.6's `LMCacheMPSchedulerAdapter` and `LMCacheMPWorkerAdapter`): a lookup per request, a
  retrieve of the hit prefix into fresh blocks, a store of the chunks it "computed".
- Its prefill time is proportional to the tokens the cache did not serve
  (`--prefill-us-per-token` per token, slept), then it streams `max_tokens` filler tokens at
  `--itl-ms` apart. Prefills run one at a time, in arrival order (one engine step loop);
  decoding overlaps.
- The KV it "computes" is a function of the token prefix (each block holds values derived
  from a rolling hash of every token up to its end), so a retrieved block is checked against
  what prefill would have written: `GET /sim/stats` counts blocks that came back wrong
  (`kv_mismatch_blocks`), with requests, prompt, cached and prefilled tokens. The OpenAI usage
  reports cached tokens as vLLM does (`usage.prompt_tokens_details.cached_tokens`).

Usage: python engine_simulator.py --lmcache-url tcp://127.0.0.1:5555 --model TOKENIZER_DIR
           [--port 8000] [--served-model-name NAME] [--prefill-us-per-token 20] [--itl-ms 2]
           [--num-blocks 4096] [--block-size 16] [--num-layers 4] [--num-kv-heads 2]
           [--head-dim 64] [--transfer-mode auto|engine_driven|lmcache_driven]
"""
import argparse
import json
import os
import queue
import signal
import sys
import threading
import time
import uuid
from concurrent.futures import Future
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

CHUNK = 256
TIMEOUT = 60.0
FILLER = " hi"


def wait_for(what, fn, timeout=TIMEOUT, pause=0.001):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = fn()
        if v is not None:
            return v
        time.sleep(pause)
    raise TimeoutError(what)


class Engine:
    """The KV side: one thread runs every prefill (lookup, retrieve, "compute", store)."""

    def __init__(self, args):
        import torch
        import zmq
        from lmcache.integration.vllm.vllm_multi_process_adapter import (
            LMCacheMPSchedulerAdapter, LMCacheMPWorkerAdapter, LoadStoreOp, ParallelStrategy)
        from transformers import AutoTokenizer

        self.torch, self.LoadStoreOp = torch, LoadStoreOp
        os.environ.setdefault("LMCACHE_MP_TRANSFER_MODE", args.transfer_mode)
        self.tokenizer = AutoTokenizer.from_pretrained(args.model)
        self.bs, self.nb = args.block_size, args.num_blocks
        self.prefill_s_per_token = args.prefill_us_per_token / 1e6
        ctx = zmq.Context()
        ps = ParallelStrategy(mla_only=False, vllm_world_size=1, vllm_worker_id=0, tp_size=1,
                              pp_size=1, n_servers=1)
        self.kv = {f"model.layers.{i}.self_attn.attn": torch.zeros(
            2, self.nb, self.bs, args.num_kv_heads, args.head_dim, dtype=torch.float16)
            for i in range(args.num_layers)}
        self.worker = LMCacheMPWorkerAdapter(args.lmcache_url, ctx, args.served_model_name,
                                             self.bs, ps, mq_timeout=TIMEOUT,
                                             heartbeat_interval=1.0)
        self.worker.register_kv_caches(self.kv)
        self.sched = LMCacheMPSchedulerAdapter([args.lmcache_url], ctx, args.served_model_name,
                                               self.bs, ps, mq_timeout=TIMEOUT,
                                               heartbeat_interval=1.0)
        self.free = list(range(self.nb))
        # Completions the worker adapter reported (it reports each once, whoever asks).
        self.stores_done, self.retrieves_done = set(), set()
        self.jobs = queue.Queue()
        self.stats_lock = threading.Lock()
        self.stats = dict(requests=0, prompt_tokens=0, cached_tokens=0, prefill_tokens=0,
                          stored_tokens=0, kv_mismatch_blocks=0, kv_checked_blocks=0)
        threading.Thread(target=self._loop, name="engine-step", daemon=True).start()

    def prompt_tokens(self, body, chat):
        if chat:
            text = self.tokenizer.apply_chat_template(body.get("messages", []), tokenize=False)
            return self.tokenizer.encode(text, add_special_tokens=False)
        prompt = body.get("prompt", "")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            return list(prompt)
        if isinstance(prompt, list):
            prompt = "".join(prompt)
        return self.tokenizer.encode(prompt, add_special_tokens=False)

    def prefill(self, tokens):
        """Queues a prefill; the future gives the tokens the cache served."""
        f = Future()
        self.jobs.put((tokens, f))
        return f

    def _block_values(self, tokens, upto):
        """Per block up to `upto` tokens: the (K, V) fill prefill writes, from a rolling hash
        of the prefix (fp16-exact: multiples of 1/8 below 256)."""
        values, h = [], 1469598103934665603
        for b in range(upto // self.bs):
            for t in tokens[b * self.bs:(b + 1) * self.bs]:
                h = ((h ^ t) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
            values.append(((h % 2039) / 8.0, ((h >> 20) % 2039) / 8.0))
        return values

    def _finished(self, engine_finished):
        """Polls the worker adapter, as vLLM's step does. A request id is passed as finished
        by the engine only once its store was submitted: the adapter reports a request that
        is finished and has no store pending as stored, once and for all."""
        stores, retrieves = self.worker.get_finished(engine_finished)
        self.stores_done |= stores or set()
        self.retrieves_done |= retrieves or set()

    def _wait_retrieve(self, rid):
        def done():
            self._finished(set())
            return True if rid in self.retrieves_done else None
        wait_for("retrieve", done)
        self.retrieves_done.discard(rid)

    def _wait_store(self, rid):
        def done():
            self._finished({rid})
            return True if rid in self.stores_done else None
        wait_for("store", done)
        self.stores_done.discard(rid)

    def _loop(self):
        while True:
            tokens, f = self.jobs.get()
            try:
                f.set_result(self._prefill(tokens))
            except Exception as e:  # noqa: BLE001 - the request gets the error
                f.set_exception(e)

    def _prefill(self, tokens):
        n = len(tokens)
        rid = f"sim-{uuid.uuid4().hex[:12]}"
        need = (n + self.bs - 1) // self.bs
        if need > len(self.free):
            raise RuntimeError(f"prompt of {n} tokens needs {need} blocks; "
                               f"the simulator has {len(self.free)} (--num-blocks)")
        blocks, self.free = self.free[:need], self.free[need:]
        try:
            self.sched.maybe_submit_lookup_request(rid, tokens)
            hit = wait_for("lookup", lambda: self.sched.check_lookup_result(rid))
            # At least the last token is computed (its logits start decoding), as vLLM does.
            load = min(hit, (n - 1) // CHUNK * CHUNK)
            values = self._block_values(tokens, max(load, n // CHUNK * CHUNK))
            if load:
                op = self.LoadStoreOp(token_ids=tokens, block_ids=[blocks[:load // self.bs]],
                                      start=0, end=load)
                self.worker.submit_retrieve_request(rid, op, self.worker.create_recorded_event())
                self._wait_retrieve(rid)
                wrong = 0
                for b in range(load // self.bs):
                    k, v = values[b]
                    for t in self.kv.values():
                        if not (bool((t[0, blocks[b]] == k).all())
                                and bool((t[1, blocks[b]] == v).all())):
                            wrong += 1
                            break
                with self.stats_lock:
                    self.stats["kv_mismatch_blocks"] += wrong
                    self.stats["kv_checked_blocks"] += load // self.bs
            # "Compute" the rest: the time a prefill of the missed tokens takes, and its KV.
            time.sleep((n - load) * self.prefill_s_per_token)
            end = n // CHUNK * CHUNK
            for b in range(load // self.bs, end // self.bs):
                k, v = values[b]
                for t in self.kv.values():
                    t[0, blocks[b]].fill_(k)
                    t[1, blocks[b]].fill_(v)
            if end > load:
                # As vLLM's connector: the blocks of [start, end) only.
                op = self.LoadStoreOp(token_ids=tokens,
                                      block_ids=[blocks[load // self.bs:end // self.bs]],
                                      start=load, end=end)
                self.worker.submit_store_request(rid, op, self.worker.create_recorded_event())
                self._wait_store(rid)
            self.sched.end_session(rid)
            with self.stats_lock:
                s = self.stats
                s["requests"] += 1
                s["prompt_tokens"] += n
                s["cached_tokens"] += load
                s["prefill_tokens"] += n - load
                s["stored_tokens"] += max(end - load, 0)
            return load
        finally:
            self.free.extend(blocks)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    engine = None
    args = None

    def log_message(self, *a):  # quiet: the bench owns the terminal
        pass

    def _json(self, code, obj):
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path in ("/health", "/healthz"):
            return self._json(200, {"status": "ok"})
        if self.path == "/v1/models":
            return self._json(200, {"object": "list", "data": [
                {"id": self.args.served_model_name, "object": "model", "owned_by": "simulator"}]})
        if self.path == "/sim/stats":
            with self.engine.stats_lock:
                return self._json(200, dict(self.engine.stats))
        return self._json(404, {"error": {"message": f"no route {self.path}"}})

    def _chunk(self, data):
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _event(self, obj):
        self._chunk(b"data: " + json.dumps(obj).encode() + b"\n\n")

    def do_POST(self):
        chat = self.path == "/v1/chat/completions"
        if not chat and self.path != "/v1/completions":
            return self._json(404, {"error": {"message": f"no route {self.path}"}})
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            tokens = self.engine.prompt_tokens(body, chat)
        except Exception as e:  # noqa: BLE001 - a client error, answered
            return self._json(400, {"error": {"message": f"bad request: {e}"}})
        max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
        try:
            cached = self.engine.prefill(tokens).result(timeout=600)
        except Exception as e:  # noqa: BLE001 - the engine's failure, answered
            return self._json(500, {"error": {"message": f"prefill failed: {e}"}})
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:16]}"
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        usage = {"prompt_tokens": len(tokens), "completion_tokens": max_tokens,
                 "total_tokens": len(tokens) + max_tokens,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        itl = self.args.itl_ms / 1000.0

        def choice(text, finish):
            if chat:
                return {"index": 0, "delta": {"content": text} if text else {},
                        "finish_reason": finish}
            return {"index": 0, "text": text, "finish_reason": finish}

        if not body.get("stream"):
            time.sleep(itl * max_tokens)
            text = FILLER * max_tokens
            msg = ({"index": 0, "message": {"role": "assistant", "content": text},
                    "finish_reason": "length"} if chat else
                   {"index": 0, "text": text, "finish_reason": "length"})
            return self._json(200, {"id": rid, "object": kind, "created": created,
                                    "model": self.args.served_model_name, "choices": [msg],
                                    "usage": usage})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        base = {"id": rid, "object": f"{kind}.chunk" if chat else kind, "created": created,
                "model": self.args.served_model_name}
        try:
            if chat:
                self._event({**base, "choices": [
                    {"index": 0, "delta": {"role": "assistant", "content": ""},
                     "finish_reason": None}]})
            for i in range(max_tokens):
                last = i == max_tokens - 1
                self._event({**base, "choices": [choice(FILLER, "length" if last else None)]})
                if not last:
                    time.sleep(itl)
            if (body.get("stream_options") or {}).get("include_usage"):
                self._event({**base, "choices": [], "usage": usage})
            self._chunk(b"data: [DONE]\n\n")
            self._chunk(b"")
        except (BrokenPipeError, ConnectionResetError):
            pass


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lmcache-url", required=True, help="the LMCache MP server (tcp://, grpc://)")
    ap.add_argument("--model", required=True, help="a Hugging Face tokenizer directory")
    ap.add_argument("--served-model-name", default=None,
                    help="model name in the API and at the cache server (default: --model)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--prefill-us-per-token", type=float, default=20.0)
    ap.add_argument("--itl-ms", type=float, default=2.0)
    ap.add_argument("--num-blocks", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--num-kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--transfer-mode", default="auto",
                    choices=["auto", "engine_driven", "lmcache_driven"])
    args = ap.parse_args()
    args.served_model_name = args.served_model_name or args.model
    Handler.engine = Engine(args)
    Handler.args = args
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    # SIGTERM ends the process at once: a normal exit would wait on the adapters' threads,
    # which retry forever once the cache server is gone (and it may be stopped first).
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    print(f"engine simulator (not an engine) serving {args.served_model_name} on "
          f"http://{args.host}:{server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
