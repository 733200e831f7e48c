//! What CacheBlend tells operators: LMCache's blend events (typed), its `lmcache_blend_*`
//! metrics and its `cb.*` trace spans.
//!
//! The handlers emit [`BlendEvent`]s through one door, [`BlendTelemetry::emit`], which
//! counts them into the metrics and queues them on the event bus (never blocking). Spans
//! follow LMCache's tree: a root `cb.request` per request, opened by its first unified lookup
//! and closed with its session (or at once when the lookup found nothing to retrieve);
//! `cb.lookup` (from the first poll to the answer) over `cb.fingerprint_match`,
//! `cb.prefix_lookup`, `cb.coordinator_match` and `cb.sparse_prefetch`; `cb.retrieve` over
//! `cb.scatter`; and instant spans `cb.fingerprints.registered`, `cb.chunks.evicted` and
//! `cb.retrieve.noop`. They reach an OpenTelemetry collector with `--otlp-endpoint`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::event_bus::{Event, Publisher};
use crate::metrics::{BlendMetrics, Metrics, ReasonLabel};

/// Why a retrieve scattered nothing (LMCache's `RetrieveReason`s that reach an answer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoopReason {
    /// Every match was scattered already for this request and worker.
    AlreadyApplied,
    /// Every match lies past the block table (a later call scatters them).
    MatchesBeyondAlloc,
    /// Some matches lie inside the block table and some past it (the engine recomputes).
    MatchesStraddleAlloc,
    /// No match to scatter.
    NoObjectKeys,
}

impl NoopReason {
    /// LMCache's label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::AlreadyApplied => "already_applied",
            Self::MatchesBeyondAlloc => "matches_beyond_alloc",
            Self::MatchesStraddleAlloc => "matches_straddle_alloc",
            Self::NoObjectKeys => "no_object_keys",
        }
    }

    /// The retrieve's answer for it (whether the engine may use what it asked for).
    pub fn scatter_ran(self) -> bool {
        !matches!(self, Self::MatchesStraddleAlloc)
    }
}

/// A unified lookup's outcome, in tokens and chunks (LMCache's `CB_LOOKUP_END`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LookupOutcome {
    /// Whole-chunk tokens of the prompt.
    pub requested_tokens: u64,
    /// The prefix the ordinary lookup found.
    pub prefix_tokens: u64,
    /// Unique tokens of the kept non-prefix matches.
    pub non_prefix_tokens: u64,
    /// Tokens of the segmented-prefix tail.
    pub segmented_tokens: u64,
    /// Matches past the prefix found in storage and kept (LMCache counts these as its
    /// fingerprint hits and its storage hits alike).
    pub found: u64,
    /// Matches past the prefix not kept: missing from storage, or overlapped.
    pub stale: u64,
    /// No worker of the model registered: nothing could be matched.
    pub no_context: bool,
}

impl LookupOutcome {
    /// Tokens served in all.
    pub fn hit_tokens(&self) -> u64 {
        self.prefix_tokens + self.non_prefix_tokens + self.segmented_tokens
    }
}

/// A scatter's work (LMCache's `CB_SCATTER_START` figures).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ScatterWork {
    /// Tokens written.
    pub tokens: u64,
    /// Chunks written at their stored positions.
    pub prefix_chunks: u64,
    /// Chunks re-rotated.
    pub shifted_chunks: u64,
}

