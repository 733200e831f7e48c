//! `--transport grpc`: LMCache 0.5.6's gRPC services (package `lmcache.mp`) on the server's
//! host and port, for LMCache's `GrpcMultiprocessClient` (a `grpc://host:port` URL).
//!
//! Every method path is served by one tower service: the request body is decoded into the
//! msgpack parameters the ZMQ client would have sent ([`grpc::decode_request`]), handled by
//! [`handlers::answer`] exactly as a ZMQ frame is, and the reply value written as the method's
//! response message ([`grpc::encode_response`]). Messages pass through tonic as raw bytes
//! ([`RawCodec`]), so the protobuf work happens once, in `lmcache-protocol`.
//!
//! Lanes are the ZMQ transport's: cheap operations run on the async thread that received
//! them, lookups and management on a shared pool of `--max-cpu-workers` threads, transfers
//! on `--max-gpu-workers` threads where one client (its `lmcache-client-id-bin` metadata, else
//! its address) always lands on the same thread, so its transfers stay in order.
//! `--grpc-server-workers` sizes the async runtime that holds the connections.
//!
//! `SubscribeKvEvents` is a server stream: one batch at the start, then one whenever there
//! are events (or records were lost); HTTP/2 flow control stands in for the ZMQ stream's
//! credits. A new subscription of the same worker ends the old one, and a worker whose
//! registration goes away has its stream ended, as over ZMQ.
//!
//! Refusals: a body that is not its method's protobuf is `INVALID_ARGUMENT`, an operation
//! lmcache-rs does not serve `UNIMPLEMENTED` (as LMCache answers a method with no handler);
//! both are logged and counted. Anything the handlers refuse gets the operation's typed
//! failure reply, as over ZMQ.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::TcpListener;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::thread::JoinHandle;
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes};
use futures_util::Stream;
use lmcache_protocol::frame::{Header, Request};
use lmcache_protocol::grpc::{self, Method};
use lmcache_protocol::{Op, ProtocolError};
use parking_lot::Mutex;
use rmpv::Value;
use tonic::Status;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::server::{Grpc, ServerStreamingService, UnaryService};
use tonic::transport::server::{TcpConnectInfo, TcpIncoming};

use super::TransportError;
use super::io;
use super::lanes::Lanes;
use super::zmq::{DRAIN_DEADLINE, parse_subscription};
use crate::handlers::{self, Lane};
use crate::state::ServerState;

/// LMCache's default `--grpc-server-workers`.
pub const DEFAULT_SERVER_WORKERS: usize = 32;

/// How often an idle event stream looks for new events (the ZMQ stream's pace).
const STREAM_POLL: Duration = Duration::from_millis(5);

/// A bound gRPC listener, ready to serve.
#[derive(Debug)]
pub struct GrpcTransport {
    listener: TcpListener,
    endpoint: String,
    server_workers: usize,
}

