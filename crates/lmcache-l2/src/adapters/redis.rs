//! `redis` (also `resp` and `valkey`): Redis or Valkey over RESP, single node or Redis Cluster.
//!
//! Object name: `[key_prefix@]<wire key>`, value: the blob. Stores use `SET NX` (with `EX`
//! when `ttl_seconds` is set), so a key already present is neither re-sent twice nor replaced;
//! lookups `EXISTS`, loads `GET`, deletes `DEL`. On a single node each batch is one pipeline
//! on one connection of a small pool; on a cluster the commands of a batch go out concurrently
//! on the cluster connection, which routes each key to its slot's node. Connections reconnect
//! by themselves, so an outage shows as errors (misses) and ends when the server is back.
//!
//! Time limits: the client library's own per-reply timeout (500 ms by default, which a 32 MiB
//! value over loopback can exceed) is switched off; each batch instead gets
//! [`crate::adapter::time_budget`]: `request_timeout` plus its bytes at a floor bandwidth. For
//! loads the bytes are the sizes `lookup_sized` (`STRLEN`) reported, or the largest object this
//! adapter has seen, per key.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures_util::future::join_all;
use lmcache_core::ObjectKey;
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use redis::{RedisError, Value};

use crate::adapter::{
    DirectItem, DirectResult, KeyFilter, KeyPage, L2Adapter, Stored, time_budget,
};
use crate::blob::Blob;
use crate::error::L2Error;
use crate::wire_key;

/// Settings of the redis adapter.
#[derive(Debug, Clone)]
pub struct RedisConfig {
    /// `host:port` of each node (standalone uses the first).
    pub nodes: Vec<String>,
    /// Whether the nodes form a Redis Cluster.
    pub cluster_mode: bool,
    /// ACL user.
    pub username: Option<String>,
    /// Password.
    pub password: Option<String>,
    /// Connect with TLS (`rediss://`).
    pub tls: bool,
    /// Database number (standalone only).
    pub database: i64,
    /// Prefix of every object name.
    pub key_prefix: String,
    /// Connections in the pool (standalone).
    pub num_workers: usize,
    /// Commands each raw connection keeps ahead of the replies it has read (standalone
    /// without TLS). `None`: as many as make 512 KiB of values, 1 to 64 (see the module
    /// `resp_direct`).
    pub pipeline_depth: Option<usize>,
    /// Expiry of stored objects.
    pub ttl_seconds: Option<u64>,
    /// Limit on one batch of small values; large batches get more (see the module docs).
    pub request_timeout: Duration,
    /// Limit on connecting.
    pub connection_timeout: Duration,
}

impl RedisConfig {
    fn url(&self, node: &str) -> String {
        let scheme = if self.tls { "rediss" } else { "redis" };
        let auth = match (&self.username, &self.password) {
            (Some(u), Some(p)) => format!("{}:{}@", enc(u), enc(p)),
            (None, Some(p)) => format!(":{}@", enc(p)),
            (Some(u), None) => format!("{}@", enc(u)),
            (None, None) => String::new(),
        };
        let db = if self.cluster_mode { String::new() } else { format!("/{}", self.database) };
        format!("{scheme}://{auth}{node}{db}")
    }
}

fn enc(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// A blob as one RESP argument, header and payload written straight into the command buffer
/// (no intermediate contiguous copy).
struct BlobArg<'a>(&'a Blob);

impl redis::ToRedisArgs for BlobArg<'_> {
    fn write_redis_args<W>(&self, out: &mut W)
    where
        W: ?Sized + redis::RedisWrite,
    {
        use std::io::Write;
        let mut w = out.writer_for_next_arg();
        // Writing into the command's Vec cannot fail.
        let _ = w.write_all(self.0.header());
        let _ = w.write_all(&self.0.payload);
    }
}

enum Conns {
    Single(Vec<ConnectionManager>),
    Cluster(ClusterConnection),
}

/// The redis adapter.
pub struct RedisAdapter {
    config: RedisConfig,
    conns: Conns,
    /// Raw connections for the bulk bytes (single node without TLS): `GET`s socket to
    /// destination, `SET`s from the blob's memory.
    direct: Option<super::resp_direct::DirectConns>,
    next: AtomicUsize,
    /// The largest object stored, loaded or sized so far: the per-key allowance of a load
    /// whose sizes are unknown.
    largest: AtomicU64,
}

impl std::fmt::Debug for RedisAdapter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisAdapter")
            .field("nodes", &self.config.nodes)
            .field("cluster_mode", &self.config.cluster_mode)
            .finish_non_exhaustive()
    }
}

