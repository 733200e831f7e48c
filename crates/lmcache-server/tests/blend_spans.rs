//! CacheBlend's spans, over real ZMQ, heard by a process-wide subscriber (this binary holds
//! one test): a request's spans form LMCache's tree (`cb.request` over `cb.lookup` over its
//! legs, `cb.retrieve` over `cb.scatter` and `cb.retrieve.noop`), and close with it.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use std::time::Duration;

use lmcache_client::Client;
use parking_lot::Mutex;
use tracing_subscriber::layer::{Context, SubscriberExt};

mod common;
use common::blend::*;

/// A span heard: its name, its parent's name, and whether it has closed.
type Heard = (String, Option<String>, bool);

/// Every span opened, by id.
#[derive(Default)]
struct Spans {
    open: Mutex<HashMap<u64, Heard>>,
}

struct Recorder(Arc<Spans>);

impl<S> tracing_subscriber::Layer<S> for Recorder
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    fn on_new_span(&self, a: &tracing::span::Attributes<'_>, id: &tracing::Id, cx: Context<'_, S>) {
        let parent = cx.span(id).and_then(|s| s.parent()).map(|p| p.name().to_owned());
        let _ = a;
        let name = cx.span(id).map(|s| s.name().to_owned()).unwrap_or_default();
        self.0.open.lock().insert(id.into_u64(), (name, parent, false));
    }

    fn on_close(&self, id: tracing::Id, _: Context<'_, S>) {
        if let Some(e) = self.0.open.lock().get_mut(&id.into_u64()) {
            e.2 = true;
        }
    }
}

fn spans() -> Arc<Spans> {
    static S: OnceLock<Arc<Spans>> = OnceLock::new();
    S.get_or_init(|| {
        let s = Arc::new(Spans::default());
        let sub = tracing_subscriber::registry().with(Recorder(Arc::clone(&s)));
        tracing::subscriber::set_global_default(sub).unwrap();
        s
    })
    .clone()
}

#[test]
fn a_requests_spans_form_lmcaches_tree_and_close_with_it() {
    let rec = spans();
    let s = server("spans", None);
    let mut c = Client::connect(s.endpoint(), Duration::from_secs(30)).unwrap();
    let _segs = worker(&mut c, "spans");
    let d = seq(4, CHUNK);
    store(&mut c, "sp1", &[seq(1, CHUNK), d.clone()].concat());
    let p2: Vec<u32> = [seq(2, CHUNK), seq(9, 4), d, seq(8, 12)].concat();
    let (r, _) = unified(&mut c, "sq", &p2);
    assert_eq!(r.non_prefix_segments.len(), 1);
    // A table short of the match (beyond: a no-op), then the whole one.
    assert!(retrieve(&mut c, "sq", &p2, &r, (20..24).collect()));
    assert!(retrieve(&mut c, "sq", &p2, &r, (20..32).collect()));
    c.end_session("sq").unwrap();
    let all = rec.open.lock();
    let find = |name: &str| -> Vec<(Option<String>, bool)> {
        all.values().filter(|(n, _, _)| n == name).map(|(_, p, c)| (p.clone(), *c)).collect()
    };
    let parent_of = |name: &str| find(name).first().and_then(|(p, _)| p.clone());
    assert_eq!(find("cb.request").len(), 1, "one root per request");
    assert_eq!(parent_of("cb.request"), None, "cb.request is a root");
    assert_eq!(parent_of("cb.lookup").as_deref(), Some("cb.request"));
    for leg in ["cb.prefix_lookup", "cb.fingerprint_match"] {
        assert_eq!(parent_of(leg).as_deref(), Some("cb.lookup"), "{leg}");
    }
    assert_eq!(find("cb.retrieve").len(), 2);
    assert!(find("cb.retrieve").iter().all(|(p, _)| p.as_deref() == Some("cb.request")));
    assert_eq!(parent_of("cb.scatter").as_deref(), Some("cb.retrieve"));
    assert_eq!(parent_of("cb.retrieve.noop").as_deref(), Some("cb.retrieve"));
    assert_eq!(find("cb.fingerprints.registered").len(), 1);
    for (name, spans) in all.values().map(|(n, _, _)| (n.clone(), find(n))) {
        if name.starts_with("cb.") {
            assert!(spans.iter().all(|(_, closed)| *closed), "{name} left open");
        }
    }
}