impl GrpcTransport {
    /// Binds `host:port` (`localhost` is 127.0.0.1; `grpc://host:port` in `host` is taken
    /// whole; port 0 picks a free port). A ZMQ endpoint (`tcp://`, `ipc://`) is refused by
    /// name: gRPC serves TCP only. `inherited` (a port handed over) is served on when it is
    /// bound at that address.
    pub fn bind(
        host: &str,
        port: u16,
        server_workers: usize,
        inherited: Option<TcpListener>,
    ) -> Result<Self, TransportError> {
        let target = if let Some(whole) = host.strip_prefix("grpc://") {
            whole.to_owned()
        } else if let Some((scheme, _)) = host.split_once("://") {
            return Err(io(format!("--host {host}"))(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("--transport grpc binds a host and --port, not a {scheme}:// endpoint"),
            )));
        } else {
            let h = if host == "localhost" { "127.0.0.1" } else { host };
            if h.contains(':') && !h.starts_with('[') {
                format!("[{h}]:{port}")
            } else {
                format!("{h}:{port}")
            }
        };
        let listener = match crate::handover::take_if_at(inherited, &target) {
            Some(l) => l,
            None => TcpListener::bind(target.as_str()).map_err(io(format!("binding {target}")))?,
        };
        listener.set_nonblocking(true).map_err(io("setting the listener non-blocking"))?;
        let addr = listener.local_addr().map_err(io("reading the bound address"))?;
        Ok(Self { listener, endpoint: format!("grpc://{addr}"), server_workers })
    }

    /// A duplicate of the listening socket (to hand over in a hot upgrade).
    pub fn listener_clone(&self) -> std::io::Result<TcpListener> {
        self.listener.try_clone()
    }

    /// The endpoint bound, as LMCache's clients name it (`grpc://127.0.0.1:5555`).
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Serves until `stop` is set, then stops accepting, lets requests in flight finish (up
    /// to the ZMQ transport's drain deadline), ends the event streams and joins the workers.
    pub fn serve(
        self,
        state: Arc<ServerState>,
        stop: Arc<AtomicBool>,
    ) -> Result<(), TransportError> {
        let (pools, workers) = start_lanes(&state)?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(self.server_workers.max(1))
            .thread_name("grpc-server")
            .enable_all()
            .build()
            .map_err(io("starting its runtime"))?;
        let inner = Arc::new(Inner {
            state,
            pools,
            next_uid: AtomicU64::new(0),
            streams: Mutex::new(HashMap::new()),
            next_stream: AtomicU64::new(0),
            stop: Arc::clone(&stop),
        });
        let service = GrpcService { inner: Arc::clone(&inner) };
        let listener = self.listener;
        let result = runtime.block_on(async move {
            let listener =
                tokio::net::TcpListener::from_std(listener).map_err(io("adopting the listener"))?;
            let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
            let stopped = {
                let stop = Arc::clone(&stop);
                async move {
                    while !stop.load(Ordering::Relaxed) {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            };
            let server = tonic::transport::Server::builder()
                .serve_with_incoming_shutdown(service, incoming, stopped);
            let deadline = async {
                while !stop.load(Ordering::Relaxed) {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                tokio::time::sleep(DRAIN_DEADLINE).await;
            };
            tokio::select! {
                r = server => r.map_err(|e| TransportError::Grpc(e.to_string())),
                () = deadline => {
                    tracing::warn!("gRPC requests still in flight after the drain deadline");
                    Ok(())
                }
            }
        });
        runtime.shutdown_timeout(Duration::from_secs(1));
        // The runtime's tasks held the other handles: the last one closes the worker queues.
        drop(inner);
        for w in workers {
            if w.join().is_err() {
                tracing::error!("a gRPC worker thread panicked");
            }
        }
        result
    }
}

/// Messages through tonic as they are: the protobuf work is `lmcache-protocol`'s.
#[derive(Debug, Clone, Copy, Default)]
struct RawCodec;

impl Codec for RawCodec {
    type Encode = Bytes;
    type Decode = Bytes;
    type Encoder = RawCodec;
    type Decoder = RawCodec;

    fn encoder(&mut self) -> Self::Encoder {
        RawCodec
    }

    fn decoder(&mut self) -> Self::Decoder {
        RawCodec
    }
}

impl Encoder for RawCodec {
    type Item = Bytes;
    type Error = Status;

    fn encode(&mut self, item: Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put(item);
        Ok(())
    }
}

impl Decoder for RawCodec {
    type Item = Bytes;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Bytes>, Status> {
        Ok(Some(src.copy_to_bytes(src.remaining())))
    }
}

/// A request's reply: its header and value (`None`: void).
type Answer = (Header, Option<Value>);

/// One request for a worker thread, and where its answer goes.
struct Job {
    req: Request,
    reply: tokio::sync::oneshot::Sender<Answer>,
}

fn start_lanes(
    state: &Arc<ServerState>,
) -> Result<(Lanes<Job>, Vec<JoinHandle<()>>), TransportError> {
    let c = &state.config;
    Lanes::start("grpc", c.max_cpu_workers, c.max_gpu_workers, || {
        let state = Arc::clone(state);
        // A client that went away does not want its answer; the work is done anyway.
        Ok(move |job: Job| drop(job.reply.send(handlers::answer(&state, job.req))))
    })
}

/// What every call of the service shares.
struct Inner {
    state: Arc<ServerState>,
    pools: Lanes<Job>,
    next_uid: AtomicU64,
    /// The live event stream of each worker (instance id → stream number).
    streams: Mutex<HashMap<u64, u64>>,
    next_stream: AtomicU64,
    stop: Arc<AtomicBool>,
}

impl Inner {
    /// Runs `req` on its lane and waits for its answer.
    async fn run(&self, req: Request) -> Result<Answer, Status> {
        let queue = match handlers::lane(req.op) {
            Lane::Inline => return Ok(handlers::answer(&self.state, req)),
            Lane::Normal => self.pools.normal(),
            Lane::Transfer => self.pools.transfer_for(&req.header.identity),
        };
        let (tx, rx) = tokio::sync::oneshot::channel();
        queue
            .send(Job { req, reply: tx })
            .map_err(|_| Status::unavailable("lmcache-rs is shutting down"))?;
        rx.await.map_err(|_| Status::internal("the worker thread dropped the request"))
    }

    /// A request refused before it reached a handler: logged, counted, and its status.
    fn refuse(&self, op: Op, e: &ProtocolError) -> Status {
        tracing::warn!(op = op.name(), error = %e, transport = "grpc", "refused request");
        self.state.metrics.request(op.name());
        self.state.metrics.error(op.name(), e.kind());
        match e {
            ProtocolError::UnsupportedOp(_) => Status::unimplemented(e.to_string()),
            _ => Status::invalid_argument(e.to_string()),
        }
    }

    fn header(&self, identity: Vec<u8>) -> Header {
        Header {
            identity,
            uid_frame: Vec::new(),
            op_frame: Vec::new(),
            uid: Some(self.next_uid.fetch_add(1, Ordering::Relaxed)),
        }
    }
}

/// Every gRPC method path, on one service.
#[derive(Clone)]
struct GrpcService {
    inner: Arc<Inner>,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl tower_service::Service<http::Request<tonic::body::Body>> for GrpcService {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        let inner = Arc::clone(&self.inner);
        Box::pin(async move {
            let Some(method) = grpc::method(req.uri().path()) else {
                let path = req.uri().path().to_owned();
                tracing::warn!(path, "gRPC call of an unknown method");
                inner.state.metrics.error("unknown", "unknown_op");
                return Ok(Status::unimplemented(format!("no method {path}")).into_http());
            };
            // The client's identity pins its transfers to one thread.
            let identity = match req.headers().get(grpc::CLIENT_ID_METADATA) {
                Some(id) => id.as_bytes().to_vec(),
                None => req
                    .extensions()
                    .get::<TcpConnectInfo>()
                    .and_then(TcpConnectInfo::remote_addr)
                    .map(|a| a.to_string().into_bytes())
                    .unwrap_or_default(),
            };
            let mut grpc = Grpc::new(RawCodec)
                .max_decoding_message_size(usize::MAX)
                .max_encoding_message_size(usize::MAX);
            Ok(if method.streaming() {
                grpc.server_streaming(Subscribe { inner, identity }, req).await
            } else {
                grpc.unary(Call { inner, method, identity }, req).await
            })
        })
    }
}

/// One unary call.
struct Call {
    inner: Arc<Inner>,
    method: Method,
    identity: Vec<u8>,
}

impl UnaryService<Bytes> for Call {
    type Response = Bytes;
    type Future = BoxFuture<Result<tonic::Response<Bytes>, Status>>;

    fn call(&mut self, request: tonic::Request<Bytes>) -> Self::Future {
        let (inner, op) = (Arc::clone(&self.inner), self.method.op);
        let identity = std::mem::take(&mut self.identity);
        Box::pin(async move {
            let params =
                grpc::decode_request(op, request.get_ref()).map_err(|e| inner.refuse(op, &e))?;
            let req = Request { header: inner.header(identity), op, params };
            let (_, value) = inner.run(req).await?;
            let body = grpc::encode_response(op, value.as_ref()).map_err(|e| {
                tracing::error!(op = op.name(), error = %e, "reply has no gRPC response shape");
                inner.state.metrics.error(op.name(), e.kind());
                Status::internal(e.to_string())
            })?;
            Ok(tonic::Response::new(Bytes::from(body)))
        })
    }
}

/// A `SubscribeKvEvents` call.
struct Subscribe {
    inner: Arc<Inner>,
    identity: Vec<u8>,
}

type BatchStream = Pin<Box<dyn Stream<Item = Result<Bytes, Status>> + Send>>;

impl ServerStreamingService<Bytes> for Subscribe {
    type Response = Bytes;
    type ResponseStream = BatchStream;
    type Future = BoxFuture<Result<tonic::Response<BatchStream>, Status>>;

    fn call(&mut self, request: tonic::Request<Bytes>) -> Self::Future {
        let inner = Arc::clone(&self.inner);
        let identity = std::mem::take(&mut self.identity);
        Box::pin(async move {
            let op = Op::SubscribeKvEvents;
            let params =
                grpc::decode_request(op, request.get_ref()).map_err(|e| inner.refuse(op, &e))?;
            if !inner.state.channels.kv_events.enabled() {
                let e = ProtocolError::UnsupportedOp("subscribe_kv_events (--kv-event-log-size 0)");
                return Err(inner.refuse(op, &e));
            }
            let req = Request { header: inner.header(identity), op, params };
            let (instance, model, cursor, max_events) =
                parse_subscription(&req).map_err(|e| inner.refuse(op, &e))?;
            inner.state.metrics.request(op.name());
            // One subscription per worker: a new one ends the old.
            let number = inner.next_stream.fetch_add(1, Ordering::Relaxed);
            inner.streams.lock().insert(instance, number);
            let (tx, rx) = tokio::sync::mpsc::channel(1);
            let sub = Subscription { inner, instance, number, model, cursor, max_events };
            tokio::spawn(sub.pump(tx));
            let batches = futures_util::stream::unfold(rx, |mut rx| async move {
                rx.recv().await.map(|batch| (batch, rx))
            });
            Ok(tonic::Response::new(Box::pin(batches) as BatchStream))
        })
    }
}

/// One live event stream.
struct Subscription {
    inner: Arc<Inner>,
    instance: u64,
    number: u64,
    model: String,
    cursor: u64,
    max_events: usize,
}

impl Subscription {
    /// Whether the stream must end: the server stops, or a newer subscription of the same
    /// worker replaced it.
    fn over(&self) -> bool {
        self.inner.stop.load(Ordering::Relaxed)
            || self.inner.streams.lock().get(&self.instance) != Some(&self.number)
    }

    /// Sends a batch whenever one is owed, until the client goes, the worker departs, or
    /// the stream is [`over`](Self::over).
    async fn pump(mut self, tx: tokio::sync::mpsc::Sender<Result<Bytes, Status>>) {
        let (mut first, mut was_registered) = (true, false);
        loop {
            if tx.is_closed() || self.over() {
                break;
            }
            let registered = self.inner.state.registry.has_instance(self.instance);
            if was_registered && !registered {
                tracing::info!(
                    instance_id = self.instance,
                    "ending the gRPC KV event stream of a departed worker"
                );
                break;
            }
            was_registered |= registered;
            let batch =
                self.inner.state.channels.kv_events.read(&self.model, self.cursor, self.max_events);
            self.cursor = batch.next_cursor;
            // Nothing owed: no news since the last batch.
            if !first && batch.events.is_empty() && !batch.lost && batch.enabled {
                tokio::time::sleep(STREAM_POLL).await;
                continue;
            }
            first = false;
            let item = grpc::encode_event_batch(&batch.to_value()).map(Bytes::from).map_err(|e| {
                tracing::error!(error = %e, "KV event batch has no gRPC shape");
                Status::internal(e.to_string())
            });
            let end = item.is_err() || !batch.enabled;
            // Wait for the client to take it (HTTP/2 flow control), looking up now and then.
            let permit = loop {
                match tokio::time::timeout(Duration::from_millis(100), tx.reserve()).await {
                    Ok(Ok(permit)) => break Some(permit),
                    Ok(Err(_)) => break None,
                    Err(_) if self.over() => break None,
                    Err(_) => {}
                }
            };
            let Some(permit) = permit else { break };
            permit.send(item);
            if end {
                break;
            }
        }
        let mut streams = self.inner.streams.lock();
        if streams.get(&self.instance) == Some(&self.number) {
            streams.remove(&self.instance);
        }
    }
}
