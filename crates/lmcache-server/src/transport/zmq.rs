//! The ZMQ side: one thread owns the ROUTER socket and never runs handler logic beyond the
//! cheap inline operations; lookups and management requests go to a shared pool, transfers to
//! a pool where a client identity always lands on the same thread (its transfers stay in
//! order). Workers send replies back over an inproc PUSH/PULL pair that the socket thread
//! polls beside the ROUTER, so a long copy never blocks a lookup.
//!
//! Shutdown: once the stop flag is set the socket thread stops reading requests, forwards the
//! replies of requests already in flight (up to a deadline), then closes the worker queues and
//! joins the workers.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::time::{Duration, Instant};

use lmcache_protocol::frame::{self, Control, Header, Incoming, Reply, Request};
use lmcache_protocol::{Op, ProtocolError};

use super::TransportError;
use super::lanes::Lanes;
use crate::handlers::{self, Lane};
use crate::state::ServerState;

/// One `subscribe_kv_events` stream: a batch goes out per credit (one at the start, one
/// more per `ack`), when there is something new or the subscriber lost records.
#[derive(Debug)]
struct Stream {
    header: Header,
    instance_id: u64,
    model: String,
    cursor: u64,
    max_events: usize,
    credits: u32,
    first: bool,
    /// The worker was seen registered while subscribed: once its registration is reaped or
    /// removed, the stream ends too.
    was_registered: bool,
}

pub(super) fn parse_subscription(
    req: &Request,
) -> Result<(u64, String, u64, usize), ProtocolError> {
    let s = lmcache_protocol::request::SubscribeKvEvents::decode(&req.params)?;
    if !(1..=1024).contains(&s.max_events) {
        return Err(ProtocolError::OutOfRange {
            field: "max_events".into(),
            reason: format!("{} is outside 1..=1024", s.max_events),
        });
    }
    Ok((s.instance_id, s.model_name, s.cursor, s.max_events as usize))
}

/// The worker lanes, and the count of requests handed to them and not yet answered.
struct Pools {
    lanes: Lanes<Request>,
    in_flight: AtomicU64,
}

impl Pools {
    fn submit(&self, queue: &Sender<Request>, req: Request) {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        if queue.send(req).is_err() {
            self.in_flight.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// How long shutdown waits for in-flight replies.
pub(super) const DRAIN_DEADLINE: Duration = Duration::from_secs(10);
/// How long the socket's close may wait to send the replies of the drain.
const REPLY_LINGER_MS: i32 = 2000;

fn zerr(op: &'static str) -> impl FnOnce(zmq::Error) -> TransportError {
    move |source| TransportError::Zmq { op, source }
}

static NEXT_ID: AtomicU64 = AtomicU64::new(0);

/// A bound ROUTER socket, ready to serve.
pub struct ZmqTransport {
    ctx: zmq::Context,
    router: zmq::Socket,
    replies: zmq::Socket,
    reply_endpoint: String,
    endpoint: String,
}

impl std::fmt::Debug for ZmqTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZmqTransport").field("endpoint", &self.endpoint).finish()
    }
}

impl ZmqTransport {
    /// Binds the ROUTER to `endpoint` (`tcp://` or `ipc://`), on `on` when given (a listening
    /// socket this process holds, for a port handover) instead of a socket of ZMQ's own.
    pub fn bind(
        endpoint: &str,
        on: Option<&std::net::TcpListener>,
    ) -> Result<Self, TransportError> {
        let ctx = zmq::Context::new();
        let mut router = ctx.socket(zmq::ROUTER).map_err(zerr("socket"))?;
        router.set_router_mandatory(true).map_err(zerr("setsockopt ROUTER_MANDATORY"))?;
        router.set_linger(0).map_err(zerr("setsockopt LINGER"))?;
        router.set_rcvhwm(0).map_err(zerr("setsockopt RCVHWM"))?;
        router.set_sndhwm(0).map_err(zerr("setsockopt SNDHWM"))?;
        match on {
            Some(listener) => crate::fd_passing::bind_zmq_on(&mut router, endpoint, listener),
            None => router.bind(endpoint),
        }
        .map_err(zerr("bind"))?;
        let bound = router
            .get_last_endpoint()
            .map_err(zerr("getsockopt LAST_ENDPOINT"))?
            .unwrap_or_else(|_| endpoint.to_owned());
        let replies = ctx.socket(zmq::PULL).map_err(zerr("socket"))?;
        let reply_endpoint = format!(
            "inproc://lmcache-rs-replies-{}-{}",
            std::process::id(),
            NEXT_ID.fetch_add(1, Ordering::Relaxed)
        );
        replies.bind(&reply_endpoint).map_err(zerr("bind inproc"))?;
        Ok(Self { ctx, router, replies, reply_endpoint, endpoint: bound })
    }