/// CacheBlend's events, as LMCache's `CB_*` event types carry them.
#[derive(Debug, Clone, PartialEq)]
pub enum BlendEvent {
    /// A store fingerprinted chunks.
    FingerprintsRegistered {
        /// The storing request.
        request_id: String,
        /// Chunks newly indexed.
        chunks: u64,
    },
    /// Fingerprints removed after their second stale lookup.
    ChunksEvicted {
        /// The request whose lookup struck them.
        request_id: String,
        /// Fingerprints removed.
        chunks: u64,
    },
    /// A unified lookup began (its first poll).
    LookupStarted {
        /// The request.
        request_id: String,
    },
    /// The local fingerprint match ran.
    FingerprintMatched {
        /// The request.
        request_id: String,
        /// Chunks matched.
        matches: u64,
        /// How long it took.
        took: Duration,
    },
    /// The prefix leg landed.
    PrefixLookedUp {
        /// The request.
        request_id: String,
        /// Leading chunks found.
        chunks: u64,
        /// From its start to its landing.
        took: Duration,
    },
    /// The coordinator's blend match answered or timed out.
    CoordinatorMatched {
        /// The request.
        request_id: String,
        /// Segments it returned.
        matches: u64,
        /// Whether its deadline passed first.
        timed_out: bool,
        /// From its start to its end.
        took: Duration,
    },
    /// The sparse prefetch of non-prefix matches from L2 landed.
    SparsePrefetched {
        /// The request.
        request_id: String,
        /// Keys it had to read from L2.
        l2_keys: u64,
        /// Of those, the keys now resident.
        found_keys: u64,
        /// From its start to its landing.
        took: Duration,
    },
    /// A unified lookup answered.
    LookupEnded {
        /// The request.
        request_id: String,
        /// What it found.
        outcome: LookupOutcome,
        /// From the first poll to the answer.
        took: Duration,
    },
    /// A retrieve answered without scattering.
    RetrieveNoop {
        /// The request.
        request_id: String,
        /// Why.
        reason: NoopReason,
        /// Matches it was asked for.
        matches: u64,
    },
    /// A retrieve scattered (or failed to).
    Retrieved {
        /// The request.
        request_id: String,
        /// Matches asked for.
        chunks: u64,
        /// What was written (nothing when it failed).
        work: ScatterWork,
        /// Matches dropped for lying past the block table.
        dropped: u64,
        /// Its answer.
        success: bool,
        /// The scatter alone.
        scatter: Duration,
        /// The whole retrieve.
        took: Duration,
    },
    /// A reorder plan was asked for.
    Reordered {
        /// Whether it reordered the prompt (`false`: keep it).
        reordered: bool,
    },
}

/// The door through which CacheBlend's events reach the metrics and the event bus.
#[derive(Debug, Clone)]
pub struct BlendTelemetry {
    metrics: Arc<Metrics>,
    bus: Option<Publisher>,
}

impl BlendTelemetry {
    /// Counting into `metrics` and publishing on `bus`.
    pub fn new(metrics: Arc<Metrics>, bus: Option<Publisher>) -> Self {
        Self { metrics, bus }
    }

    /// Counts `event` and queues it for the bus's subscribers.
    pub fn emit(&self, event: BlendEvent) {
        count(&self.metrics.blend, &event);
        if let Some(bus) = &self.bus {
            bus.publish(Event::Blend(event));
        }
    }
}

fn count(m: &BlendMetrics, event: &BlendEvent) {
    let ms = BlendMetrics::observe_ms;
    match event {
        BlendEvent::FingerprintsRegistered { chunks, .. } => {
            m.fingerprints_registered.inc_by(*chunks);
        }
        BlendEvent::ChunksEvicted { chunks, .. } => {
            m.chunks_evicted.inc_by(*chunks);
        }
        BlendEvent::LookupStarted { .. } => {
            m.lookup_requests.inc();
        }
        BlendEvent::FingerprintMatched { matches, took, .. } => {
            m.fingerprint_matches.inc_by(*matches);
            ms(&m.fingerprint_match_duration, *took);
        }
        BlendEvent::PrefixLookedUp { took, .. } => {
            ms(&m.prefix_lookup_duration, *took);
        }
        BlendEvent::CoordinatorMatched { matches, timed_out, took, .. } => {
            m.coordinator_matches.inc_by(*matches);
            if *timed_out {
                m.coordinator_match_timeouts.inc();
            }
            ms(&m.coordinator_match_duration, *took);
        }
        BlendEvent::SparsePrefetched { l2_keys, found_keys, took, .. } => {
            m.sparse_prefetch_l2_keys.inc_by(*l2_keys);
            m.sparse_prefetch_found_keys.inc_by(*found_keys);
            ms(&m.sparse_prefetch_duration, *took);
        }
        BlendEvent::LookupEnded { outcome: o, took, .. } => {
            m.lookup_requested_tokens.inc_by(o.requested_tokens);
            m.lookup_hit_tokens.inc_by(o.hit_tokens());
            m.lookup_prefix_hit_tokens.inc_by(o.prefix_tokens);
            m.lookup_non_prefix_hit_tokens.inc_by(o.non_prefix_tokens);
            m.lookup_segmented_prefix_hit_tokens.inc_by(o.segmented_tokens);
            m.lookup_fingerprint_hits.inc_by(o.found);
            m.lookup_storage_hits.inc_by(o.found);
            m.lookup_stale_chunks.inc_by(o.stale);
            if o.no_context {
                m.lookup_no_gpu_context_errors.inc();
            }
            ms(&m.lookup_duration, *took);
        }
        BlendEvent::RetrieveNoop { reason, .. } => {
            m.retrieve_noops.get_or_create(&ReasonLabel { reason: reason.as_str().into() }).inc();
        }
        BlendEvent::Retrieved { chunks, work, dropped, success, scatter, took, .. } => {
            m.retrieve_requests.inc();
            m.retrieve_chunks.inc_by(*chunks);
            if !success {
                m.retrieve_failures.inc();
            }
            m.scatter_tokens.inc_by(work.tokens);
            m.scatter_prefix_chunks.inc_by(work.prefix_chunks);
            m.scatter_shifted_chunks.inc_by(work.shifted_chunks);
            m.scatter_dropped_chunks.inc_by(*dropped);
            ms(&m.scatter_duration, *scatter);
            ms(&m.retrieve_duration, *took);
        }
        BlendEvent::Reordered { reordered } => {
            if *reordered {
                m.reorder_plans.inc();
            }
        }
    }
}

