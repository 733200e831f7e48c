//! `native_plugin`: an L2 backend in a shared library of the operator's, through our stable C
//! ABI (`include/lmcache_rs_l2_plugin.h`): LMCache's native connector model (batched
//! put/get/exists/delete submitted to the plugin's own threads, completions signalled
//! through one eventfd), with a version handshake so a plugin built for another ABI is
//! refused by name. `plugin-example/memory_plugin.c` is a complete plugin; the conformance
//! suite runs against it.
//!
//! `{"type": "native_plugin", "path": "/abs/libfoo.so", "config": {...}, "timeout_secs": 10}`:
//! `config` goes to the plugin's `create` as JSON text. Loading a library runs its code, so a
//! plugin is loaded only from the command line at start, never added over HTTP.
//!
//! A reactor thread waits on the eventfd and hands completions to the waiting futures. A
//! caller that times out leaves its op pending (its memory stays until the plugin completes
//! it or is destroyed). Objects are our self-checking blobs: a plugin that corrupts or
//! mixes up objects causes misses, never wrong KV. Listing is not part of the ABI (v1): the
//! adapter answers it as unsupported.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use lmcache_core::ObjectKey;

use crate::adapter::{L2Adapter, Stored, time_budget};
use crate::blob::Blob;
use crate::error::L2Error;
use crate::plugin_ffi::{ABSENT, Op, Plugin, PluginError};
use crate::wire_key;

const EMSGSIZE: i64 = libc::EMSGSIZE as i64;

/// A loaded plugin as an adapter.
#[derive(Debug)]
pub struct NativePluginAdapter {
    plugin: Arc<Plugin>,
    path: PathBuf,
    next_op: AtomicU64,
    timeout: Duration,
    stop: Arc<AtomicBool>,
    reactor: Option<std::thread::JoinHandle<()>>,
}

fn errno(rc: i64) -> String {
    let code = i32::try_from(-rc).unwrap_or(i32::MAX);
    format!("{} (errno {code})", std::io::Error::from_raw_os_error(code))
}

impl NativePluginAdapter {
    /// Loads the plugin at `path` with `config` (JSON text), and starts its reactor.
    pub fn load(path: &Path, config: &str, timeout: Duration) -> Result<Self, PluginError> {
        let plugin = Arc::new(Plugin::load(path, config)?);
        let stop = Arc::new(AtomicBool::new(false));
        let reactor = {
            let (plugin, stop) = (Arc::clone(&plugin), Arc::clone(&stop));
            std::thread::Builder::new()
                .name("lmcache-l2-plugin".into())
                .spawn(move || {
                    while !stop.load(Ordering::Acquire) {
                        plugin.poll(100);
                    }
                })
                .map_err(|e| PluginError::Create {
                    name: plugin_name(path),
                    reason: format!("cannot start its reactor thread: {e}"),
                })?
        };
        tracing::info!(plugin = plugin.name(), path = %path.display(), "native L2 plugin loaded");
        Ok(Self {
            plugin,
            path: path.to_path_buf(),
            next_op: AtomicU64::new(1),
            timeout,
            stop,
            reactor: Some(reactor),
        })
    }

    /// Runs `op` (moving `bytes`) and returns it completed.
    async fn run(&self, op: Op, bytes: u64) -> Result<Op, L2Error> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let id = self.next_op.fetch_add(1, Ordering::Relaxed);
        let name = self.plugin.name().to_owned();
        self.plugin
            .submit(id, op, Box::new(move |status, op| drop(tx.send((status, op)))))
            .map_err(|rc| {
                L2Error::transient(format!("plugin {name} refused a batch: {}", errno(rc.into())))
            })?;
        match tokio::time::timeout(time_budget(self.timeout, bytes), rx).await {
            Ok(Ok((0, op))) => Ok(*op),
            Ok(Ok((status, _))) => Err(L2Error::transient(format!(
                "plugin {name} failed a batch: {}",
                errno(status.into())
            ))),
            Ok(Err(_)) => Err(L2Error::Unavailable { reason: format!("plugin {name} closed") }),
            Err(_) => Err(L2Error::transient(format!("plugin {name} did not complete in time"))),
        }
    }

    fn keys(keys: &[ObjectKey]) -> Vec<String> {
        keys.iter().map(wire_key::encode).collect()
    }

    /// Each key's stored length (`None`: absent).
    async fn sizes(&self, keys: &[ObjectKey]) -> Result<Vec<Option<u64>>, L2Error> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let op = self.run(Op::exists(Self::keys(keys)), 0).await?;
        op.results()
            .iter()
            .map(|&r| match r {
                r if r >= 0 => Ok(Some(r as u64)),
                ABSENT => Ok(None),
                r => Err(L2Error::transient(format!("exists: {}", errno(r)))),
            })
            .collect()
    }
}

