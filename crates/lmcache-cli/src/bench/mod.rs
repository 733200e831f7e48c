//! `lmcache-rs bench server`: what `lmcache bench server --mode cpu` does, against any MP
//! server (ours or LMCache's), with LMCache's flags: per sequence a cold request (lookup,
//! expect a full miss; store) and a warm one (lookup, expect a full hit; retrieve, every byte
//! checked), from `--tp-size` ranks per client and `--concurrency` clients.
//!
//! Both transfer paths:
//! - `engine_driven` (`auto` in cpu mode, as LMCache maps it): the ranks register an
//!   engine-driven context and copy through the server's shared pool
//!   (`prepare_store`/`commit_store`, `prepare_retrieve`/`commit_retrieve`);
//! - `lmcache_driven`: each rank allocates its own paged KV, one POSIX shared-memory tensor per
//!   layer in the `--kvcache-shape-spec` geometry, registers it (`register_kv_cache`, cpu_shm
//!   descriptors) and the server copies blocks in and out (`store`/`retrieve` by block ids).
//!
//! `--use-mla` (or a spec with kv_size 1) folds the ranks onto one KV worker: rank 0 stores,
//! every rank retrieves the shared object. A live display redraws in place every second
//! (off with `-q` or when stderr is not a terminal); `--plot` draws latency histograms and
//! throughput over time; `--csv` writes every timed operation; `--format json` / `--output`
//! give LMCache's metrics document (with our extra fields).

pub mod engine;
pub mod live;
pub mod shape;

use std::time::Duration;

use anyhow::{Context, bail};
use clap::{Args, ValueEnum};
use lmcache_client::{
    CacheKey, Client, EngineDrivenRegistration, EngineGroupInfo, IpcDescriptor, TensorMeta,
};
use lmcache_core::ModelName;
use lmcache_memory::ForeignSegment;
use lmcache_memory::shm::ShmSegment;
use lmcache_protocol::Op;
use rmpv::Value;
use serde_json::json;

use live::{Live, Tracker};
use shape::ShapeGroup;

/// Output format.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum Format {
    /// A human table.
    Terminal,
    /// One JSON document.
    Json,
}

/// `--transfer-mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TransferMode {
    /// cpu mode: engine_driven (LMCache's mapping).
    Auto,
    /// The worker copies through the server's pool (prepare/commit).
    #[value(name = "engine_driven")]
    EngineDriven,
    /// The server copies from and to the ranks' own shared-memory KV.
    #[value(name = "lmcache_driven")]
    LmcacheDriven,
}

