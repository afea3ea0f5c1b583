//! PyO3 bindings: a thin surface the Python wrapper (`control_plane/index/native.py`) builds the
//! reference's API on. Outcomes travel as small ints so the per-event path allocates nothing.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use crate::envelope;
use crate::signing;
use crate::index::{Event, MatchOut, NativeIndex, Outcome, Payload, COUNTER_NAMES, N_TIERS};

/// Outcome codes: 0 applied, 1 duplicate, 2 fenced, 3 ignored, 4/5/6 rejected for hash_algo /
/// block_size / cache_group; plus flag 8 = new epoch, 16 = gap.
fn code(r: crate::index::ApplyResult) -> u32 {
    let base = match r.outcome {
        Outcome::Applied => 0,
        Outcome::Duplicate => 1,
        Outcome::Fenced => 2,
        Outcome::Ignored => 3,
        Outcome::Rejected("hash_algo") => 4,
        Outcome::Rejected("block_size") => 5,
        Outcome::Rejected(_) => 6,
    };
    base | if r.new_epoch { 8 } else { 0 } | if r.gap { 16 } else { 0 }
}

// Send + Sync (no `unsendable`): processes build or restore an index on a worker thread and
// fold on the event loop. Concurrent use is refused by PyO3's borrow check, not undefined.
#[pyclass(module = "switchyard_native", name = "NativeIndex")]
struct PyIndex {
    inner: NativeIndex,
    hashes: Vec<u64>,
    producer: String,
    /// Worker id of the last record `apply_record` took.
    worker: String,
    matches: Vec<MatchOut>,
}

impl PyIndex {
    fn wrap(inner: NativeIndex) -> Self {
        PyIndex { inner, hashes: Vec::new(), producer: String::new(), worker: String::new(), matches: Vec::new() }
    }
}

#[pymethods]
impl PyIndex {
    #[new]
    fn new(hash_algo: &str, block_size: i64) -> Self {
        PyIndex::wrap(NativeIndex::new(hash_algo, block_size))
    }

    #[getter]
    fn hash_algo(&self) -> &str {
        &self.inner.hash_algo
    }

    #[getter]
    fn block_size(&self) -> i64 {
        self.inner.block_size
    }

    /// Fold one `kv` record from its envelope bytes; the sequencing producer is the envelope's
    /// producer followed by `suffix` (`"@<topic>:<partition>"`). None = not a record this path
    /// takes (the caller decodes it with the Python codec).
    fn apply_record(&mut self, data: &[u8], suffix: &str) -> Option<u32> {
        let mut hashes = std::mem::take(&mut self.hashes);
        let rec = envelope::decode(data, &mut hashes);
        let out = rec.map(|rec| {
            self.producer.clear();
            self.producer.push_str(rec.producer);
            self.producer.push_str(suffix);
            self.worker.clear();
            self.worker.push_str(rec.worker_id);
            let ev = rec.event(&hashes);
            code(self.inner.apply(&self.producer, rec.epoch, rec.seq, &ev))
        });
        self.hashes = hashes;
        out
    }

    /// Fold `values[start..]` in order (one partition's record values, sequenced with `suffix`)
    /// while each is a kv record this path takes and, given a `verifier`, carries its owner's
    /// signature. Returns `(i, code)`: the records before `i` were folded with plain outcomes
    /// (applied, duplicate, fenced, ignored); `code` None: record `i` was not touched (or `i` is
    /// the end) and the caller folds it through the per-record path; `code` Some: record `i` was
    /// folded with an outcome that needs words (a new epoch, a gap, a rejection).
    #[pyo3(signature = (values, start, suffix, verifier=None))]
    fn apply_run(
        &mut self,
        values: &Bound<'_, PyList>,
        start: usize,
        suffix: &str,
        mut verifier: Option<PyRefMut<'_, PyVerifier>>,
    ) -> (usize, Option<u32>) {
        let mut hashes = std::mem::take(&mut self.hashes);
        let n = values.len();
        let mut i = start;
        let mut flagged = None;
        while i < n {
            let Ok(item) = values.get_item(i) else { break };
            let Ok(bytes) = item.cast::<PyBytes>() else { break };
            let buf = bytes.as_bytes();
            let Some(rec) = envelope::decode(buf, &mut hashes) else { break };
            if let Some(v) = verifier.as_mut() {
                if !v.inner.verified(buf, rec.key, rec.worker_id, rec.sig_last) {
                    break;
                }
            }
            self.producer.clear();
            self.producer.push_str(rec.producer);
            self.producer.push_str(suffix);
            let ev = rec.event(&hashes);
            let c = code(self.inner.apply(&self.producer, rec.epoch, rec.seq, &ev));
            if c >= 4 {
                self.worker.clear();
                self.worker.push_str(rec.worker_id);
                flagged = Some(c);
                break;
            }
            i += 1;
        }
        self.hashes = hashes;
        (i, flagged)
    }