fn plugin_name(path: &Path) -> String {
    path.file_name()
        .map_or_else(|| path.display().to_string(), |n| n.to_string_lossy().into_owned())
}

impl Drop for NativePluginAdapter {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.reactor.take() {
            let _ = t.join();
        }
    }
}

#[async_trait]
impl L2Adapter for NativePluginAdapter {
    fn kind(&self) -> &'static str {
        "native_plugin"
    }

    async fn store(&self, items: Vec<(ObjectKey, Blob)>) -> Vec<Result<Stored, L2Error>> {
        if items.is_empty() {
            return Vec::new();
        }
        let lens: Vec<u64> = items.iter().map(|(_, b)| b.len() as u64).collect();
        let keys: Vec<String> = items.iter().map(|(k, _)| wire_key::encode(k)).collect();
        let values = items.into_iter().map(|(_, b)| (b.header().clone(), b.payload)).collect();
        let n = lens.len();
        match self.run(Op::put(keys, values), lens.iter().sum()).await {
            Ok(op) => op
                .results()
                .iter()
                .zip(lens)
                .map(|(&r, len)| match r {
                    0 => Ok(Stored::Written(len)),
                    1 => Ok(Stored::AlreadyPresent),
                    r => Err(L2Error::transient(format!("put: {}", errno(r)))),
                })
                .collect(),
            Err(e) => {
                let reason = e.to_string();
                (0..n).map(|_| Err(L2Error::transient(reason.clone()))).collect()
            }
        }
    }

    async fn lookup(&self, keys: &[ObjectKey]) -> Result<Vec<bool>, L2Error> {
        Ok(self.sizes(keys).await?.into_iter().map(|s| s.is_some()).collect())
    }

    async fn lookup_sized(&self, keys: &[ObjectKey]) -> Result<Vec<Option<u64>>, L2Error> {
        self.sizes(keys).await
    }

    async fn load(&self, keys: &[ObjectKey]) -> Vec<Result<Option<Bytes>, L2Error>> {
        let sizes = match self.sizes(keys).await {
            Ok(s) => s,
            Err(e) => {
                let reason = e.to_string();
                return keys.iter().map(|_| Err(L2Error::transient(reason.clone()))).collect();
            }
        };
        let present: Vec<usize> = (0..keys.len()).filter(|&i| sizes[i].is_some()).collect();
        let mut out: Vec<Result<Option<Bytes>, L2Error>> = keys.iter().map(|_| Ok(None)).collect();
        if present.is_empty() {
            return out;
        }
        let lens: Vec<usize> = present.iter().map(|&i| sizes[i].unwrap_or(0) as usize).collect();
        let names = present.iter().map(|&i| wire_key::encode(&keys[i])).collect();
        let total = lens.iter().map(|&l| l as u64).sum();
        match self.run(Op::get(names, &lens), total).await {
            Ok(op) => {
                for ((&i, len), (r, buf)) in present.iter().zip(lens).zip(op.into_buffers()) {
                    out[i] = match r {
                        r if r >= 0 && r as usize == len => Ok(Some(Bytes::from(buf))),
                        r if r >= 0 => Err(L2Error::transient(format!(
                            "get: the plugin reported {r} bytes for a {len}-byte object"
                        ))),
                        ABSENT => Ok(None),
                        r if r == -EMSGSIZE => {
                            Err(L2Error::transient("get: the object changed size while read"))
                        }
                        r => Err(L2Error::transient(format!("get: {}", errno(r)))),
                    };
                }
            }
            Err(e) => {
                let reason = e.to_string();
                for &i in &present {
                    out[i] = Err(L2Error::transient(reason.clone()));
                }
            }
        }
        out
    }

    async fn delete(&self, keys: &[ObjectKey]) -> Result<u64, L2Error> {
        if keys.is_empty() {
            return Ok(0);
        }
        let op = self.run(Op::delete(Self::keys(keys)), 0).await?;
        let mut n = 0;
        for &r in op.results() {
            match r {
                1 => n += 1,
                0 => {}
                r => return Err(L2Error::transient(format!("delete: {}", errno(r)))),
            }
        }
        Ok(n)
    }

    fn describe(&self) -> serde_json::Value {
        serde_json::json!({"type": self.kind(), "plugin": self.plugin.name(), "path": self.path})
    }
}