/// Flags of `lmcache-rs bench server` (LMCache's names and defaults, plus --concurrency).
#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// MP endpoint of the server.
    #[arg(long, default_value = "tcp://localhost:5555")]
    pub rpc_url: String,
    /// Run mode: cpu (the KV is in host memory). LMCache's gpu mode needs CUDA.
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "gpu"])]
    pub mode: String,
    /// Transfer path: engine_driven (prepare/commit through the server's pool),
    /// lmcache_driven (the server copies from each rank's own shared-memory KV), or auto
    /// (engine_driven in cpu mode, as LMCache).
    #[arg(long, value_enum, default_value = "auto")]
    pub transfer_mode: TransferMode,
    /// Simulated tensor-parallel ranks: each registers its own KV under its own instance id
    /// and stores and retrieves its shard.
    #[arg(long, default_value_t = 1)]
    pub tp_size: u32,
    /// MLA: the ranks share one KV worker; rank 0 stores, every rank retrieves. Implied by a
    /// --kvcache-shape-spec with kv_size 1.
    #[arg(long)]
    pub use_mla: bool,
    /// Tokens per request (whole chunks are stored; one more token is added, as LMCache).
    #[arg(long, default_value_t = 512)]
    pub num_tokens: usize,
    /// KV geometry: '(kv_size,NB,BS,NH,HS):dtype:layers[;...]' (LMCache's grammar), e.g.
    /// '(1,1024,16,1,128):float16:4;(2,1024,16,8,128):float16:28'.
    #[arg(long, default_value = shape::DEFAULT, help_heading = "KV cache shape")]
    pub kvcache_shape_spec: String,
    /// Paged blocks, where the spec's NB is 0 (a positive NB wins, and the bench says so).
    #[arg(long, default_value_t = 1024, help_heading = "KV cache shape")]
    pub num_blocks: u64,
    /// Tokens per block, where the spec's BS is 0 (a positive BS wins, and the bench says so).
    #[arg(long, default_value_t = 16, help_heading = "KV cache shape")]
    pub block_size: u64,
    /// First sequence id.
    #[arg(long, default_value_t = 0)]
    pub start: u32,
    /// End sequence id (exclusive).
    #[arg(long, default_value_t = 20)]
    pub end: u32,
    /// Seconds between a client's requests (LMCache's default is 0.5; 0 measures throughput).
    #[arg(long, default_value_t = 0.0)]
    pub interval: f64,
    /// Accepted for LMCache compatibility: bytes are checked end to end here, not by the
    /// server's checksum API.
    #[arg(long, default_value = "http://localhost:8080")]
    pub url: String,
    /// Concurrent clients, each with its own ranks.
    #[arg(long, default_value_t = 1)]
    pub concurrency: u32,
    /// Model name in the keys.
    #[arg(long, default_value = "test-model")]
    pub model: String,
    /// Per-call timeout in seconds.
    #[arg(long, default_value_t = 10)]
    pub timeout_seconds: u64,
    /// Output format.
    #[arg(long, value_enum, default_value = "terminal")]
    pub format: Format,
    /// Also write the JSON result here.
    #[arg(long)]
    pub output: Option<std::path::PathBuf>,
    /// Write every timed operation as CSV (op, seq, at_s, latency_ms, bytes, ok).
    #[arg(long, value_name = "FILE")]
    pub csv: Option<std::path::PathBuf>,
    /// Draw latency histograms and throughput over time to this PNG.
    #[arg(long, value_name = "FILE.png")]
    pub plot: Option<std::path::PathBuf>,
    /// No live display and no table; the exit code tells.
    #[arg(short, long)]
    pub quiet: bool,
}

const OPS: [&str; 4] = ["cold_lookup", "store", "warm_lookup", "retrieve"];
const INSTANCE_BASE: u64 = 2000;

/// What the run is, resolved from the flags.
struct Plan {
    groups: Vec<ShapeGroup>,
    driven: bool,
    mla: bool,
    kv_world: u32,
    tp: u32,
}

impl Plan {
    fn of(a: &BenchArgs) -> anyhow::Result<Self> {
        if a.mode == "gpu" {
            bail!("--mode gpu needs CUDA tensors; lmcache-rs bench runs --mode cpu");
        }
        if a.tp_size == 0 || a.tp_size > 255 {
            bail!("--tp-size must be in 1..=255, got {}", a.tp_size);
        }
        let (groups, notes) = shape::parse_with(&a.kvcache_shape_spec, a.num_blocks, a.block_size)
            .map_err(|e| anyhow::anyhow!("--kvcache-shape-spec: {e}"))?;
        // As LMCache's bench: the spec's positive NB and BS win, and it says so.
        if !a.quiet {
            for n in notes {
                eprintln!("  [info] {n}");
            }
        }
        let spec_mla = groups.iter().all(ShapeGroup::is_mla);
        if a.use_mla && !spec_mla {
            bail!("--use-mla needs a --kvcache-shape-spec whose groups have kv_size 1");
        }
        let mla = a.use_mla || spec_mla;
        let driven = a.transfer_mode == TransferMode::LmcacheDriven;
        if !driven && groups.len() > 1 {
            bail!(
                "engine_driven registers one geometry; a multi-group spec needs --transfer-mode lmcache_driven"
            );
        }
        let tp = a.tp_size;
        Ok(Self { groups, driven, mla, kv_world: if mla { 1 } else { tp }, tp })
    }

    fn bytes_per_token(&self) -> u64 {
        self.groups.iter().map(ShapeGroup::bytes_per_token).sum()
    }

    fn transfer_name(&self) -> &'static str {
        if self.driven { "lmcache_driven" } else { "engine_driven" }
    }
}

/// One layer tensor of a rank's lmcache-driven KV.
struct LayerKv {
    seg: ForeignSegment,
    _owner: ShmSegment,
    group: ShapeGroup,
}

impl LayerKv {
    /// Byte ranges of block `b` (one per K/V plane).
    fn block(&self, b: u64) -> impl Iterator<Item = u64> + '_ {
        let bb = self.group.block_bytes();
        (0..self.group.kv_size).map(move |p| (p * self.group.num_blocks + b) * bb)
    }
}

