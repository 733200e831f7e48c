//! RESP on raw sockets for the bulk bytes of the redis adapter (single node, no TLS): `GET`
//! replies read from the socket straight into their destination, `SET`s written from the
//! blob's own memory. Each connection keeps a few commands ahead of its replies ([`WINDOW_BYTES`]).
//!
//! redis-rs builds every command in a buffer of its own (the blob copied in), encodes a
//! pipeline into another, and parses a bulk reply into a buffer it hands over as a `Vec`,
//! which the tier then copies into L1. Here a pipelined batch of `SET`s writes each blob's
//! header and payload (the L1 lease's memory) to the socket as they are, and a pipelined
//! batch of `GET`s is written at once and each
//! `$<len>\r\n` reply of the expected length is read with the blob header into a small buffer
//! and the payload into the caller's sink (an L1 write reservation): the bytes cross memory
//! once, socket to L1. A reply of another length is drained and is a miss; `$-1` is a miss;
//! an error reply fails that key. Any I/O or protocol error poisons the connection, which is
//! dropped (the next batch connects anew), and fails the keys not yet read.

use std::time::Duration;

use parking_lot::Mutex;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

use crate::adapter::{DirectHeader, DirectItem, DirectResult, Stored};
use crate::blob::Blob;
use crate::error::L2Error;

/// Bytes of the read buffer: replies' headers and small values come through it; payloads at
/// least this large are read around it, straight into the sink.
const READ_BUF: usize = 64 * 1024;

/// Value bytes a connection keeps requested ahead of the replies it has read (at least one
/// command), unless the adapter's `pipeline_depth` fixes a number of commands instead. A
/// batch's commands are not all written at once: redis-server executes every command it has
/// read and holds the replies in its output buffer until the socket takes them, so 32
/// pipelined `GET`s of 256 KiB are 8 MiB copied into that buffer and read back from DRAM, per
/// connection. With a value or two ahead the server's buffers stay in cache: on the two-core
/// host of BENCHMARKS.md, loads of 4 batches of 32 x 256 KiB went from 0.38-0.46 to 0.84-1.02
/// of `redis-benchmark -c 4 -P 32`'s `GET`s, stores from 0.82-0.93 to 1.05-1.14 of its `SET`s
/// (a 256 KiB blob with its header is just over 256 KiB, so one is ahead; one, two and three
/// measured the same). Small values get more commands ahead, up to [`MAX_WINDOW`].
pub(crate) const WINDOW_BYTES: usize = 512 * 1024;

/// Most commands ahead of the replies read.
pub(crate) const MAX_WINDOW: usize = 64;

/// Commands to keep ahead for values of `value_len` bytes: `fixed` if set, else by
/// [`WINDOW_BYTES`].
fn window(fixed: Option<usize>, value_len: usize) -> usize {
    match fixed {
        Some(d) => d.max(1),
        None => (WINDOW_BYTES / value_len.max(1)).clamp(1, MAX_WINDOW),
    }
}

/// How a connection authenticates and which database it uses.
#[derive(Debug, Clone)]
pub(crate) struct Login {
    pub(crate) addr: String,
    pub(crate) username: Option<String>,
    pub(crate) password: Option<String>,
    pub(crate) database: i64,
    pub(crate) connect_timeout: Duration,
}

/// A small pool of raw connections for direct `GET`s and `SET`s.
#[derive(Debug)]
pub(crate) struct DirectConns {
    login: Login,
    idle: Mutex<Vec<BufReader<TcpStream>>>,
    max_idle: usize,
    /// Commands kept ahead of the replies read, when fixed; else by [`WINDOW_BYTES`].
    depth: Option<usize>,
}

/// One RESP command as bytes: `*<n>\r\n` then `$<len>\r\n<arg>\r\n` per argument.
fn command(out: &mut Vec<u8>, args: &[&[u8]]) {
    out.extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
    command_tail(out, args);
}

/// Arguments of a command whose `*<n>` was written already.
fn command_tail(out: &mut Vec<u8>, args: &[&[u8]]) {
    for a in args {
        out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        out.extend_from_slice(a);
        out.extend_from_slice(b"\r\n");
    }
}