fn map_err(e: RedisError) -> L2Error {
    if e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal() || e.is_timeout() {
        L2Error::unavailable(e.to_string())
    } else {
        L2Error::transient(e.to_string())
    }
}

impl RedisAdapter {
    /// Connects; fails (naming the node) if the server cannot be reached in time.
    pub async fn connect(config: RedisConfig) -> Result<Self, L2Error> {
        let first = config
            .nodes
            .first()
            .cloned()
            .ok_or_else(|| L2Error::unavailable("no node configured"))?;
        let ct = config.connection_timeout;
        let conns = if config.cluster_mode {
            let urls: Vec<String> = config.nodes.iter().map(|n| config.url(n)).collect();
            // No per-command response timeout: every batch runs under our own, sized limit.
            let client = redis::cluster::ClusterClient::builder(urls)
                .connection_timeout(ct)
                .build()
                .map_err(map_err)?;
            let c = tokio::time::timeout(ct, client.get_async_connection())
                .await
                .map_err(|_| L2Error::unavailable(format!("cluster {first}: connect timed out")))?
                .map_err(|e| L2Error::unavailable(format!("cluster {first}: {e}")))?;
            Conns::Cluster(c)
        } else {
            let client = redis::Client::open(config.url(&first)).map_err(map_err)?;
            // The library's default response timeout (500 ms) cuts off large values; every
            // batch runs under our own limit, sized by its bytes, instead.
            let mgr = ConnectionManagerConfig::new()
                .set_response_timeout(None)
                .set_connection_timeout(Some(ct));
            let mut pool = Vec::new();
            for _ in 0..config.num_workers.max(1) {
                let c = tokio::time::timeout(
                    ct,
                    client.get_connection_manager_with_config(mgr.clone()),
                )
                .await
                .map_err(|_| L2Error::unavailable(format!("{first}: connect timed out")))?
                .map_err(|e| L2Error::unavailable(format!("{first}: {e}")))?;
                pool.push(c);
            }
            Conns::Single(pool)
        };
        let direct = (!config.cluster_mode && !config.tls).then(|| {
            super::resp_direct::DirectConns::new(
                super::resp_direct::Login {
                    addr: first.clone(),
                    username: config.username.clone(),
                    password: config.password.clone(),
                    database: config.database,
                    connect_timeout: ct,
                },
                config.num_workers,
                config.pipeline_depth,
            )
        });
        let a =
            Self { config, conns, direct, next: AtomicUsize::new(0), largest: AtomicU64::new(0) };
        // One round trip now, so that a missing or wrong password fails at start.
        let ping = a
            .run(vec![redis::cmd("PING")], 0)
            .await
            .map_err(|e| L2Error::unavailable(format!("{first}: {e}")))?;
        if let Some(Err(e)) = ping.into_iter().next() {
            return Err(L2Error::unavailable(format!("{first}: PING refused: {e}")));
        }
        Ok(a)
    }

    fn name(&self, key: &ObjectKey) -> String {
        let wk = wire_key::encode(key);
        if self.config.key_prefix.is_empty() {
            wk
        } else {
            format!("{}@{wk}", self.config.key_prefix)
        }
    }

    fn saw(&self, bytes: u64) {
        self.largest.fetch_max(bytes, Ordering::Relaxed);
    }

    /// Runs commands: one pipeline on a pooled connection, or concurrently on the cluster,
    /// within `request_timeout` plus `bytes` at the floor bandwidth. The outer error is for the
    /// whole batch; inner per command.
    async fn run(
        &self,
        cmds: Vec<redis::Cmd>,
        bytes: u64,
    ) -> Result<Vec<Result<Value, L2Error>>, L2Error> {
        let t = time_budget(self.config.request_timeout, bytes);
        let fut = async move {
            match &self.conns {
                Conns::Single(pool) => {
                    let i = self.next.fetch_add(1, Ordering::Relaxed) % pool.len();
                    let mut c = pool[i].clone();
                    let n = cmds.len();
                    let mut p = redis::pipe();
                    for cmd in cmds {
                        // Moved, not cloned: a SET holds its whole blob.
                        p.add_command(cmd);
                    }
                    let vals: Vec<Value> =
                        c.req_packed_commands(&p, 0, n).await.map_err(map_err)?;
                    Ok(vals
                        .into_iter()
                        .map(|v| match v {
                            Value::ServerError(e) => Err(L2Error::transient(format!("{e:?}"))),
                            v => Ok(v),
                        })
                        .collect())
                }
                Conns::Cluster(c) => {
                    let futs = cmds.iter().map(|cmd| {
                        let mut c = c.clone();
                        async move { c.req_packed_command(cmd).await.map_err(map_err) }
                    });
                    Ok(join_all(futs).await)
                }
            }
        };
        tokio::time::timeout(t, fut)
            .await
            .map_err(|_| L2Error::transient(format!("redis batch over {t:?}")))?
    }
}