enum Kv {
    Engine { pool: ForeignSegment },
    Driven { layers: Vec<LayerKv> },
}

struct Rank {
    instance_id: u64,
    kv_worker: u32,
    stores: bool,
    kv: Kv,
}

/// The byte written at `i` of the KV of (sequence, kv worker, layer, block of the request,
/// plane): a mixing hash of all six (splitmix64's finalizer), so that two different blocks,
/// however their coordinates trade off, never hold the same bytes (an additive pattern made
/// some swapped blocks compare equal); never 0, so an unwritten destination never matches.
fn pattern(seq: u32, worker: u32, layer: u64, block: u64, plane: u64, i: u64) -> u8 {
    let mut h = mix(u64::from(seq) ^ 0x6c6d_6361_6368_6552);
    for c in [u64::from(worker), layer, block, plane, i] {
        h = mix(h ^ c);
    }
    match (h >> 24) as u8 {
        0 => 1,
        b => b,
    }
}

/// splitmix64's output function: every input bit flips about half the output bits.
fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// `len` bytes of [`pattern`] from `i = 0` (it repeats every 256 bytes: built by copies).
fn fill(seq: u32, worker: u32, layer: u64, block: u64, plane: u64, len: u64) -> Vec<u8> {
    let period: Vec<u8> = (0..256).map(|i| pattern(seq, worker, layer, block, plane, i)).collect();
    let mut out = Vec::with_capacity(len as usize);
    while out.len() + 256 <= len as usize {
        out.extend_from_slice(&period);
    }
    let rest = len as usize - out.len();
    out.extend_from_slice(&period[..rest]);
    out
}

fn shm_name(client: u32, rank: u32, layer: u64) -> String {
    format!("lmcache_rs_bench_{}_{client}_{rank}_{layer}", std::process::id())
}

fn setup_rank(
    plan: &Plan,
    c: &mut Client,
    client: u32,
    rank: u32,
    model: &ModelName,
) -> anyhow::Result<Rank> {
    let instance_id = INSTANCE_BASE + u64::from(client) * 256 + u64::from(rank);
    let kv_worker = if plan.mla { 0 } else { rank };
    let stores = !plan.mla || rank == 0;
    let kv = if plan.driven {
        let mut layers = Vec::new();
        let mut descs = Vec::new();
        for g in &plan.groups {
            for _ in 0..g.layers {
                let name = shm_name(client, rank, layers.len() as u64);
                let bytes = g.layer_bytes();
                let owner = ShmSegment::create(&name, bytes)
                    .with_context(|| format!("creating KV segment {name}"))?;
                let seg = ForeignSegment::open(&name, bytes)
                    .with_context(|| format!("mapping {name}"))?;
                let shape = g.tensor_shape();
                let mut stride = vec![1u64; shape.len()];
                for d in (0..shape.len() - 1).rev() {
                    stride[d] = stride[d + 1] * shape[d + 1];
                }
                descs.push(IpcDescriptor::CpuShm {
                    shm_name: name,
                    nbytes: bytes,
                    meta: TensorMeta {
                        dtype: g.dtype,
                        shape,
                        stride,
                        storage_offset: 0,
                        device_uuid: "cpu".into(),
                    },
                });
                layers.push(LayerKv { seg, _owner: owner, group: g.clone() });
            }
        }
        // One engine group per geometry (the server's kernel groups), layers in order.
        let mut next = 0u64;
        let infos: Vec<EngineGroupInfo> = plan
            .groups
            .iter()
            .enumerate()
            .map(|(i, g)| {
                let layers: Vec<u64> = (next..next + g.layers).collect();
                next += g.layers;
                EngineGroupInfo::full(i as i64, layers, g.block_size)
            })
            .collect();
        c.register_kv_cache(instance_id, &descs, model.as_str(), plan.kv_world, &infos)
            .with_context(|| format!("register_kv_cache of rank {rank}"))?;
        Kv::Driven { layers }
    } else {
        let g = &plan.groups[0];
        let registration = EngineDrivenRegistration {
            instance_id,
            model_name: model.clone(),
            world_size: plan.kv_world,
            block_size: g.block_size,
            num_layers: g.layers,
            hidden_dim_size: g.num_heads * g.head_size,
            dtype: g.dtype,
            use_mla: plan.mla,
            num_physical_slots: None,
        };
        let pool = c
            .register_engine_driven(&registration)
            .context("registering the engine-driven context")?;
        if pool.shm_name.is_empty() {
            bail!("the server advertises no shared-memory pool");
        }
        let seg = ForeignSegment::open(&pool.shm_name, pool.pool_size)
            .context("mapping the server's pool")?;
        Kv::Engine { pool: seg }
    };
    Ok(Rank { instance_id, kv_worker, stores, kv })
}