    /// Worker id of the last record `apply_record` folded.
    fn last_worker(&self) -> &str {
        &self.worker
    }

    /// An event about no worker: counted as ignored, not sequenced (as the reference does).
    fn count_ignored(&mut self) {
        self.inner.counters[3] += 1;
    }

    /// Fold one decoded event. `kind`: 0 stored, 1 removed, 2 moved, 3 cleared, 4 registered,
    /// 5 deregistered, 6 any other event about a worker. Tiers are indices in TIER_ORDER
    /// (-1 = none, for AllBlocksCleared).
    #[pyo3(signature = (producer, epoch, seq, kind, worker_id, stream, dp_rank, tier, to_tier, hashes, full_attention, block_size, hash_algo))]
    #[allow(clippy::too_many_arguments)]
    fn apply_fields(
        &mut self,
        producer: &str,
        epoch: i64,
        seq: i64,
        kind: u8,
        worker_id: &str,
        stream: &str,
        dp_rank: Option<i64>,
        tier: i64,
        to_tier: i64,
        hashes: Vec<u64>,
        full_attention: bool,
        block_size: i64,
        hash_algo: &str,
    ) -> PyResult<u32> {
        let t = |x: i64| -> PyResult<u8> {
            if (0..N_TIERS as i64).contains(&x) {
                Ok(x as u8)
            } else {
                Err(PyValueError::new_err(format!("tier index {x} out of range")))
            }
        };
        let payload = match kind {
            0 => Payload::Stored { tier: t(tier)?, hashes: &hashes, block_size, hash_algo, full_attention },
            1 => Payload::Removed { tier: t(tier)?, hashes: &hashes, full_attention },
            2 => Payload::Moved { from: t(tier)?, to: t(to_tier)?, hashes: &hashes, full_attention },
            3 => Payload::Cleared { tier: if tier < 0 { None } else { Some(t(tier)?) } },
            4 => Payload::Registered { block_size, hash_algo },
            5 => Payload::Deregistered,
            6 => Payload::Other,
            _ => return Err(PyValueError::new_err(format!("unknown event kind {kind}"))),
        };
        let ev = Event { worker_id, stream, dp_rank, payload };
        Ok(code(self.inner.apply(producer, epoch, seq, &ev)))
    }