/// Writes `SET name blob NX [EX ttl]` for each item: the blob's header and payload go to the
/// socket from where they are, only the small framing passes through `head`.
async fn write_sets(
    w: &mut TcpStream,
    items: &[(String, &Blob)],
    ttl: Option<&str>,
    head: &mut Vec<u8>,
) -> Result<(), L2Error> {
    for (name, blob) in items {
        head.clear();
        let args = if ttl.is_some() { 6 } else { 4 };
        head.extend_from_slice(format!("*{args}\r\n$3\r\nSET\r\n").as_bytes());
        head.extend_from_slice(format!("${}\r\n", name.len()).as_bytes());
        head.extend_from_slice(name.as_bytes());
        head.extend_from_slice(format!("\r\n${}\r\n", blob.len()).as_bytes());
        head.extend_from_slice(blob.header());
        w.write_all(head).await?;
        w.write_all(&blob.payload).await?;
        head.clear();
        head.extend_from_slice(b"\r\n");
        command_tail(head, &[b"NX"]);
        if let Some(t) = ttl {
            command_tail(head, &[b"EX", t.as_bytes()]);
        }
        w.write_all(head).await?;
    }
    Ok(())
}

fn bad(what: impl Into<String>) -> L2Error {
    L2Error::transient(format!("redis reply: {}", what.into()))
}

/// A reply's first line, without its CRLF.
async fn line(r: &mut BufReader<TcpStream>) -> Result<Vec<u8>, L2Error> {
    let mut l = Vec::with_capacity(32);
    let n = r.read_until(b'\n', &mut l).await?;
    if n == 0 {
        return Err(L2Error::unavailable("redis closed the connection"));
    }
    if !l.ends_with(b"\r\n") || l.len() > 4096 {
        return Err(bad("a line without CRLF"));
    }
    l.truncate(l.len() - 2);
    Ok(l)
}

/// Reads a simple reply (`+OK`), failing on an error reply.
async fn expect_ok(r: &mut BufReader<TcpStream>) -> Result<(), L2Error> {
    let l = line(r).await?;
    match l.first() {
        Some(b'+') => Ok(()),
        Some(b'-') => Err(L2Error::unavailable(String::from_utf8_lossy(&l[1..]).into_owned())),
        _ => Err(bad(format!("expected +OK, got {:?}", String::from_utf8_lossy(&l)))),
    }
}

/// Reads `n` bytes and discards them (a value of a length nobody asked for).
async fn skip(r: &mut BufReader<TcpStream>, mut n: u64) -> Result<(), L2Error> {
    let mut sink = [0u8; 8192];
    while n > 0 {
        let take = n.min(sink.len() as u64) as usize;
        r.read_exact(&mut sink[..take]).await?;
        n -= take as u64;
    }
    Ok(())
}

impl DirectConns {
    pub(crate) fn new(login: Login, max_idle: usize, depth: Option<usize>) -> Self {
        Self { login, idle: Mutex::new(Vec::new()), max_idle: max_idle.max(1), depth }
    }

    async fn connect(&self) -> Result<BufReader<TcpStream>, L2Error> {
        let l = &self.login;
        let s = tokio::time::timeout(l.connect_timeout, TcpStream::connect(&l.addr))
            .await
            .map_err(|_| L2Error::unavailable(format!("{}: connect timed out", l.addr)))??;
        s.set_nodelay(true)?;
        let mut r = BufReader::with_capacity(READ_BUF, s);
        let mut hello = Vec::new();
        let mut replies = 0;
        if let Some(p) = &l.password {
            match &l.username {
                Some(u) => command(&mut hello, &[b"AUTH", u.as_bytes(), p.as_bytes()]),
                None => command(&mut hello, &[b"AUTH", p.as_bytes()]),
            }
            replies += 1;
        }
        if l.database != 0 {
            command(&mut hello, &[b"SELECT", l.database.to_string().as_bytes()]);
            replies += 1;
        }
        if replies > 0 {
            r.get_mut().write_all(&hello).await?;
            for _ in 0..replies {
                expect_ok(&mut r).await?;
            }
        }
        Ok(r)
    }

    /// A pooled connection, or a new one, before `deadline`.
    async fn conn(&self, deadline: tokio::time::Instant) -> Result<BufReader<TcpStream>, L2Error> {
        let pooled = self.idle.lock().pop();
        match pooled {
            Some(c) => Ok(c),
            None => match tokio::time::timeout_at(deadline, self.connect()).await {
                Ok(c) => c,
                Err(_) => Err(L2Error::unavailable("redis: connect over the batch's budget")),
            },
        }
    }