struct Client1<'a> {
    a: &'a BenchArgs,
    plan: &'a Plan,
    c: Client,
    ranks: Vec<Rank>,
    chunk: usize,
    model: ModelName,
}

impl Client1<'_> {
    fn key(&self, id: &str, tokens: &[u32]) -> CacheKey {
        let mut k = CacheKey::whole(self.model.clone(), id, tokens.to_vec(), self.chunk);
        k.world_size = self.plan.kv_world;
        k.num_kv_readers = if self.plan.mla { self.plan.tp } else { 1 };
        k
    }

    /// The engine's part before a store, not timed: the KV of sequence `s` as it computed
    /// it (lmcache-driven: written into the rank's source blocks; engine-driven: one buffer
    /// per chunk, copied into the pool during the store).
    fn compute(
        &self,
        r: usize,
        s: u32,
        nblk: u64,
        chunks: usize,
        chunk_bytes: u64,
    ) -> anyhow::Result<Vec<Vec<u8>>> {
        let rank = &self.ranks[r];
        match &rank.kv {
            Kv::Engine { .. } => Ok((0..chunks as u64)
                .map(|i| fill(s, rank.kv_worker, 0, i, 0, chunk_bytes))
                .collect()),
            Kv::Driven { layers } => {
                for (l, layer) in layers.iter().enumerate() {
                    let bb = layer.group.block_bytes();
                    for b in 0..nblk {
                        for (p, off) in layer.block(b).enumerate() {
                            layer
                                .seg
                                .write(off, &fill(s, rank.kv_worker, l as u64, b, p as u64, bb))?;
                        }
                    }
                }
                Ok(Vec::new())
            }
        }
    }

    /// Stores one rank's KV; returns the bytes moved and whether it was stored.
    fn store(
        &mut self,
        r: usize,
        key: &CacheKey,
        nblk: u64,
        data: &[Vec<u8>],
    ) -> anyhow::Result<(u64, bool)> {
        let rank = &self.ranks[r];
        let k = key.for_worker(rank.kv_worker);
        match &rank.kv {
            Kv::Engine { pool } => {
                let mut bytes = 0;
                for (i, slot) in self.c.prepare_store(&k, rank.instance_id)? {
                    let src = data.get(i as usize).map(Vec::as_slice).unwrap_or_default();
                    let n = (slot.length as usize).min(src.len());
                    pool.write(slot.offset, &src[..n])?;
                    bytes += slot.length;
                }
                Ok((bytes, self.c.commit_store(&k, rank.instance_id)?))
            }
            Kv::Driven { layers } => {
                let bytes: u64 =
                    layers.iter().map(|l| l.group.kv_size * l.group.block_bytes() * nblk).sum();
                let lists = vec![(0..nblk).collect::<Vec<u64>>(); self.plan.groups.len()];
                let req = lmcache_client::Store {
                    key: k.clone(),
                    instance_id: rank.instance_id,
                    block_ids: lists,
                    event_ipc_handle: Vec::new(),
                };
                Ok((bytes, self.c.store(req)?))
            }
        }
    }

    /// Clears the destination blocks of a lmcache-driven retrieve (not timed).
    fn clear(&self, r: usize, nblk: u64) -> anyhow::Result<()> {
        if let Kv::Driven { layers } = &self.ranks[r].kv {
            for layer in layers {
                let zero = vec![0u8; layer.group.block_bytes() as usize];
                for b in nblk..2 * nblk {
                    for off in layer.block(b) {
                        layer.seg.write(off, &zero)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Retrieves one rank's KV (engine-driven: copied out of the pool into `out`, one buffer
    /// per chunk; lmcache-driven: into the blocks after the source ones). Returns the bytes
    /// moved and whether the server served every chunk.
    fn retrieve(
        &mut self,
        r: usize,
        key: &CacheKey,
        nblk: u64,
        chunks: usize,
        out: &mut Vec<Vec<u8>>,
    ) -> anyhow::Result<(u64, bool)> {
        let rank = &self.ranks[r];
        let k = key.for_worker(rank.kv_worker);
        match &rank.kv {
            Kv::Engine { pool } => {
                let Some(slots) = self.c.prepare_retrieve(&k, rank.instance_id)? else {
                    self.c.commit_retrieve(&k, rank.instance_id)?;
                    return Ok((0, false));
                };
                let mut bytes = 0;
                out.clear();
                for slot in &slots {
                    let mut buf = vec![0u8; slot.length as usize];
                    pool.read(slot.offset, &mut buf)?;
                    bytes += slot.length;
                    out.push(buf);
                }
                Ok((bytes, self.c.commit_retrieve(&k, rank.instance_id)? && slots.len() == chunks))
            }
            Kv::Driven { layers } => {
                let bytes: u64 =
                    layers.iter().map(|l| l.group.kv_size * l.group.block_bytes() * nblk).sum();
                let lists = vec![(nblk..2 * nblk).collect::<Vec<u64>>(); self.plan.groups.len()];
                let req = lmcache_client::Retrieve {
                    key: k.clone(),
                    instance_id: rank.instance_id,
                    block_ids: lists,
                    event_ipc_handle: Vec::new(),
                    skip_first_n_tokens: 0,
                };
                Ok((bytes, self.c.retrieve(req)?))
            }
        }
    }

    /// Whether what rank `r` retrieved is, byte for byte, what its KV worker stored (not
    /// timed).
    fn verify(&self, r: usize, s: u32, nblk: u64, got: &[Vec<u8>]) -> anyhow::Result<bool> {
        let rank = &self.ranks[r];
        match &rank.kv {
            Kv::Engine { .. } => Ok(got
                .iter()
                .enumerate()
                .all(|(i, buf)| *buf == fill(s, rank.kv_worker, 0, i as u64, 0, buf.len() as u64))),
            Kv::Driven { layers } => {
                for (l, layer) in layers.iter().enumerate() {
                    let bb = layer.group.block_bytes();
                    let mut buf = vec![0u8; bb as usize];
                    for b in 0..nblk {
                        for (p, off) in layer.block(nblk + b).enumerate() {
                            layer.seg.read(off, &mut buf)?;
                            if buf != fill(s, rank.kv_worker, l as u64, b, p as u64, bb) {
                                return Ok(false);
                            }
                        }
                    }
                }
                Ok(true)
            }
        }
    }

    fn unregister(&mut self) {
        for r in &self.ranks {
            let op = match r.kv {
                Kv::Engine { .. } => Op::UnregisterKvCacheEngineDrivenContext,
                Kv::Driven { .. } => Op::UnregisterKvCache,
            };
            let _ = self.c.call(op, &[Value::from(r.instance_id)]);
        }
    }
}

#[derive(Default)]
struct Counts {
    cold_miss: u32,
    warm_hit: u32,
    bytes_ok: u32,
    requests: u32,
}

fn client(
    a: &BenchArgs,
    plan: &Plan,
    index: u32,
    seqs: Vec<u32>,
    t: &Tracker,
) -> anyhow::Result<Counts> {
    let mut c = Client::connect(&a.rpc_url, Duration::from_secs(a.timeout_seconds))?;
    let chunk = c.get_chunk_size().context("get_chunk_size")? as usize;
    let model = ModelName::new(&a.model).map_err(|e| anyhow::anyhow!("--model: {e}"))?;
    let mut ranks = Vec::new();
    for r in 0..plan.tp {
        ranks.push(setup_rank(plan, &mut c, index, r, &model)?);
    }
    let mut me = Client1 { a, plan, c, ranks, chunk, model };
    let result = run_client(&mut me, seqs, t);
    me.unregister();
    result
}

fn run_client(me: &mut Client1<'_>, seqs: Vec<u32>, t: &Tracker) -> anyhow::Result<Counts> {
    let mut n = Counts::default();
    let bs = me.plan.groups[0].block_size;
    let nb = me.plan.groups[0].num_blocks;
    for s in seqs {
        let mut tokens = vec![s];
        tokens.extend(std::iter::repeat_n(9906u32, me.a.num_tokens));
        let chunks = tokens.len() / me.chunk;
        let nblk = (chunks * me.chunk) as u64 / bs;
        if me.plan.driven && 2 * nblk > nb {
            bail!(
                "a request of {chunks} chunks needs {} blocks (source and destination); the spec has {nb}",
                2 * nblk
            );
        }
        let cold = me.key(&format!("req-{s}-cold"), &tokens);
        let (_, miss) = t.time(0, || me.c.lookup(&cold).map(|h| (0, h == 0)))?;
        n.cold_miss += u32::from(miss);
        let chunk_bytes = me.chunk as u64 * me.plan.bytes_per_token();
        let mut computed = Vec::new();
        for r in 0..me.ranks.len() {
            if me.ranks[r].stores {
                computed.push((r, me.compute(r, s, nblk, chunks, chunk_bytes)?));
            }
        }
        let (_, stored) = t.time(1, || -> anyhow::Result<(u64, bool)> {
            let (mut bytes, mut ok) = (0, true);
            for (r, data) in &computed {
                let (b, o) = me.store(*r, &cold, nblk, data)?;
                bytes += b;
                ok &= o;
            }
            Ok((bytes, ok))
        })?;
        me.c.end_session(&cold.request_id)?;
        let warm = me.key(&format!("req-{s}-warm"), &tokens);
        let (_, hit) = t.time(2, || me.c.lookup(&warm).map(|h| (0, h as usize == chunks)))?;
        n.warm_hit += u32::from(hit);
        for r in 0..me.ranks.len() {
            me.clear(r, nblk)?;
        }
        let mut got: Vec<Vec<Vec<u8>>> = vec![Vec::new(); me.ranks.len()];
        let (_, served) = t.time(3, || -> anyhow::Result<(u64, bool)> {
            let (mut bytes, mut ok) = (0, true);
            for (r, out) in got.iter_mut().enumerate() {
                let (b, o) = me.retrieve(r, &warm, nblk, chunks, out)?;
                bytes += b;
                ok &= o;
            }
            Ok((bytes, ok))
        })?;
        let mut right = served && stored;
        for (r, out) in got.iter().enumerate() {
            right &= me.verify(r, s, nblk, out)?;
        }
        n.bytes_ok += u32::from(right);
        me.c.end_session(&warm.request_id)?;
        n.requests += 1;
        t.step();
        if me.a.interval > 0.0 {
            std::thread::sleep(Duration::from_secs_f64(me.a.interval));
        }
    }
    Ok(n)
}

/// LMCache's terminal report layout (width 64): `===== title =====`, `---- section ----`,
/// then `label:` and the value right-aligned.
pub fn render(title: &str, sections: &[(&str, Vec<(String, String)>)]) -> String {
    let w: usize = 64;
    let centered = |s: &str, fill: char| {
        let s = format!(" {s} ");
        let pad = w.saturating_sub(s.chars().count());
        let left = pad / 2;
        format!("{}{s}{}", fill.to_string().repeat(left), fill.to_string().repeat(pad - left))
    };
    let mut out = centered(title, '=') + "\n";
    for (name, rows) in sections {
        out += &(centered(name, '-') + "\n");
        for (k, v) in rows {
            let k = format!("{k}:");
            let pad = w.saturating_sub(k.chars().count());
            out += &format!("{k}{v:>pad$}\n");
        }
    }
    out += &"=".repeat(w);
    out.push('\n');
    out
}

/// Runs the benchmark.
pub fn run(a: BenchArgs) -> anyhow::Result<()> {
    if a.end <= a.start || a.concurrency == 0 {
        bail!("need --end > --start and --concurrency >= 1");
    }
    if !(a.interval.is_finite() && a.interval >= 0.0) {
        bail!("--interval must be a number >= 0");
    }
    let plan = Plan::of(&a)?;
    let total = a.end - a.start;
    let tracker = Tracker::new(&OPS, Some(u64::from(total)), "requests");
    let title = format!(
        "bench server {} tp={}{} {}",
        plan.transfer_name(),
        plan.tp,
        if plan.mla { " mla" } else { "" },
        a.rpc_url
    );
    let live =
        Live::start(tracker.clone(), title, !a.quiet && matches!(a.format, Format::Terminal));
    let results: Vec<anyhow::Result<Counts>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..a.concurrency)
            .map(|w| {
                let seqs: Vec<u32> = (a.start..a.end).filter(|s| s % a.concurrency == w).collect();
                let (a, plan, t) = (&a, &plan, &*tracker);
                scope.spawn(move || client(a, plan, w, seqs, t))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| bail!("a client panicked")))
            .collect()
    });
    live.finish();
    let wall = tracker.elapsed();
    let mut all = Counts::default();
    for r in results {
        let n = r?;
        all.cold_miss += n.cold_miss;
        all.warm_hit += n.warm_hit;
        all.bytes_ok += n.bytes_ok;
        all.requests += n.requests;
    }
    let figs = tracker.figures();
    let mut ops = serde_json::Map::new();
    for (name, f) in OPS.iter().zip(&figs) {
        ops.insert((*name).into(), serde_json::to_value(f)?);
    }
    // LMCache names each figure after its section: cold_store_p50, warm_retrieve_mean, ...
    let lat = |i: usize| {
        let f = &figs[i];
        let section = ["cold_lookup", "cold_store", "warm_lookup", "warm_retrieve"][i];
        let mut m = serde_json::Map::new();
        for (name, v) in [
            ("count", json!(f.count)),
            ("mean", json!(round3(f.mean_ms))),
            ("min", json!(round3(f.min_ms))),
            ("max", json!(round3(f.max_ms))),
            ("p50", json!(round3(f.p50_ms))),
            ("p99", json!(round3(f.p99_ms))),
        ] {
            m.insert(format!("{section}_{name}"), v);
        }
        serde_json::Value::Object(m)
    };
    let pass = if all.requests > 0 {
        f64::from(all.bytes_ok) / f64::from(all.requests) * 100.0
    } else {
        0.0
    };
    let doc = json!({
        // LMCache's metrics document.
        "title": "Server Bench Result",
        "metrics": {
            "config": {"rpc_url": a.rpc_url, "mode": a.mode, "transfer_mode": plan.transfer_name(),
                       "num_tokens": a.num_tokens, "interval": a.interval, "tp_size": plan.tp,
                       "use_mla": plan.mla, "kvcache_shape_spec": a.kvcache_shape_spec},
            "results": {"total_requests": all.requests, "checksum_ok": all.bytes_ok,
                        "checksum_fail": all.requests - all.bytes_ok, "pass_rate": (pass * 100.0).round() / 100.0},
            "cold_lookup": lat(0), "cold_store": lat(1), "warm_lookup": lat(2), "warm_retrieve": lat(3),
        },
        // Ours.
        "rpc_url": a.rpc_url,
        "requests": all.requests,
        "concurrency": a.concurrency,
        "tp_size": plan.tp,
        "transfer_mode": plan.transfer_name(),
        "use_mla": plan.mla,
        "bytes_per_token": plan.bytes_per_token(),
        "wall_seconds": wall,
        "requests_per_second": f64::from(all.requests) / wall,
        "cold_full_miss": all.cold_miss,
        "warm_full_hit": all.warm_hit,
        "bytes_match": all.bytes_ok,
        "store_gb_per_s": figs[1].gb_per_s,
        "retrieve_gb_per_s": figs[3].gb_per_s,
        "ops": ops,
    });
    if let Some(path) = &a.output {
        std::fs::write(path, serde_json::to_string_pretty(&doc)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(path) = &a.csv {
        std::fs::write(path, tracker.to_csv())
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(path) = &a.plot {
        let title = format!(
            "bench server: {} tp={}{}, {} tokens/request, {} requests, concurrency {}",
            plan.transfer_name(),
            plan.tp,
            if plan.mla { " (MLA)" } else { "" },
            a.num_tokens,
            all.requests,
            a.concurrency
        );
        live::plot(&tracker, &title, path)?;
    }
    if !a.quiet {
        match a.format {
            Format::Json => println!("{}", serde_json::to_string_pretty(&doc)?),
            Format::Terminal => print_report(&a, &plan, &all, &figs, wall, pass),
        }
    }
    if all.cold_miss != all.requests || all.warm_hit != all.requests || all.bytes_ok != all.requests
    {
        bail!("correctness checks failed (see above)");
    }
    Ok(())
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

fn print_report(
    a: &BenchArgs,
    plan: &Plan,
    all: &Counts,
    figs: &[live::OpFigures],
    wall: f64,
    pass: f64,
) {
    let kv = |k: &str, v: String| (k.to_owned(), v);
    let lat = |f: &live::OpFigures| {
        vec![
            kv("count", f.count.to_string()),
            kv("mean", format!("{:.2}", f.mean_ms)),
            kv("min", format!("{:.2}", f.min_ms)),
            kv("max", format!("{:.2}", f.max_ms)),
            kv("p50", format!("{:.2}", f.p50_ms)),
            kv("p99", format!("{:.2}", f.p99_ms)),
        ]
    };
    let sections = vec![
        (
            "Configuration",
            vec![
                kv("RPC URL", a.rpc_url.clone()),
                kv("Mode", a.mode.clone()),
                kv("Transfer mode", plan.transfer_name().into()),
                kv("TP size", format!("{}{}", plan.tp, if plan.mla { " (MLA)" } else { "" })),
                kv("Tokens / request", a.num_tokens.to_string()),
                kv("Interval (s)", format!("{:.2}", a.interval)),
                kv("Concurrency", a.concurrency.to_string()),
            ],
        ),
        (
            "Results",
            vec![
                kv("Total requests", all.requests.to_string()),
                kv("Checksum OK", all.bytes_ok.to_string()),
                kv("Checksum FAIL", (all.requests - all.bytes_ok).to_string()),
                kv("Pass rate (%)", format!("{pass:.2}")),
                kv("Cold full miss", format!("{}/{}", all.cold_miss, all.requests)),
                kv("Warm full hit", format!("{}/{}", all.warm_hit, all.requests)),
                kv("Requests / s", format!("{:.2}", f64::from(all.requests) / wall)),
                kv("Store GB/s", format!("{:.2}", figs[1].gb_per_s)),
                kv("Retrieve GB/s", format!("{:.2}", figs[3].gb_per_s)),
            ],
        ),
        ("Cold Lookup (ms)", lat(&figs[0])),
        ("Cold Store (ms)", lat(&figs[1])),
        ("Warm Lookup (ms)", lat(&figs[2])),
        ("Warm Retrieve (ms)", lat(&figs[3])),
    ];
    print!("{}", render("Server Bench Result", &sections));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_report_has_lmcaches_layout() {
        let r = render(
            "Server Bench Result",
            &[("Results", vec![("Total requests".into(), "3".into())])],
        );
        let lines: Vec<&str> = r.lines().collect();
        assert_eq!(lines[0], "===================== Server Bench Result ======================");
        assert_eq!(lines[1], "--------------------------- Results ----------------------------");
        assert_eq!(lines[2], "Total requests:                                                3");
        assert!(lines.iter().all(|l| l.chars().count() == 64));
    }

    #[test]
    fn patterns_differ_by_every_coordinate_and_are_never_zero() {
        let base = pattern(1, 0, 0, 0, 0, 0);
        assert_ne!(base, pattern(2, 0, 0, 0, 0, 0));
        assert_ne!(base, pattern(1, 1, 0, 0, 0, 0));
        assert_ne!(base, pattern(1, 0, 1, 0, 0, 0));
        assert_ne!(base, pattern(1, 0, 0, 1, 0, 0));
        assert_ne!(base, pattern(1, 0, 0, 0, 1, 0));
        assert!((0..1000).all(|i| pattern(3, 1, 2, 4, 1, i) != 0));
    }

    #[test]
    fn no_two_blocks_of_a_run_hold_the_same_bytes() {
        // 20 sequences x 2 workers x 32 layers x 16 blocks x 2 planes: every block's 256-byte
        // period is distinct, so a block swapped with any other never compares equal.
        let mut seen = std::collections::HashSet::new();
        for seq in 0..20 {
            for worker in 0..2 {
                for layer in 0..32 {
                    for block in 0..16 {
                        for plane in 0..2 {
                            let period = fill(seq, worker, layer, block, plane, 256);
                            assert!(
                                seen.insert(period),
                                "block ({seq}, {worker}, {layer}, {block}, {plane}) repeats another"
                            );
                        }
                    }
                }
            }
        }
        // The additive pattern this replaced failed here: layer 13 of block 0 equalled
        // layer 0 of block 7.
        assert_ne!(fill(0, 0, 13, 0, 0, 256), fill(0, 0, 0, 7, 0, 256));
    }
}