/// A phase of a request: its span and when it began.
#[derive(Debug)]
pub struct Phase {
    /// The open span (closed when dropped).
    pub span: tracing::Span,
    /// When the phase began.
    pub started: Instant,
}

impl Phase {
    /// Opens `span` now.
    pub fn begin(span: tracing::Span) -> Self {
        Self { span, started: Instant::now() }
    }

    /// How long it has run.
    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }
}

/// A request's open CacheBlend spans, kept in its session: the root `cb.request` and the
/// lookup's phases still running. Dropping it closes them.
#[derive(Debug)]
pub struct BlendTrace {
    /// `cb.request`: from the first unified lookup to the session's end.
    pub request: tracing::Span,
    /// `cb.lookup`, until the lookup answers.
    pub lookup: Option<Phase>,
    /// `cb.prefix_lookup`, until the prefix leg lands.
    pub prefix: Option<Phase>,
    /// `cb.coordinator_match`, until the coordinator answers or its deadline passes.
    pub coordinator: Option<Phase>,
    /// `cb.sparse_prefetch`, until the non-prefix chunks land.
    pub sparse: Option<Phase>,
}

impl BlendTrace {
    /// Opens a request's root span and its lookup.
    pub fn begin(request_id: &str, tokens: usize) -> Self {
        let request = tracing::info_span!(
            parent: None,
            "cb.request",
            request_id,
            hit_tokens = tracing::field::Empty,
            prefix_hit_tokens = tracing::field::Empty,
            non_prefix_hit_tokens = tracing::field::Empty,
            segmented_prefix_hit_tokens = tracing::field::Empty,
            requested_tokens = tracing::field::Empty,
            hit_rate = tracing::field::Empty,
        );
        let lookup = tracing::info_span!(parent: &request, "cb.lookup", num_tokens = tokens);
        Self {
            request,
            lookup: Some(Phase::begin(lookup)),
            prefix: None,
            coordinator: None,
            sparse: None,
        }
    }

    /// The lookup span, or the root's when the lookup has ended (children of a later poll).
    pub fn lookup_span(&self) -> &tracing::Span {
        self.lookup.as_ref().map_or(&self.request, |p| &p.span)
    }

    /// Records a lookup's outcome on the root span (LMCache's root attributes).
    pub fn record(&self, o: &LookupOutcome) {
        let r = &self.request;
        r.record("hit_tokens", o.hit_tokens());
        r.record("prefix_hit_tokens", o.prefix_tokens);
        r.record("non_prefix_hit_tokens", o.non_prefix_tokens);
        r.record("segmented_prefix_hit_tokens", o.segmented_tokens);
        r.record("requested_tokens", o.requested_tokens);
        if o.requested_tokens > 0 {
            r.record("hit_rate", o.hit_tokens() as f64 / o.requested_tokens as f64);
        }
    }
}

/// LMCache's instant spans: opened and closed at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InstantSpan {
    /// `cb.fingerprints.registered`.
    FingerprintsRegistered,
    /// `cb.chunks.evicted`.
    ChunksEvicted,
    /// `cb.retrieve.noop`.
    RetrieveNoop,
}

impl InstantSpan {
    /// Records it under `parent` (the current span without one), with its count.
    pub fn record(self, parent: Option<&tracing::Span>, count: u64) {
        let parent = parent.and_then(tracing::Span::id).or_else(|| tracing::Span::current().id());
        let span = match self {
            Self::FingerprintsRegistered => {
                tracing::info_span!(parent: parent, "cb.fingerprints.registered", count)
            }
            Self::ChunksEvicted => tracing::info_span!(parent: parent, "cb.chunks.evicted", count),
            Self::RetrieveNoop => tracing::info_span!(parent: parent, "cb.retrieve.noop", count),
        };
        drop(span);
    }
}