    fn give_back(&self, conn: BufReader<TcpStream>) {
        let mut idle = self.idle.lock();
        if idle.len() < self.max_idle {
            idle.push(conn);
        }
    }

    /// `SET name blob NX [EX ttl]` for each item, pipelined on one connection `window` ahead,
    /// within `budget`: the blob's header and payload go to the socket from where they are. `+OK` is
    /// written, nil is already present, an error reply fails that key; a broken connection
    /// fails the keys whose replies were not read.
    pub(crate) async fn store(
        &self,
        items: &[(String, &Blob)],
        ttl_seconds: Option<u64>,
        budget: Duration,
    ) -> Vec<Result<Stored, L2Error>> {
        let deadline = tokio::time::Instant::now() + budget;
        let fail_all = |e: &L2Error| {
            let msg = e.to_string();
            items.iter().map(|_| Err(L2Error::unavailable(msg.clone()))).collect()
        };
        let mut conn = match self.conn(deadline).await {
            Ok(c) => c,
            Err(e) => return fail_all(&e),
        };
        let ttl = ttl_seconds.map(|t| t.to_string());
        let mut out = Vec::with_capacity(items.len());
        let mut poisoned: Option<String> = None;
        let mut written = 0;
        let mut head = Vec::with_capacity(256);
        let largest = items.iter().map(|(_, b)| b.len()).max().unwrap_or(0);
        let ahead_by = window(self.depth, largest);
        for i in 0..items.len() {
            if let Some(msg) = &poisoned {
                out.push(Err(L2Error::transient(msg.clone())));
                continue;
            }
            // Keep `window` commands ahead of the replies read (see `WINDOW_BYTES`).
            let ahead = (i + ahead_by).min(items.len());
            if written < ahead {
                let batch = &items[written..ahead];
                let write = write_sets(conn.get_mut(), batch, ttl.as_deref(), &mut head);
                match tokio::time::timeout_at(deadline, write).await {
                    Ok(Ok(())) => written = ahead,
                    Ok(Err(e)) => {
                        poisoned = Some(format!("redis write: {e}"));
                        out.push(Err(e));
                        continue;
                    }
                    Err(_) => {
                        let msg = format!("redis batch over {budget:?}");
                        out.push(Err(L2Error::transient(msg.clone())));
                        poisoned = Some(msg);
                        continue;
                    }
                }
            }
            let blob = items[i].1;
            let r = match tokio::time::timeout_at(deadline, line(&mut conn)).await {
                Ok(Ok(l)) => match l.first() {
                    Some(b'+') => Ok(Ok(Stored::Written(blob.len() as u64))),
                    Some(b'$') if l == b"$-1" => Ok(Ok(Stored::AlreadyPresent)),
                    Some(b'_') => Ok(Ok(Stored::AlreadyPresent)),
                    Some(b'-') => {
                        Ok(Err(L2Error::transient(String::from_utf8_lossy(&l[1..]).into_owned())))
                    }
                    _ => {
                        Err(bad(format!("unexpected SET reply {:?}", String::from_utf8_lossy(&l))))
                    }
                },
                Ok(Err(e)) => Err(e),
                Err(_) => Err(L2Error::transient(format!("redis batch over {budget:?}"))),
            };
            match r {
                Ok(r) => out.push(r),
                Err(e) => {
                    poisoned = Some(e.to_string());
                    out.push(Err(e));
                }
            }
        }
        if poisoned.is_none() {
            self.give_back(conn);
        }
        out
    }