    /// The endpoint actually bound (with the port chosen, for port 0).
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Serves until `stop` is set. Runs on the calling thread.
    pub fn serve(
        self,
        state: Arc<ServerState>,
        stop: Arc<AtomicBool>,
    ) -> Result<(), TransportError> {
        let c = &state.config;
        let (lanes, workers) =
            Lanes::start("mp", c.max_cpu_workers, c.max_gpu_workers, || self.worker(&state))?;
        let pools = Pools { lanes, in_flight: AtomicU64::new(0) };
        let in_flight = &pools.in_flight;
        let mut stopping: Option<Instant> = None;
        let mut streams: Vec<Stream> = Vec::new();
        loop {
            let mut items =
                [self.router.as_poll_item(zmq::POLLIN), self.replies.as_poll_item(zmq::POLLIN)];
            // With subscribers, wake often enough to deliver new events promptly.
            let timeout = if streams.is_empty() { 50 } else { 5 };
            zmq::poll(&mut items, timeout).map_err(zerr("poll"))?;
            let (requests_ready, replies_ready) = (items[0].is_readable(), items[1].is_readable());
            if replies_ready {
                while let Ok(frames) = self.replies.recv_multipart(zmq::DONTWAIT) {
                    in_flight.fetch_sub(1, Ordering::Relaxed);
                    self.send(frames);
                }
            }
            if stop.load(Ordering::Relaxed) && stopping.is_none() {
                tracing::info!(in_flight = in_flight.load(Ordering::Relaxed), "transport draining");
                stopping = Some(Instant::now());
            }
            if let Some(since) = stopping {
                if in_flight.load(Ordering::Relaxed) == 0 || since.elapsed() > DRAIN_DEADLINE {
                    // The last replies may still be queued for the I/O thread: closing with
                    // no linger would drop them, and their clients would wait out their
                    // timeouts (a hot upgrade's in-flight store). A bounded linger sends them.
                    if let Err(e) = self.router.set_linger(REPLY_LINGER_MS) {
                        tracing::warn!(error = %e, "setsockopt LINGER at shutdown");
                    }
                    break;
                }
                continue;
            }
            // The socket thread must outlive any bug in the code it runs: a panic while
            // streaming ends the streams (each subscriber sees its end-of-stream) and is
            // counted; one while reading a message is counted, and the next message is read.
            if let Err(p) = catch_unwind(AssertUnwindSafe(|| self.pump(&state, &mut streams))) {
                self.socket_thread_panic(&state, "subscribe_kv_events", p.as_ref());
                for s in streams.drain(..) {
                    self.end_stream(s.header);
                }
            }
            if !requests_ready {
                continue;
            }
            while let Ok(frames) = self.router.recv_multipart(zmq::DONTWAIT) {
                let step = catch_unwind(AssertUnwindSafe(|| {
                    self.dispatch_message(&state, frames, &mut streams, &pools)
                }));
                if let Err(p) = step {
                    self.socket_thread_panic(&state, "unknown", p.as_ref());
                }
            }
        }
        // End every stream: a reply without payload tells the subscriber it is over.
        for s in streams.drain(..) {
            self.end_stream(s.header);
        }
        drop(pools);
        for w in workers {
            if w.join().is_err() {
                tracing::error!("a worker thread panicked");
            }
        }
        Ok(())
    }

    fn socket_thread_panic(&self, state: &ServerState, op: &str, p: &(dyn std::any::Any + Send)) {
        let reason = lmcache_http::panic_message(p);
        tracing::error!(op, error = %reason, "socket thread caught a panic; serving on");
        state.metrics.handler_panics.inc();
        state.metrics.error(op, "panic");
    }

