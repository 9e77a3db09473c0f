//! Feeds arbitrary bytes to the archive reader: tar walking, gzip/zstd
//! decompression, path checks and metadata parsing, with a discarding sink
//! (no containerd). Any panic, hang or runaway allocation is a bug.
#![no_main]

use imgbridge::import::archive::{read_archive, DiscardSink, Limits, ReadOptions};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let opts = ReadOptions {
        limits: Limits {
            // Small caps keep each run fast; the logic is the same.
            max_decompressed: 16 << 20,
            metadata: 1 << 20,
            metadata_budget: 4 << 20,
            ..Limits::default()
        },
        hash_input: true,
    };
    let mut sink = DiscardSink::default();
    if let Ok(plan) = read_archive(data, &opts, &mut sink, &mut |_| {}) {
        for img in &plan.images {
            assert!(!img.names.is_empty());
            assert!(img.blobs.iter().any(|b| b.desc == img.target));
        }
    }
});