    /// `GET`s `names[i]` into `items[i]`'s sink, pipelined on one connection `window` ahead,
    /// within `budget`. Every sink comes back, whatever happened.
    pub(crate) async fn load(
        &self,
        names: Vec<String>,
        mut items: Vec<DirectItem>,
        budget: Duration,
    ) -> Vec<DirectResult> {
        let deadline = tokio::time::Instant::now() + budget;
        let conn = self.conn(deadline).await;
        let mut conn = match conn {
            Ok(c) => c,
            Err(e) => {
                let msg = e.to_string();
                return items
                    .into_iter()
                    .map(|(_, _, sink)| (sink, Err(L2Error::unavailable(msg.clone()))))
                    .collect();
            }
        };
        let mut out = Vec::with_capacity(items.len());
        let mut poisoned: Option<String> = None;
        let mut written = 0;
        let largest =
            items.iter_mut().map(|(_, h, s)| *h + s.payload_mut().len()).max().unwrap_or(0);
        let ahead_by = window(self.depth, largest);
        let mut req = Vec::with_capacity(ahead_by * 64);
        for (i, (_, hlen, mut sink)) in items.into_iter().enumerate() {
            if let Some(msg) = &poisoned {
                out.push((sink, Err(L2Error::transient(msg.clone()))));
                continue;
            }
            // Keep `window` `GET`s ahead of the replies read (see `WINDOW_BYTES`).
            let ahead = (i + ahead_by).min(names.len());
            if written < ahead {
                req.clear();
                for n in &names[written..ahead] {
                    command(&mut req, &[b"GET", n.as_bytes()]);
                }
                match tokio::time::timeout_at(deadline, conn.get_mut().write_all(&req)).await {
                    Ok(Ok(())) => written = ahead,
                    Ok(Err(e)) => {
                        let msg = format!("redis write: {e}");
                        out.push((sink, Err(L2Error::transient(msg.clone()))));
                        poisoned = Some(msg);
                        continue;
                    }
                    Err(_) => {
                        let msg = format!("redis batch over {budget:?}");
                        out.push((sink, Err(L2Error::transient(msg.clone()))));
                        poisoned = Some(msg);
                        continue;
                    }
                }
            }
            match tokio::time::timeout_at(deadline, read_get(&mut conn, hlen, &mut *sink)).await {
                Ok(Ok(r)) => out.push((sink, r)),
                Ok(Err(e)) => {
                    poisoned = Some(e.to_string());
                    out.push((sink, Err(e)));
                }
                Err(_) => {
                    let msg = format!("redis batch over {budget:?}");
                    out.push((sink, Err(L2Error::transient(msg.clone()))));
                    poisoned = Some(msg);
                }
            }
        }
        if poisoned.is_none() {
            self.give_back(conn);
        }
        out
    }
}