    /// Routes one received message: a stream control, a subscription, an inline request
    /// (answered here), or a request for a worker pool.
    fn dispatch_message(
        &self,
        state: &ServerState,
        frames: Vec<Vec<u8>>,
        streams: &mut Vec<Stream>,
        pools: &Pools,
    ) {
        match frame::parse(frames) {
            Ok(Incoming::Request(req)) if req.op == Op::SubscribeKvEvents => {
                self.subscribe(state, req, streams);
            }
            Ok(Incoming::Request(req)) => match handlers::lane(req.op) {
                Lane::Inline => {
                    let reply = handlers::handle(state, req);
                    self.send(reply.into_frames());
                }
                Lane::Normal => pools.submit(pools.lanes.normal(), req),
                Lane::Transfer => {
                    pools.submit(pools.lanes.transfer_for(&req.header.identity), req);
                }
            },
            Ok(Incoming::Control { identity, uid_frame, control }) => {
                let pos = streams
                    .iter()
                    .position(|s| s.header.identity == identity && s.header.uid_frame == uid_frame);
                match (pos, control) {
                    (Some(i), Control::Ack) => {
                        streams[i].credits = streams[i].credits.saturating_add(1);
                    }
                    (Some(i), Control::Cancel) => {
                        streams.swap_remove(i);
                    }
                    (None, _) => {}
                }
            }
            Err(failure) => {
                if let Some(reply) = handlers::handle_parse_failure(state, failure) {
                    self.send(reply.into_frames());
                }
            }
        }
    }

    fn subscribe(&self, state: &ServerState, req: Request, streams: &mut Vec<Stream>) {
        state.metrics.request(req.op.name());
        let parsed = parse_subscription(&req).and_then(|p| {
            if state.channels.kv_events.enabled() {
                Ok(p)
            } else {
                Err(ProtocolError::UnsupportedOp("subscribe_kv_events (--kv-event-log-size 0)"))
            }
        });
        match parsed {
            Ok((instance_id, model, cursor, max_events)) => {
                // One subscription per worker: a new one ends the old.
                if let Some(i) = streams.iter().position(|s| s.instance_id == instance_id) {
                    self.end_stream(streams.swap_remove(i).header);
                }
                streams.push(Stream {
                    header: req.header,
                    instance_id,
                    model,
                    cursor,
                    max_events,
                    credits: 1,
                    first: true,
                    was_registered: false,
                });
                self.pump(state, streams);
            }
            Err(e) => {
                tracing::warn!(op = "subscribe_kv_events", error = %e, "refused subscription");
                state.metrics.error("subscribe_kv_events", e.kind());
                self.end_stream(req.header);
            }
        }
    }

    /// Ends the streams of workers that are gone, then sends each stream with a credit the
    /// batch it is owed, if any.
    fn pump(&self, state: &ServerState, streams: &mut Vec<Stream>) {
        streams.retain_mut(|s| {
            let registered = state.registry.has_instance(s.instance_id);
            if s.was_registered && !registered {
                tracing::info!(
                    instance_id = s.instance_id,
                    "ending the KV event stream of a departed worker"
                );
                self.end_stream(s.header.clone());
                return false;
            }
            s.was_registered |= registered;
            true
        });
        for s in streams.iter_mut().filter(|s| s.credits > 0) {
            let batch = state.channels.kv_events.read(&s.model, s.cursor, s.max_events);
            s.cursor = batch.next_cursor;
            if s.first || !batch.events.is_empty() || batch.lost || !batch.enabled {
                s.first = false;
                s.credits -= 1;
                self.send(Reply::value(s.header.clone(), &batch.to_value()).into_frames());
            }
        }
    }

    /// Ends a stream (or refuses a subscription): a reply without payload.
    fn end_stream(&self, header: Header) {
        self.send(Reply::void(header).into_frames());
    }

    fn send(&self, frames: Vec<Vec<u8>>) {
        if let Err(e) = self.router.send_multipart(frames, 0) {
            // EHOSTUNREACH: the client went away; nothing to deliver to.
            tracing::debug!(error = %e, "reply not delivered");
        }
    }

    /// A worker thread's handler: it hands each reply to the socket thread over its own
    /// PUSH socket.
    fn worker(
        &self,
        state: &Arc<ServerState>,
    ) -> Result<impl FnMut(Request) + Send + 'static, TransportError> {
        let push = self.ctx.socket(zmq::PUSH).map_err(zerr("socket"))?;
        push.set_sndhwm(0).map_err(zerr("setsockopt SNDHWM"))?;
        push.connect(&self.reply_endpoint).map_err(zerr("connect inproc"))?;
        let state = Arc::clone(state);
        Ok(move |req: Request| {
            let reply = handlers::handle(&state, req);
            if let Err(e) = push.send_multipart(reply.into_frames(), 0) {
                tracing::error!(error = %e, "could not hand a reply to the socket thread");
            }
        })
    }
}