    /// `[(slot, depth, device, host, disk, object, stale), ...]` ordered by (depth, slot).
    fn find_matches<'py>(&mut self, py: Python<'py>, hashes: Vec<u64>) -> PyResult<Bound<'py, PyList>> {
        let mut out = std::mem::take(&mut self.matches);
        self.inner.find_matches(&hashes, &mut out);
        let list = PyList::empty(py);
        for m in &out {
            let [d, h, k, o] = m.by_tier;
            list.append((m.slot, m.depth, d, h, k, o, m.stale))?;
        }
        self.matches = out;
        Ok(list)
    }

    /// Matched depth per slot only (no Python objects per block): `[(slot, depth), ...]`.
    fn match_depths(&mut self, hashes: Vec<u64>) -> Vec<(u32, u32)> {
        let mut out = std::mem::take(&mut self.matches);
        self.inner.find_matches(&hashes, &mut out);
        let r = out.iter().map(|m| (m.slot, m.depth)).collect();
        self.matches = out;
        r
    }

    /// Slot table: per slot number, (worker id, dp rank) or None for a free slot.
    fn slot_table(&self) -> Vec<Option<(String, i64)>> {
        let n = self.inner.live_slots().last().map_or(0, |&s| s as usize + 1);
        (0..n as u32).map(|s| self.inner.slot_key(s).map(|(w, d)| (w.to_string(), d))).collect()
    }

    fn slot_version(&self) -> u64 {
        self.inner.slot_gen
    }

    fn stale_slots(&self) -> Vec<u32> {
        self.inner.stale_slots()
    }

    fn live_slots(&self) -> Vec<u32> {
        self.inner.live_slots()
    }

    fn slot_counts(&self, slot: u32) -> [u64; N_TIERS] {
        self.inner.slot_counts(slot)
    }

    fn is_stale(&self, worker_id: &str, dp_rank: i64) -> bool {
        self.inner.is_stale(worker_id, dp_rank)
    }

    fn epoch_of(&self, worker_id: &str) -> Option<i64> {
        self.inner.epoch_of(worker_id)
    }

    fn worker_states(&self) -> Vec<(String, i64, bool, i64, i64)> {
        self.inner.worker_states().into_iter().map(|(w, e, d, l, r)| (w.to_string(), e, d, l, r)).collect()
    }

    fn position(&self, producer: &str, stream: &str) -> Option<(i64, i64)> {
        self.inner.position(producer, stream)
    }

    fn positions(&self) -> Vec<(String, String, i64, i64)> {
        self.inner
            .positions()
            .into_iter()
            .map(|(p, s, e, l)| (p.to_string(), s.to_string(), e, l))
            .collect()
    }

    /// `[(slot, tier index, [hashes...]), ...]` for every non-empty (slot, tier).
    fn residency(&self) -> Vec<(u32, usize, Vec<u64>)> {
        let mut out = Vec::new();
        for (s, per) in self.inner.residency().into_iter().enumerate() {
            for (t, hs) in per.into_iter().enumerate() {
                if !hs.is_empty() {
                    out.push((s as u32, t, hs));
                }
            }
        }
        out
    }

    fn counters(&self) -> Vec<(&'static str, u64)> {
        COUNTER_NAMES.iter().copied().zip(self.inner.counters.iter().copied()).collect()
    }

    fn verify_invariants(&self) -> PyResult<()> {
        self.inner.verify_invariants().map_err(|e| pyo3::exceptions::PyAssertionError::new_err(e))
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    /// (block, slot) entries: a block held by a slot counts once per tier it is in.
    fn entries(&self) -> u64 {
        self.inner.entries()
    }

    fn structure_bytes(&self) -> usize {
        self.inner.structure_bytes()
    }

    fn snapshot<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.inner.snapshot())
    }

    /// Without the GIL: a restarting router restores its snapshot on a worker thread while the
    /// main thread imports its HTTP stack.
    #[staticmethod]
    fn restore(py: Python<'_>, data: &[u8]) -> PyResult<PyIndex> {
        py.detach(|| NativeIndex::restore(data)).map(PyIndex::wrap).map_err(|e| PyValueError::new_err(e.0))
    }

    /// The raw in-Rust throughput, no Python crossing per event or query: replay `records`
    /// (envelope bytes, one sequencing suffix for all) and, before record `first` of each query,
    /// run that query's `find_matches`. Returns (apply ns, match ns, records not taken, matched
    /// slots summed over the queries).
    fn replay_timed(
        &mut self,
        records: Vec<Vec<u8>>,
        queries: Vec<(usize, Vec<u64>)>,
        suffix: &str,
    ) -> (u64, u64, u64, u64) {
        let (mut apply_ns, mut match_ns, mut skipped, mut matched) = (0u64, 0u64, 0u64, 0u64);
        let mut qi = 0;
        let mut out = Vec::new();
        for (i, r) in records.iter().enumerate() {
            while qi < queries.len() && queries[qi].0 <= i {
                let t0 = std::time::Instant::now();
                self.inner.find_matches(&queries[qi].1, &mut out);
                match_ns += t0.elapsed().as_nanos() as u64;
                matched += out.len() as u64;
                qi += 1;
            }
            let t0 = std::time::Instant::now();
            if self.apply_record(r, suffix).is_none() {
                skipped += 1;
            }
            apply_ns += t0.elapsed().as_nanos() as u64;
        }
        (apply_ns, match_ns, skipped, matched)
    }

    /// In-Rust lookup latency: nanoseconds of each query's `find_matches` (no Python crossing).
    fn match_timed(&mut self, queries: Vec<Vec<u64>>) -> Vec<u64> {
        let mut out = Vec::new();
        queries
            .iter()
            .map(|q| {
                let t0 = std::time::Instant::now();
                self.inner.find_matches(q, &mut out);
                t0.elapsed().as_nanos() as u64
            })
            .collect()
    }
}

