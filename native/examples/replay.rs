//! The index bench's workload replayed inside Rust, for profilers (callgrind counts
//! instructions repeatably on a busy box; perf samples where time goes):
//!
//! ```text
//! uv run --frozen --group bench python -m benchmarks.index_bench --dump /tmp/wl.bin
//! cargo build --release --example replay --manifest-path native/Cargo.toml
//! valgrind --tool=callgrind --toggle-collect='switchyard_native::index::NativeIndex::apply' \
//!     native/target/release/examples/replay /tmp/wl.bin 1
//! ```
//!
//! Arguments: the dump, the number of rounds (default 5). Each round folds every record into a
//! fresh index, answering each query just before its request's first record, as the bench's
//! match pass does. `--dump` writes `u64 n, n x (u32 len, envelope bytes), u64 q, q x (u64
//! first record, u32 len, len x u64 hash)`, little-endian, and the index's hash algorithm and
//! block size after them (`u32 len, algo, i64 block size`).

use std::time::Instant;

use switchyard_native::envelope;
use switchyard_native::index::{Matches, NativeIndex};

struct Dump {
    records: Vec<Vec<u8>>,
    queries: Vec<(usize, Vec<u64>)>,
    hash_algo: String,
    block_size: i64,
}

/// Little-endian reads from a byte buffer.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn bytes(&mut self, n: usize) -> &'a [u8] {
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        s
    }

    fn uint(&mut self, n: usize) -> u64 {
        let mut b = [0u8; 8];
        b[..n].copy_from_slice(self.bytes(n));
        u64::from_le_bytes(b)
    }
}

fn read(path: &str) -> Dump {
    let data = std::fs::read(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let mut c = Cursor { buf: &data, pos: 0 };
    let n = c.uint(8) as usize;
    let records = (0..n)
        .map(|_| {
            let l = c.uint(4) as usize;
            c.bytes(l).to_vec()
        })
        .collect();
    let nq = c.uint(8) as usize;
    let queries = (0..nq)
        .map(|_| {
            let first = c.uint(8) as usize;
            let l = c.uint(4) as usize;
            (first, (0..l).map(|_| c.uint(8)).collect())
        })
        .collect();
    let l = c.uint(4) as usize;
    let hash_algo = String::from_utf8(c.bytes(l).to_vec()).expect("a UTF-8 hash algorithm");
    let block_size = c.uint(8) as i64;
    Dump { records, queries, hash_algo, block_size }
}

fn main() {
    let mut args = std::env::args().skip(1);
    let path = args.next().expect("usage: replay DUMP [ROUNDS]");
    let rounds: usize = args.next().map_or(5, |s| s.parse().expect("ROUNDS is a number"));
    let dump = read(&path);
    let (mut apply_best, mut match_best) = (f64::MAX, f64::MAX);
    for _ in 0..rounds {
        let mut idx = NativeIndex::new(&dump.hash_algo, dump.block_size);
        let (mut hashes, mut m) = (Vec::new(), Matches::default());
        let (mut apply_ns, mut match_ns, mut qi, mut skipped) = (0u128, 0u128, 0, 0);
        for (i, r) in dump.records.iter().enumerate() {
            while qi < dump.queries.len() && dump.queries[qi].0 <= i {
                let t = Instant::now();
                idx.find_matches(&dump.queries[qi].1, &mut m);
                match_ns += t.elapsed().as_nanos();
                qi += 1;
            }
            let t = Instant::now();
            match envelope::decode(r, &mut hashes) {
                Some(rec) => {
                    let ev = rec.event(&hashes);
                    idx.apply(rec.producer, rec.epoch, rec.seq, &ev);
                }
                None => skipped += 1,
            }
            apply_ns += t.elapsed().as_nanos();
        }
        assert_eq!(skipped, 0, "records the native decoder does not take");
        apply_best = apply_best.min(apply_ns as f64 / dump.records.len() as f64);
        match_best = match_best.min(match_ns as f64 / qi.max(1) as f64);
        println!(
            "apply {:.0} ns/event, match {:.0} ns/query; {} distinct hashes, {:.1} bytes per entry",
            apply_ns as f64 / dump.records.len() as f64,
            match_ns as f64 / qi.max(1) as f64,
            idx.len(),
            idx.structure_bytes() as f64 / idx.entries().max(1) as f64
        );
    }
    println!("RESULT apply_ns_per_event={apply_best:.0} match_ns_per_query={match_best:.0} rounds={rounds}");
}
