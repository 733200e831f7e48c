//! The fleet directory's checkpoint image (`lmcache_directory::Directory::decode`): any bytes
//! decode or are refused by name, never a panic. An image that decodes answers listings,
//! placements and routing queries over its own keys without a panic, and encodes to bytes that
//! decode to the same directory (equal digests and totals). The input is also tried after the
//! magic (`LMRSDIR2`), so the fuzzer reaches the tables and records at once.
#![no_main]

use libfuzzer_sys::fuzz_target;
use lmcache_directory::{Directory, DirectoryConfig, KeyFilter, RunQuery};

fuzz_target!(|data: &[u8]| {
    let mut framed = b"LMRSDIR2".to_vec();
    framed.extend_from_slice(data);
    for image in [data, &framed[..]] {
        let Ok(d) = Directory::decode(image, DirectoryConfig::default()) else { continue };
        let (_, page) = d.list(&KeyFilter::default(), 0, 64);
        let keys: Vec<_> = page.iter().map(|(k, _)| *k).collect();
        for k in &keys {
            let _ = d.placements(k);
        }
        let _ = d.prefix_runs(RunQuery { keys: &keys, per_chunk: 1 });
        let mut again = Vec::new();
        d.encode(&mut again);
        let back = Directory::decode(&again, DirectoryConfig::default())
            .expect("an image this directory wrote decodes");
        assert_eq!(back.digest(), d.digest(), "a re-encoded image holds the same placements");
        assert_eq!(back.stats(), d.stats(), "and the same totals");
    }
});