/// Checks worker signatures on kv records natively (`signing.rs`); `schemas.signing.Verifier`
/// is the specification and decides every record this one does not verify.
#[pyclass(module = "switchyard_native", name = "NativeVerifier")]
struct PyVerifier {
    inner: signing::Verifier,
}

#[pymethods]
impl PyVerifier {
    #[new]
    fn new(master: &[u8]) -> Self {
        PyVerifier { inner: signing::Verifier::new(master) }
    }

    /// True when `data` is a kv envelope this path takes, signed by its owner; False: not
    /// decided here (the reference accepts it or says why not).
    fn verified(&mut self, data: &[u8]) -> bool {
        let mut hashes = Vec::new();
        match envelope::decode(data, &mut hashes) {
            Some(rec) => self.inner.verified(data, rec.key, rec.worker_id, rec.sig_last),
            None => false,
        }
    }
}

/// The pseudo-token generators take ids modulo `vocab`: it must not be 0.
fn positive_vocab(vocab: u64) -> PyResult<()> {
    if vocab == 0 {
        return Err(PyValueError::new_err("vocab must be positive"));
    }
    Ok(())
}

fn digest32(b: &[u8], what: &str) -> PyResult<[u8; 32]> {
    b.try_into().map_err(|_| PyValueError::new_err(format!("{what} must be 32 bytes, got {}", b.len())))
}

/// (digests concatenated, their wire forms: last 8 bytes big-endian) for the Python side.
fn digests_out<'py>(py: Python<'py>, ds: &[[u8; 32]]) -> (Bound<'py, PyBytes>, Vec<u64>) {
    let wire = ds.iter().map(|d| u64::from_be_bytes(d[24..].try_into().unwrap())).collect();
    (PyBytes::new(py, ds.as_flattened()), wire)
}

/// `hash_block_digests(tokens, HashConfig(sha256, block_size), parent=parent)`, natively; None
/// when a block is too big for the single-frame pickle this writes (use the Python path).
#[pyfunction]
fn sha256_block_chain<'py>(
    py: Python<'py>,
    parent: &[u8],
    tokens: Vec<i64>,
    block_size: usize,
) -> PyResult<Option<(Bound<'py, PyBytes>, Vec<u64>)>> {
    let p = digest32(parent, "parent")?;
    let ds = py.detach(|| crate::blockhash::chain_digests(&p, &tokens, block_size));
    Ok(ds.map(|ds| digests_out(py, &ds)))
}

/// Chained digests of a run of Mooncake trace blocks (see `blockhash::mooncake_chain`); None on
/// mismatched lengths or a block too big for one pickle frame.
#[pyfunction]
fn mooncake_block_chain<'py>(
    py: Python<'py>,
    parent: &[u8],
    hash_ids: Vec<i64>,
    blocks: Vec<u32>,
    block_size: usize,
    trace_block_size: u64,
    vocab: u64,
) -> PyResult<Option<(Bound<'py, PyBytes>, Vec<u64>)>> {
    let p = digest32(parent, "parent")?;
    let ds = py.detach(|| {
        crate::blockhash::mooncake_chain(&p, &hash_ids, &blocks, block_size, trace_block_size, vocab)
    });
    Ok(ds.map(|ds| digests_out(py, &ds)))
}