/// One `GET` reply: the outer error poisons the connection; the inner result is the key's.
async fn read_get(
    r: &mut BufReader<TcpStream>,
    hlen: usize,
    sink: &mut dyn crate::adapter::PayloadSink,
) -> Result<Result<Option<DirectHeader>, L2Error>, L2Error> {
    let l = line(r).await?;
    match l.first() {
        Some(b'$') => {}
        Some(b'-') => {
            let msg = String::from_utf8_lossy(&l[1..]).into_owned();
            return Ok(Err(L2Error::transient(msg)));
        }
        _ => return Err(bad(format!("unexpected GET reply {:?}", String::from_utf8_lossy(&l)))),
    }
    let len: i64 = std::str::from_utf8(&l[1..])
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| bad("a bulk length that is not a number"))?;
    if len < 0 {
        return Ok(Ok(None));
    }
    let len = len as u64;
    let payload = sink.payload_mut();
    if len != (hlen + payload.len()) as u64 {
        // Another blob of another length: a miss, never a partial fill.
        skip(r, len + 2).await?;
        return Ok(Ok(None));
    }
    let mut header = vec![0u8; hlen];
    r.read_exact(&mut header).await?;
    r.read_exact(payload).await?;
    let mut crlf = [0u8; 2];
    r.read_exact(&mut crlf).await?;
    if &crlf != b"\r\n" {
        return Err(bad("a bulk value not followed by CRLF"));
    }
    Ok(Ok(Some(header.into())))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpListener;

    fn login(addr: String) -> Login {
        Login {
            addr,
            username: None,
            password: Some("pw".into()),
            database: 3,
            connect_timeout: Duration::from_secs(2),
        }
    }

    fn item(hlen: usize, payload: usize) -> DirectItem {
        let key = lmcache_core::ObjectKey::new([1; 32], "m", 1, 0, 0, "").unwrap();
        (key, hlen, Box::new(vec![0u8; payload]))
    }

    /// A server that answers the login, then `reply` to the first batch, then closes.
    async fn server(reply: &'static [u8]) -> (String, tokio::task::JoinHandle<Vec<u8>>) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let task = tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            let mut seen = Vec::new();
            let mut buf = [0u8; 4096];
            // AUTH and SELECT, then two GETs: wait for all four commands.
            while seen.iter().filter(|&&b| b == b'*').count() < 4 {
                let n = s.read(&mut buf).await.unwrap();
                assert!(n > 0, "client hung up early");
                seen.extend_from_slice(&buf[..n]);
                if seen.windows(6).any(|w| w == b"SELECT")
                    && seen.iter().filter(|&&b| b == b'*').count() == 2
                {
                    s.write_all(b"+OK\r\n+OK\r\n").await.unwrap();
                }
            }
            s.write_all(reply).await.unwrap();
            seen
        });
        (addr, task)
    }

    #[tokio::test]
    async fn replies_fill_sinks_and_a_torn_reply_fails_the_rest_of_the_batch() {
        // Key 1: a 2-byte header and 3-byte payload; key 2: a value of the wrong length (a
        // miss, drained); key 3: nil; key 4: an error reply; key 5: torn (the server closes).
        let (addr, task) =
            server(b"$5\r\nHHabc\r\n$4\r\nxxxx\r\n$-1\r\n-ERR boom\r\n$5\r\nHHa").await;
        let gets = DirectConns::new(login(addr), 2, None);
        let names: Vec<String> = (1..=5).map(|i| format!("k{i}")).collect();
        let items = vec![item(2, 3), item(2, 3), item(2, 3), item(2, 3), item(2, 3)];
        let out = gets.load(names, items, Duration::from_secs(5)).await;
        let seen = task.await.unwrap();
        let text = String::from_utf8_lossy(&seen);
        assert!(text.contains("AUTH\r\n$2\r\npw") && text.contains("SELECT\r\n$1\r\n3"), "{text}");
        assert_eq!(out.len(), 5, "every sink comes back");
        let mut out = out.into_iter();
        let (sink, r) = out.next().unwrap();
        assert_eq!(r.unwrap(), Some(b"HH".to_vec().into()));
        assert_eq!(*sink.into_any().downcast::<Vec<u8>>().unwrap(), b"abc");
        let (sink, r) = out.next().unwrap();
        assert_eq!(r.unwrap(), None, "a value of another length is a miss");
        assert_eq!(*sink.into_any().downcast::<Vec<u8>>().unwrap(), vec![0u8; 3], "never filled");
        assert_eq!(out.next().unwrap().1.unwrap(), None);
        assert!(out.next().unwrap().1.unwrap_err().to_string().contains("boom"));
        assert!(out.next().unwrap().1.is_err(), "a torn value is an error, not a hit");
        assert!(gets.idle.lock().is_empty(), "a poisoned connection is not pooled");
    }

    /// A server that answers one command at a time, each only once the client has stopped
    /// sending (100 ms of quiet), and reports the most commands it ever held unanswered.
    /// `done` marks the end of a command in the stream; `reply` answers one.
    async fn patient_server(
        n: usize,
        done: &'static [u8],
        reply: Vec<u8>,
    ) -> (String, tokio::task::JoinHandle<usize>) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let task = tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            let (mut seen, mut answered, mut most) = (Vec::new(), 0, 0);
            let mut buf = vec![0u8; 1 << 16];
            while answered < n {
                let quiet = Duration::from_millis(100);
                match tokio::time::timeout(quiet, s.read(&mut buf)).await {
                    Ok(r) => {
                        let k = r.unwrap();
                        assert!(k > 0, "client hung up early");
                        seen.extend_from_slice(&buf[..k]);
                    }
                    Err(_) => {
                        let received = seen.windows(done.len()).filter(|w| *w == done).count();
                        most = most.max(received - answered);
                        assert!(received > answered, "the client waits for nothing");
                        s.write_all(&reply).await.unwrap();
                        answered += 1;
                    }
                }
            }
            most
        });
        (addr, task)
    }

    #[tokio::test]
    async fn loads_keep_a_window_of_values_requested_not_the_whole_batch() {
        let plain = |addr| Login { password: None, database: 0, ..login(addr) };
        // A `GET` reply: the 2-byte header "HH", then `n` bytes of `fill`.
        let bulk = |n: usize, fill: u8| {
            let mut r = format!("${}\r\nHH", n + 2).into_bytes();
            r.extend(std::iter::repeat_n(fill, n));
            r.extend_from_slice(b"\r\n");
            r
        };
        // 300 kB values: one ahead (over half of WINDOW_BYTES each).
        let (addr, task) = patient_server(4, b"GET\r\n", bulk(300_000, 7)).await;
        let conns = DirectConns::new(plain(addr), 1, None);
        let names: Vec<String> = (0..4).map(|i| format!("k{i}")).collect();
        let items = (0..4).map(|_| item(2, 300_000)).collect();
        let out = conns.load(names, items, Duration::from_secs(10)).await;
        assert_eq!(task.await.unwrap(), 1, "one 300 kB value requested at a time");
        for (sink, r) in out {
            assert_eq!(r.unwrap(), Some(b"HH".to_vec().into()));
            assert!(sink.into_any().downcast::<Vec<u8>>().unwrap().iter().all(|&b| b == 7));
        }
        // 100 kB values: five ahead; a fixed depth of 3 overrides that.
        for (depth, want) in [(None, 5), (Some(3), 3)] {
            let (addr, task) = patient_server(8, b"GET\r\n", bulk(100_000, 1)).await;
            let conns = DirectConns::new(plain(addr), 1, depth);
            let names: Vec<String> = (0..8).map(|i| format!("k{i}")).collect();
            let items = (0..8).map(|_| item(2, 100_000)).collect();
            let out = conns.load(names, items, Duration::from_secs(10)).await;
            assert_eq!(task.await.unwrap(), want, "depth {depth:?}");
            assert!(out.iter().all(|(_, r)| matches!(r, Ok(Some(_)))));
        }
    }

    #[tokio::test]
    async fn stores_keep_a_window_of_values_sent_not_the_whole_batch() {
        let (addr, task) = patient_server(6, b"$2\r\nNX\r\n", b"+OK\r\n".to_vec()).await;
        let conns = DirectConns::new(Login { password: None, database: 0, ..login(addr) }, 1, None);
        let blob = Blob::from_parts(
            bytes::Bytes::from_static(b"HH"),
            bytes::Bytes::from(vec![0u8; 200_000]),
        );
        let items: Vec<(String, &Blob)> = (0..6).map(|i| (format!("k{i}"), &blob)).collect();
        let out = conns.store(&items, None, Duration::from_secs(10)).await;
        assert_eq!(task.await.unwrap(), 2, "two 200 kB values sent ahead of their replies");
        assert!(out.iter().all(|r| matches!(r, Ok(Stored::Written(200_002)))), "{out:?}");
    }

    #[tokio::test]
    async fn a_refused_login_fails_every_key() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            let mut buf = [0u8; 256];
            let _ = s.read(&mut buf).await;
            let _ = s.write_all(b"-WRONGPASS invalid password\r\n").await;
        });
        let gets = DirectConns::new(login(addr), 1, None);
        let out = gets.load(vec!["k".into()], vec![item(2, 3)], Duration::from_secs(5)).await;
        let e = out.into_iter().next().unwrap().1.unwrap_err();
        assert!(e.to_string().contains("WRONGPASS"), "{e}");
    }

    #[tokio::test]
    async fn sets_write_exact_resp_from_the_blob_and_read_each_reply() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let one =
            "*6\r\n$3\r\nSET\r\n$2\r\nk1\r\n$5\r\nHHabc\r\n$2\r\nNX\r\n$2\r\nEX\r\n$2\r\n60\r\n";
        let want: Vec<u8> =
            [one, &one.replace("k1", "k2"), &one.replace("k1", "k3")].concat().into_bytes();
        let n = want.len();
        let task = tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            let mut seen = vec![0u8; n];
            s.read_exact(&mut seen).await.unwrap();
            s.write_all(b"+OK\r\n$-1\r\n-OOM command not allowed\r\n").await.unwrap();
            seen
        });
        let login = Login { password: None, database: 0, ..login(addr) };
        let conns = DirectConns::new(login, 1, None);
        let blob =
            Blob::from_parts(bytes::Bytes::from_static(b"HH"), bytes::Bytes::from_static(b"abc"));
        let items: Vec<(String, &Blob)> = (1..=3).map(|i| (format!("k{i}"), &blob)).collect();
        let out = conns.store(&items, Some(60), Duration::from_secs(5)).await;
        assert_eq!(String::from_utf8_lossy(&task.await.unwrap()), String::from_utf8_lossy(&want));
        assert!(matches!(out[0], Ok(Stored::Written(5))), "{:?}", out[0]);
        assert!(matches!(out[1], Ok(Stored::AlreadyPresent)), "{:?}", out[1]);
        assert!(out[2].as_ref().unwrap_err().to_string().contains("OOM"), "{:?}", out[2]);
        assert_eq!(conns.idle.lock().len(), 1, "a connection that answered every reply is pooled");
    }
}