#[async_trait]
impl L2Adapter for RedisAdapter {
    fn kind(&self) -> &'static str {
        "redis"
    }

    async fn store(&self, items: Vec<(ObjectKey, Blob)>) -> Vec<Result<Stored, L2Error>> {
        if let Some(direct) = &self.direct {
            let named: Vec<(String, &Blob)> =
                items.iter().map(|(k, b)| (self.name(k), b)).collect();
            let bytes: u64 = items.iter().map(|(_, b)| b.len() as u64).sum();
            if let Some(m) = items.iter().map(|(_, b)| b.len() as u64).max() {
                self.saw(m);
            }
            let budget = time_budget(self.config.request_timeout, bytes);
            return direct.store(&named, self.config.ttl_seconds, budget).await;
        }
        let cmds: Vec<redis::Cmd> = items
            .iter()
            .map(|(k, b)| {
                let mut c = redis::cmd("SET");
                c.arg(self.name(k)).arg(BlobArg(b)).arg("NX");
                if let Some(ttl) = self.config.ttl_seconds {
                    c.arg("EX").arg(ttl);
                }
                c
            })
            .collect();
        let bytes: u64 = items.iter().map(|(_, b)| b.len() as u64).sum();
        if let Some(m) = items.iter().map(|(_, b)| b.len() as u64).max() {
            self.saw(m);
        }
        match self.run(cmds, bytes).await {
            Err(e) => {
                let msg = e.to_string();
                let unavailable = matches!(e, L2Error::Unavailable { .. });
                items
                    .iter()
                    .map(|_| {
                        Err(if unavailable {
                            L2Error::unavailable(msg.clone())
                        } else {
                            L2Error::transient(msg.clone())
                        })
                    })
                    .collect()
            }
            Ok(vals) => vals
                .into_iter()
                .zip(&items)
                .map(|(v, (_, b))| match v? {
                    Value::Nil => Ok(Stored::AlreadyPresent),
                    _ => Ok(Stored::Written(b.len() as u64)),
                })
                .collect(),
        }
    }

    async fn lookup(&self, keys: &[ObjectKey]) -> Result<Vec<bool>, L2Error> {
        let cmds = keys.iter().map(|k| redis::cmd("EXISTS").arg(self.name(k)).clone()).collect();
        self.run(cmds, 0)
            .await?
            .into_iter()
            .map(|v| Ok(matches!(v?, Value::Int(n) if n > 0)))
            .collect()
    }

    /// `STRLEN` per key: 0 means absent (a stored blob is never empty).
    async fn lookup_sized(&self, keys: &[ObjectKey]) -> Result<Vec<Option<u64>>, L2Error> {
        let cmds = keys.iter().map(|k| redis::cmd("STRLEN").arg(self.name(k)).clone()).collect();
        let sizes: Vec<Option<u64>> = self
            .run(cmds, 0)
            .await?
            .into_iter()
            .map(|v| match v? {
                Value::Int(n) if n > 0 => Ok(Some(n as u64)),
                _ => Ok(None),
            })
            .collect::<Result<_, L2Error>>()?;
        if let Some(m) = sizes.iter().flatten().max() {
            self.saw(*m);
        }
        Ok(sizes)
    }

    async fn ping(&self) -> Result<(), L2Error> {
        match self.run(vec![redis::cmd("PING")], 0).await?.into_iter().next() {
            Some(Ok(_)) => Ok(()),
            Some(Err(e)) => Err(e),
            None => Err(L2Error::transient("PING: no reply")),
        }
    }

    /// `SCAN` over this adapter's names (`key_prefix@*`, or every name that parses as a wire
    /// key), with `STRLEN` for sizes. On a cluster, each master is scanned.
    async fn scan(&self, limit: usize) -> Result<Vec<(ObjectKey, u64)>, L2Error> {
        let pattern = if self.config.key_prefix.is_empty() {
            "*".to_owned()
        } else {
            format!("{}@*", self.config.key_prefix)
        };
        let names: Vec<String> = match &self.conns {
            Conns::Single(pool) => {
                let mut c = pool[0].clone();
                scan_node(&mut c, &pattern, limit).await?
            }
            Conns::Cluster(_) => {
                // Each startup node answers for its own slots (replicas repeat their master's
                // names, hence the dedup).
                let mut names = Vec::new();
                for node in &self.config.nodes {
                    let client = redis::Client::open(self.config.url(node)).map_err(map_err)?;
                    let mut nc = tokio::time::timeout(
                        self.config.connection_timeout,
                        client.get_multiplexed_async_connection(),
                    )
                    .await
                    .map_err(|_| L2Error::unavailable(format!("{node}: connect timed out")))?
                    .map_err(map_err)?;
                    names.extend(scan_node(&mut nc, &pattern, limit - names.len()).await?);
                    if names.len() >= limit {
                        break;
                    }
                }
                names.sort_unstable();
                names.dedup();
                names
            }
        };
        let keys: Vec<ObjectKey> = names
            .iter()
            .filter_map(|n| {
                let wk = if self.config.key_prefix.is_empty() {
                    n.as_str()
                } else {
                    n.strip_prefix(&self.config.key_prefix)?.strip_prefix('@')?
                };
                wire_key::decode(wk)
            })
            .collect();
        let mut out = Vec::with_capacity(keys.len());
        for chunk in keys.chunks(1000) {
            for (k, s) in chunk.iter().zip(self.lookup_sized(chunk).await?) {
                if let Some(s) = s {
                    out.push((k.clone(), s));
                }
            }
        }
        Ok(out)
    }

    async fn list(
        &self,
        filter: &KeyFilter,
        cursor: Option<&str>,
        limit: usize,
    ) -> Result<KeyPage, L2Error> {
        let all = self.scan(1 << 20).await?;
        Ok(crate::adapter::page_keys(all.iter().map(|(k, n)| (k, *n)), filter, cursor, limit))
    }

    async fn load(&self, keys: &[ObjectKey]) -> Vec<Result<Option<Bytes>, L2Error>> {
        let cmds = keys.iter().map(|k| redis::cmd("GET").arg(self.name(k)).clone()).collect();
        // Sizes are unknown here: allow the largest object seen (at least 1 MiB) per key.
        let per_key = self.largest.load(Ordering::Relaxed).max(1 << 20);
        match self.run(cmds, per_key.saturating_mul(keys.len() as u64)).await {
            Err(e) => {
                let msg = e.to_string();
                keys.iter().map(|_| Err(L2Error::unavailable(msg.clone()))).collect()
            }
            Ok(vals) => vals
                .into_iter()
                .map(|v| match v? {
                    Value::Nil => Ok(None),
                    Value::BulkString(b) => {
                        self.saw(b.len() as u64);
                        Ok(Some(Bytes::from(b)))
                    }
                    other => Err(L2Error::transient(format!("unexpected GET reply {other:?}"))),
                })
                .collect(),
        }
    }

    /// Single node without TLS: replies are read from the socket straight into the sinks
    /// (`resp_get`). Otherwise `GET` and a copy.
    async fn load_direct(&self, mut items: Vec<DirectItem>) -> Vec<DirectResult> {
        let Some(direct) = &self.direct else {
            return crate::adapter::load_direct_by_copy(self, items).await;
        };
        let names = items.iter().map(|(k, _, _)| self.name(k)).collect();
        let mut bytes = 0u64;
        for (_, hlen, sink) in &mut items {
            let len = (*hlen + sink.payload_mut().len()) as u64;
            self.saw(len);
            bytes += len;
        }
        direct.load(names, items, time_budget(self.config.request_timeout, bytes)).await
    }

    async fn delete(&self, keys: &[ObjectKey]) -> Result<u64, L2Error> {
        let cmds = keys.iter().map(|k| redis::cmd("DEL").arg(self.name(k)).clone()).collect();
        Ok(self
            .run(cmds, 0)
            .await?
            .into_iter()
            .filter(|v| matches!(v, Ok(Value::Int(n)) if *n > 0))
            .count() as u64)
    }

    fn describe(&self) -> serde_json::Value {
        let c = &self.config;
        serde_json::json!({
            "type": "redis",
            "nodes": c.nodes,
            "cluster_mode": c.cluster_mode,
            "tls_enable": c.tls,
            "database_id": c.database,
            "key_prefix": c.key_prefix,
            "num_workers": c.num_workers,
            "pipeline_depth": c.pipeline_depth,
            "ttl_seconds": c.ttl_seconds,
            "auth": c.password.is_some(),
        })
    }
}

/// `SCAN` one node for names matching `pattern`, at most `limit`.
async fn scan_node<C: ConnectionLike + Send>(
    c: &mut C,
    pattern: &str,
    limit: usize,
) -> Result<Vec<String>, L2Error> {
    let mut names = Vec::new();
    let mut cursor: u64 = 0;
    loop {
        let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(1000)
            .query_async(c)
            .await
            .map_err(map_err)?;
        names.extend(batch);
        if next == 0 || names.len() >= limit {
            names.truncate(limit);
            return Ok(names);
        }
        cursor = next;
    }
}