/// The engine's pseudo-tokens `start..stop` of stream `seed` (see `blockhash::pseudo_tokens`).
#[pyfunction]
fn pseudo_tokens(seed: u64, start: u64, stop: u64, vocab: u64) -> PyResult<Vec<u64>> {
    positive_vocab(vocab)?;
    Ok(crate::blockhash::pseudo_tokens(seed, start, stop, vocab))
}

/// `sha256_block_chain(parent, head + pseudo_tokens(seed, start, stop, vocab), block_size)` in
/// one call: the blocks an engine request generates (`head`: the prompt tokens that share the
/// first of them), without the tokens crossing into Python.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn sha256_generated_chain<'py>(
    py: Python<'py>,
    parent: &[u8],
    head: Vec<i64>,
    seed: u64,
    start: u64,
    stop: u64,
    vocab: u64,
    block_size: usize,
) -> PyResult<Option<(Bound<'py, PyBytes>, Vec<u64>)>> {
    let p = digest32(parent, "parent")?;
    positive_vocab(vocab)?;
    let mut tokens = head;
    tokens.extend(crate::blockhash::pseudo_tokens(seed, start, stop, vocab).into_iter().map(|t| t as i64));
    let ds = crate::blockhash::chain_digests(&p, &tokens, block_size);
    Ok(ds.map(|ds| digests_out(py, &ds)))
}

/// Tokens `start..stop` of a Mooncake trace block (see `blockhash::trace_tokens`).
#[pyfunction]
fn trace_tokens(base: u64, start: u64, stop: u64, vocab: u64) -> PyResult<Vec<u64>> {
    positive_vocab(vocab)?;
    Ok(crate::blockhash::trace_tokens(base, start, stop, vocab))
}

/// `blockhash::MooncakeHasher` for Python: `digests(hash_ids, length) -> (bytes, wire hashes)`.
#[pyclass(module = "switchyard_native", name = "MooncakeHasher")]
struct PyMooncakeHasher {
    inner: crate::blockhash::MooncakeHasher,
    out: Vec<[u8; 32]>,
}

#[pymethods]
impl PyMooncakeHasher {
    #[new]
    fn new(none_hash: &[u8], block_size: usize, trace_block_size: usize, vocab: u64) -> PyResult<Self> {
        let nh = digest32(none_hash, "none_hash")?;
        let inner = crate::blockhash::MooncakeHasher::new(nh, block_size, trace_block_size, vocab)
            .ok_or_else(|| PyValueError::new_err("trace_block_size must be a multiple of block_size, vocab > 0"))?;
        Ok(PyMooncakeHasher { inner, out: Vec::new() })
    }

    /// Digests (concatenated) and wire hashes of a record's prompt; None if a block is too big
    /// for one pickle frame (hash in Python).
    fn digests<'py>(
        &mut self,
        py: Python<'py>,
        hash_ids: Vec<i64>,
        length: usize,
    ) -> Option<(Bound<'py, PyBytes>, Vec<u64>)> {
        let mut out = std::mem::take(&mut self.out);
        out.clear();
        let ok = self.inner.digests(&hash_ids, length, &mut out);
        let r = ok.map(|_| digests_out(py, &out));
        self.out = out;
        r
    }
}

#[pymodule]
fn switchyard_native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyIndex>()?;
    m.add_class::<PyVerifier>()?;
    m.add_function(wrap_pyfunction!(sha256_block_chain, m)?)?;
    m.add_function(wrap_pyfunction!(mooncake_block_chain, m)?)?;
    m.add_function(wrap_pyfunction!(pseudo_tokens, m)?)?;
    m.add_class::<PyMooncakeHasher>()?;
    m.add_function(wrap_pyfunction!(trace_tokens, m)?)?;
    m.add_function(wrap_pyfunction!(sha256_generated_chain, m)?)?;
    crate::py_router::register(m)?;
    Ok(())
}
