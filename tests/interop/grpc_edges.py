"""LMCache's own gRPC client (GrpcMultiprocessClient, from LMCache 0.5.6) and raw gRPC calls
against `lmcache-rs server --transport grpc`:

- `concurrent URL SEQS`: once the bench's worker is registered (a lookup needs its layout),
  8 threads, each with its own client, look up the sequences LMCache's bench stored (the same
  keys at once) while the bench retrieves them again; every lookup must be a full hit, and its
  locks freed.
- `edges URL`: what a client can send that is wrong: a body that is not the method's
  protobuf (INVALID_ARGUMENT, naming the message), a method that does not exist and one
  lmcache-rs does not serve (UNIMPLEMENTED), a key whose range lies outside its tokens (the
  operation's typed failure: zero chunks); after each, the server still answers, and the
  management calls answer as over ZMQ.

- `stream URL`: subscribes to the KV event stream of a worker that never registers, reads its
  first batch, says so, then reads until the server ends the stream (a server stopping must
  end open streams, not wait on them) and says how long that took.

Usage: python grpc_edges.py concurrent grpc://127.0.0.1:PORT SEQS
       python grpc_edges.py edges grpc://127.0.0.1:PORT
       python grpc_edges.py stream grpc://127.0.0.1:PORT
"""
import sys
import threading
import time
import uuid

import grpc
from lmcache.cli.commands.bench.server_bench.helpers import _build_token_ids, _make_key
from lmcache.v1.multiprocess.transport.factory import RequestClientFactory
from lmcache.v1.multiprocess.transport.grpc_impl.client import GrpcMultiprocessClient

TIMEOUT = 30.0
CHUNK = 256
TOKENS = 512


def call(fut):
    return fut.result(timeout=TIMEOUT)


def wait_count(client, request_id):
    # wait_prefetch_status blocks on the server until the lookup settles (or the timeout).
    for _ in range(100):
        n = call(client.wait_prefetch_status(request_id, 1.0))
        if n is not None:
            return n
    raise TimeoutError(request_id)


def wait_registered(url):
    """Until the bench's worker is registered (a lookup needs its layout): seq 0 hits."""
    client = RequestClientFactory.create(url)
    for i in range(1200):
        rid = f"probe-{i}"
        key = _make_key(_build_token_ids(0, TOKENS), rid)
        call(client.lookup(key, 1))
        n = wait_count(client, rid)
        call(client.free_lookup_locks(key, 1))
        call(client.end_session(rid))
        if n == TOKENS // CHUNK:
            client.close()
            return
        time.sleep(0.1)
    raise TimeoutError("the bench never registered")


def concurrent(url, seqs):
    errors = []
    hits = []
    wait_registered(url)

    def worker(t):
        client = RequestClientFactory.create(url)
        assert isinstance(client, GrpcMultiprocessClient), type(client)
        try:
            for rnd in range(3):
                for seq in range(seqs):
                    rid = f"t{t}-r{rnd}-s{seq}-{uuid.uuid4().hex[:6]}"
                    key = _make_key(_build_token_ids(seq, TOKENS), rid)
                    call(client.lookup(key, 1))
                    n = wait_count(client, rid)
                    if n != TOKENS // CHUNK:
                        errors.append(f"{rid}: {n} chunks hit, want {TOKENS // CHUNK}")
                    hits.append(n)
                    call(client.free_lookup_locks(key, 1))
                    call(client.end_session(rid))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"thread {t}: {e!r}")
        finally:
            client.close()

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        print("\n".join(errors[:20]))
        sys.exit(1)
    print(f"grpc concurrent: {len(hits)} lookups from 8 clients, all full hits")


def edges(url):
    target = url.removeprefix("grpc://")
    channel = grpc.insecure_channel(target)
    raw = lambda path: channel.unary_unary(path)  # noqa: E731 - bytes in, bytes out

    def status_of(path, body):
        try:
            raw(path)(body, timeout=TIMEOUT)
        except grpc.RpcError as e:
            return e.code(), e.details()
        return grpc.StatusCode.OK, ""

    # Not a LookupRequest: field 1 (key) as a varint instead of a message.
    code, details = status_of("/lmcache.mp.LookupService/Lookup", b"\x08\x01")
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "LookupRequest" in details, (code, details)
    # Truncated protobuf.
    code, details = status_of("/lmcache.mp.LMCacheDrivenService/Store", b"\x0a\xff\x01")
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "StoreRequest" in details, (code, details)
    code, _ = status_of("/lmcache.mp.LookupService/Nope", b"")
    assert code == grpc.StatusCode.UNIMPLEMENTED, code
    code, details = status_of("/lmcache.mp.QStoreService/StoreQ", b"")
    assert code == grpc.StatusCode.UNIMPLEMENTED and "store_q" in details, (code, details)

    client = RequestClientFactory.create(url)
    assert isinstance(client, GrpcMultiprocessClient), type(client)
    # A range beyond the tokens: refused by the same decoder as over ZMQ, answered with the
    # typed failure (no chunks), never an exception.
    key = _make_key(_build_token_ids(7, TOKENS), "bad-range", start=0, end=TOKENS + 100)
    assert call(client.lookup(key, 1)) is None
    assert call(client.query_prefetch_status("bad-range")) == 0
    # A store for a worker that never registered: the typed failure.
    good = _make_key(_build_token_ids(7, TOKENS), "unregistered", worker_id=0)
    handle, ok = call(client.store(good, 424242, [[0, 1]], b""))
    assert (handle, ok) == (b"", False), (handle, ok)
    # Management, as over ZMQ.
    assert call(client.get_chunk_size()) == CHUNK
    assert call(client.noop()) == "OK"
    assert call(client.ping(None)) is True
    assert "kv_event_stream" in call(client.get_experimental())
    resp = call(client.server_module_call(
        __import__("lmcache.v1.multiprocess.protocols.server_module", fromlist=["x"])
        .ServerModuleCallRequest(method="x.echo", payload=b"hi")))
    assert resp.success is False and "not supported" in resp.error, resp
    handshake = call(client.cb_protocol_handshake(1))
    assert handshake == (0, False), handshake
    client.close()
    print("grpc edges: bad protobuf, unknown and unserved methods, bad range, unregistered "
          "worker, management calls: ok")


def stream(url):
    client = RequestClientFactory.create(url)
    batches = client.subscribe_kv_events(77, "test-model", 0, 64)
    first = next(batches)
    assert first.enabled and first.events == [], first
    print("stream: first batch", flush=True)
    t0 = time.monotonic()
    n = 0
    try:
        for _ in batches:
            n += 1
    except ConnectionError:
        pass
    print(f"stream: ended by the server after {time.monotonic() - t0:.1f} s, {n} more batches",
          flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "stream":
        stream(sys.argv[2])
    elif sys.argv[1] == "concurrent":
        concurrent(sys.argv[2], int(sys.argv[3]))
    else:
        edges(sys.argv[2])
