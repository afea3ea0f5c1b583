//! PyO3 bindings: the index class `control_plane/index/native.py` extends into the reference's
//! API (its hot methods answer with the reference's objects, made here), and the kv scorer.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::intern;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};

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
// `subclass`: `control_plane.index.native.NativePrefixIndex` extends it, so its hot methods
// (`apply_bytes`, `find_matches`) are these, called with no Python frame in between.
#[pyclass(module = "switchyard_native", name = "NativeIndex", subclass)]
struct PyIndex {
    inner: NativeIndex,
    hashes: Vec<u64>,
    producer: String,
    /// Worker id of the last record `apply_record` took.
    worker: String,
    matches: crate::index::Matches,
    query: Vec<u64>,
    /// The Python objects answers are made of (`_bind`).
    objs: Option<Answers>,
}

/// What `find_matches` and `apply_bytes` answer with: the reference's types, given by the
/// Python side (`_bind`), and the immutable instances already made, reused across calls.
struct Answers {
    rank_cls: Py<PyAny>,
    match_cls: Py<PyAny>,
    /// `ApplyOutcome` by code (applied, duplicate, fenced, ignored).
    outcomes: Vec<Py<PyAny>>,
    /// Per slot: (worker number, dp rank, its `WorkerRank`), remade only when the slot changes.
    ranks: Vec<Option<(u32, i64, Py<PyAny>)>>,
    ranks_gen: u64,
    /// Per depth, the device-only `Match` (fresh, stale): the common answer.
    device: Vec<[Py<PyAny>; 2]>,
    /// Other `Match`es by (by_tier, stale), bounded.
    mixed: std::collections::HashMap<([u32; N_TIERS], bool), Py<PyAny>>,
    /// `(WorkerRank, Match)` pairs by (slot, by_tier, stale): a direct-mapped cache (a key's
    /// place is its hash; a new pair replaces the one there), emptied when a slot's
    /// `WorkerRank` changes.
    pairs: Vec<Option<([u64; 3], Py<PyTuple>)>>,
}

/// At most this many mixed-tier `Match` objects are kept for reuse.
const MIXED_CACHE: usize = 4096;
/// Places in the `(WorkerRank, Match)` pair cache (a power of two; 40 bytes each, plus ~100
/// per pair held).
const PAIR_CACHE: usize = 1 << 14;

impl Answers {
    fn refresh_ranks(&mut self, py: Python<'_>, idx: &NativeIndex) -> PyResult<()> {
        if self.ranks_gen == idx.slot_gen {
            return Ok(());
        }
        let n = idx.slot_count();
        self.ranks.resize_with(n, || None);
        self.ranks.truncate(n);
        for s in 0..n {
            let cur = idx.slot_owner(s as u32);
            let same = match (&self.ranks[s], cur) {
                (Some((w, d, _)), Some((w2, d2))) => *w == w2 && *d == d2,
                (None, None) => true,
                _ => false,
            };
            if !same {
                self.pairs.iter_mut().for_each(|p| *p = None);
                self.ranks[s] = match cur {
                    None => None,
                    Some((w, d)) => {
                        let (name, _) = idx.slot_key(s as u32).expect("a live slot");
                        Some((w, d, self.rank_cls.call1(py, (name, d))?))
                    }
                };
            }
        }
        self.ranks_gen = idx.slot_gen;
        Ok(())
    }

    fn rank<'py>(&self, py: Python<'py>, slot: u32) -> &Bound<'py, PyAny> {
        self.ranks[slot as usize].as_ref().expect("a matched slot is live").2.bind(py)
    }

    /// The `(WorkerRank, Match)` pair of a match (immutable, so made once and reused).
    fn pair<'py>(&mut self, py: Python<'py>, m: &MatchOut) -> PyResult<Bound<'py, PyTuple>> {
        let [a, b, c, d] = m.by_tier.map(u64::from);
        let key = [(m.slot as u64) << 1 | m.stale as u64, a | b << 32, c | d << 32];
        let at = (key[0] ^ key[1].rotate_left(21) ^ key[2].rotate_left(42)).wrapping_mul(0x9E37_79B9_7F4A_7C15)
            >> (64 - PAIR_CACHE.trailing_zeros()) as usize;
        if self.pairs.is_empty() {
            self.pairs.resize_with(PAIR_CACHE, || None);
        }
        if let Some((k, p)) = &self.pairs[at as usize] {
            if *k == key {
                return Ok(p.bind(py).clone());
            }
        }
        let v = self.match_obj(py, m)?;
        let p = PyTuple::new(py, [self.rank(py, m.slot).clone(), v])?;
        self.pairs[at as usize] = Some((key, p.clone().unbind()));
        Ok(p)
    }

    fn match_obj<'py>(&mut self, py: Python<'py>, m: &MatchOut) -> PyResult<Bound<'py, PyAny>> {
        let [dev, host, disk, obj] = m.by_tier;
        if host == 0 && disk == 0 && obj == 0 {
            let d = m.depth as usize;
            while self.device.len() <= d {
                let k = self.device.len() as u32;
                let by = (k, 0u32, 0u32, 0u32);
                let fresh = self.match_cls.call1(py, (k, by, false))?;
                let stale = self.match_cls.call1(py, (k, by, true))?;
                self.device.push([fresh, stale]);
            }
            return Ok(self.device[d][m.stale as usize].bind(py).clone());
        }
        let key = (m.by_tier, m.stale);
        if let Some(o) = self.mixed.get(&key) {
            return Ok(o.bind(py).clone());
        }
        if self.mixed.len() >= MIXED_CACHE {
            self.mixed.clear();
        }
        let o = self.match_cls.call1(py, (m.depth, (dev, host, disk, obj), m.stale))?;
        let b = o.bind(py).clone();
        self.mixed.insert(key, o);
        Ok(b)
    }
}

/// `NativeIndex.find_matches`'s answer: a read-only mapping `WorkerRank -> Match` in the
/// reference's order (registered as a `collections.abc.Mapping` by the Python side). Not a dict:
/// a dict hashes every `WorkerRank` key (a tuple, hashed anew each time) on insert, about 350
/// instructions per matched cache, and its readers (the router's view, the simulation) only
/// iterate the items once. The items are kept as the `(WorkerRank, Match)` pairs `items()`
/// returns (a tuple: iterating it makes no new objects); lookups by key scan them.
#[pyclass(module = "switchyard_native", name = "Matches", frozen, mapping)]
struct PyMatches {
    pairs: Py<PyTuple>,
}

impl PyMatches {
    fn find<'py>(&self, key: &Bound<'py, PyAny>) -> PyResult<Option<Bound<'py, PyAny>>> {
        for pair in self.pairs.bind(key.py()).iter() {
            let k = pair.get_item(0)?;
            if k.as_ptr() == key.as_ptr() || k.eq(key)? {
                return pair.get_item(1).map(Some);
            }
        }
        Ok(None)
    }

    fn as_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        PyDict::from_sequence(self.pairs.bind(py).as_any())
    }

    /// Element `i` of every pair.
    fn column<'py>(&self, py: Python<'py>, i: usize) -> PyResult<Bound<'py, PyList>> {
        let pairs = self.pairs.bind(py);
        let out = PyList::empty(py);
        for pair in pairs.iter() {
            out.append(pair.get_item(i)?)?;
        }
        Ok(out)
    }
}

#[pymethods]
impl PyMatches {
    fn __len__(&self, py: Python<'_>) -> usize {
        self.pairs.bind(py).len()
    }

    fn __getitem__<'py>(&self, key: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        match self.find(key)? {
            Some(v) => Ok(v),
            None => Err(pyo3::exceptions::PyKeyError::new_err(key.clone().unbind())),
        }
    }

    fn __contains__(&self, key: &Bound<'_, PyAny>) -> PyResult<bool> {
        Ok(self.find(key)?.is_some())
    }

    #[pyo3(signature = (key, default=None))]
    fn get<'py>(&self, key: &Bound<'py, PyAny>, default: Option<Bound<'py, PyAny>>) -> PyResult<Option<Bound<'py, PyAny>>> {
        Ok(self.find(key)?.or(default))
    }

    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, pyo3::types::PyIterator>> {
        self.keys(py)?.try_iter()
    }

    fn keys<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        self.column(py, 0)
    }

    fn values<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        self.column(py, 1)
    }

    /// `((WorkerRank, Match), ...)` in order.
    fn items<'py>(&self, py: Python<'py>) -> Bound<'py, PyTuple> {
        self.pairs.bind(py).clone()
    }

    /// Equal to any mapping with the same items (a dict included), as a dict would be.
    fn __eq__(&self, py: Python<'_>, other: &Bound<'_, PyAny>) -> PyResult<bool> {
        let other = match other.cast::<PyMatches>() {
            Ok(m) => m.get().as_dict(py)?.into_any(),
            Err(_) => other.clone(),
        };
        self.as_dict(py)?.eq(other)
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(self.as_dict(py)?.repr()?.to_string())
    }
}

/// `hashes` as u64s into `out`: a list or tuple of ints read in place, any other sequence of
/// integers through PyO3's conversion. Negative or too big: OverflowError.
fn read_hashes(obj: &Bound<'_, PyAny>, out: &mut Vec<u64>) -> PyResult<()> {
    use pyo3::ffi;
    out.clear();
    let (get, n): (unsafe extern "C" fn(*mut ffi::PyObject, ffi::Py_ssize_t) -> *mut ffi::PyObject, usize) =
        if let Ok(l) = obj.cast::<PyList>() {
            (ffi::PyList_GetItem, l.len())
        } else if let Ok(t) = obj.cast::<PyTuple>() {
            (ffi::PyTuple_GetItem, t.len())
        } else {
            *out = obj.extract()?;
            return Ok(());
        };
    let py = obj.py();
    out.reserve(n);
    for i in 0..n {
        // SAFETY: `obj` is a list or tuple we hold; GetItem returns a borrowed reference (or
        // NULL with IndexError if a list shrank), used before any Python code can run, except
        // in the fallback, which takes its own reference first.
        unsafe {
            let item = get(obj.as_ptr(), i as ffi::Py_ssize_t);
            if item.is_null() {
                return Err(PyErr::fetch(py));
            }
            if ffi::PyLong_Check(item) != 0 {
                out.push(int_to_u64(py, item)?);
            } else {
                out.push(Bound::from_borrowed_ptr(py, item).extract()?);
            }
        }
    }
    Ok(())
}

/// An int as a u64 with `PyLong_AsUnsignedLongLong`'s result and error type (OverflowError),
/// without its slow path: in CPython 3.11 an int above 2^30 goes through a generic byte-array
/// conversion (~200 instructions; a block hash is 64 bits), while `PyLong_AsUnsignedLong` is
/// one digit loop with an exact overflow check, and is 64 bits wide where `c_ulong` is (LP64:
/// Linux, macOS).
///
/// # Safety
/// `item` is a valid pointer to an int (`PyLong_Check`), alive for the call.
#[inline]
unsafe fn int_to_u64(py: Python<'_>, item: *mut pyo3::ffi::PyObject) -> PyResult<u64> {
    use pyo3::ffi;
    let v = if std::mem::size_of::<std::os::raw::c_ulong>() == 8 {
        ffi::PyLong_AsUnsignedLong(item) as u64
    } else {
        ffi::PyLong_AsUnsignedLongLong(item)
    };
    if v == u64::MAX && !ffi::PyErr_Occurred().is_null() {
        return Err(PyErr::fetch(py));
    }
    Ok(v)
}

impl PyIndex {
    fn wrap(inner: NativeIndex) -> Self {
        PyIndex {
            inner,
            hashes: Vec::new(),
            producer: String::new(),
            worker: String::new(),
            matches: Default::default(),
            query: Vec::new(),
            objs: None,
        }
    }

    fn answers(&mut self) -> PyResult<&mut Answers> {
        self.objs
            .as_mut()
            .ok_or_else(|| pyo3::exceptions::PyRuntimeError::new_err("NativeIndex._bind() was not called"))
    }

    /// Fold one `kv` record from its envelope bytes (see `apply_bytes`): the outcome code.
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
}

/// Outcome codes `apply_bytes` leaves to the Python side's `_explain_record`: a new epoch, a
/// gap (flags 8, 16) or a rejection (4-6).
fn needs_words(code: u32) -> bool {
    code >= 4
}

#[pymethods]
impl PyIndex {
    /// An empty index, or (`snapshot=`) one restored from snapshot bytes (then `hash_algo` and
    /// `block_size` are the snapshot's, the arguments are ignored).
    /// A restore runs without the GIL: a restarting router restores its snapshot on a worker
    /// thread while the main thread imports its HTTP stack.
    #[new]
    #[pyo3(signature = (hash_algo, block_size, *, snapshot=None))]
    fn new(py: Python<'_>, hash_algo: &str, block_size: i64, snapshot: Option<&[u8]>) -> PyResult<Self> {
        let inner = match snapshot {
            None => NativeIndex::new(hash_algo, block_size),
            Some(data) => py.detach(|| NativeIndex::restore(data)).map_err(|e| PyValueError::new_err(e.0))?,
        };
        Ok(PyIndex::wrap(inner))
    }

    /// The types answers are made of: `rank_cls(worker_id, dp_rank)`, `match_cls(depth,
    /// by_tier, stale)`, and the outcomes for codes 0-3.
    fn _bind(&mut self, rank_cls: Py<PyAny>, match_cls: Py<PyAny>, outcomes: Vec<Py<PyAny>>) -> PyResult<()> {
        if outcomes.len() != 4 {
            return Err(PyValueError::new_err("four outcomes: applied, duplicate, fenced, ignored"));
        }
        self.objs = Some(Answers {
            rank_cls,
            match_cls,
            outcomes,
            ranks: Vec::new(),
            ranks_gen: u64::MAX,
            device: Vec::new(),
            mixed: Default::default(),
            pairs: Default::default(),
        });
        Ok(())
    }

    #[getter]
    fn hash_algo(&self) -> &str {
        &self.inner.hash_algo
    }

    #[getter]
    fn block_size(&self) -> i64 {
        self.inner.block_size
    }

    /// Fold a `kv` record from its envelope bytes, sequenced as producer `<envelope
    /// producer><suffix>` (the router view passes `"@<topic>:<partition>"`). None: not a record
    /// this path takes (nothing changed; decode it with the codec). A new epoch, a gap or a
    /// rejection is handed to `self._explain_record(code, value, suffix)` (the log lines, the
    /// `IndexRejected`), whose return is the answer.
    #[pyo3(signature = (value, suffix=""))]
    fn apply_bytes<'py>(
        slf: &Bound<'py, Self>,
        value: &Bound<'py, PyBytes>,
        suffix: &str,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let py = slf.py();
        let code = {
            let mut this = slf.borrow_mut();
            let Some(code) = this.apply_record(value.as_bytes(), suffix) else { return Ok(None) };
            if !needs_words(code) {
                return Ok(Some(this.answers()?.outcomes[code as usize].bind(py).clone()));
            }
            code
        };
        slf.call_method1(intern!(py, "_explain_record"), (code, value, suffix)).map(Some)
    }

    /// Fold `values[start..]` in order (one partition's record values, sequenced with `suffix`)
    /// while each is a kv record this path takes and, given a `verifier`, carries its owner's
    /// signature. Returns `(i, code)`: the records before `i` were folded with plain outcomes
    /// (applied, duplicate, fenced, ignored); `code` None: record `i` was not touched (or `i` is
    /// the end) and the caller folds it through the per-record path; `code` Some: record `i` was
    /// folded with an outcome that needs words (a new epoch, a gap, a rejection).
    #[pyo3(signature = (values, start, suffix, verifier=None))]
    fn _apply_run(
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

    /// Worker id of the last record `apply_bytes` folded.
    fn last_worker(&self) -> &str {
        &self.worker
    }

    /// An event about no worker: counted as ignored, not sequenced (as the reference does).
    fn _count_ignored(&mut self) {
        self.inner.counters[3] += 1;
    }

    /// Fold one decoded event: the outcome code (see `apply_bytes`). `kind`: 0 stored, 1
    /// removed, 2 moved, 3 cleared, 4 registered, 5 deregistered, 6 any other event about a
    /// worker. Tiers are indices in TIER_ORDER (-1 = none, for AllBlocksCleared).
    #[pyo3(signature = (producer, epoch, seq, kind, worker_id, stream, dp_rank, tier, to_tier, hashes, full_attention, block_size, hash_algo))]
    #[allow(clippy::too_many_arguments)]
    fn _apply_fields(
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

    /// Matched prefix per cache: a read-only mapping `WorkerRank -> Match` ordered by (depth,
    /// slot), the reference's answer (see `PyMatches`).
    fn find_matches<'py>(slf: &Bound<'py, Self>, hashes: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyMatches>> {
        let py = slf.py();
        let mut this = slf.borrow_mut();
        let this = &mut *this;
        read_hashes(hashes, &mut this.query)?;
        this.inner.find_matches(&this.query, &mut this.matches);
        let out = &this.matches.out;
        let pairs = if out.is_empty() {
            PyTuple::empty(py)
        } else {
            let objs = this.objs.as_mut().ok_or_else(|| {
                pyo3::exceptions::PyRuntimeError::new_err("NativeIndex._bind() was not called")
            })?;
            objs.refresh_ranks(py, &this.inner)?;
            // SAFETY: a new tuple of out.len() slots, each filled once (SetItem steals the
            // reference `into_ptr` hands over) before the tuple is seen by anyone.
            unsafe {
                let t = Bound::from_owned_ptr_or_err(py, pyo3::ffi::PyTuple_New(out.len() as pyo3::ffi::Py_ssize_t))?
                    .cast_into_unchecked::<PyTuple>();
                for (i, m) in out.iter().enumerate() {
                    let p = objs.pair(py, m)?;
                    pyo3::ffi::PyTuple_SetItem(t.as_ptr(), i as pyo3::ffi::Py_ssize_t, p.into_ptr());
                }
                t
            }
        };
        Bound::new(py, PyMatches { pairs: pairs.unbind() })
    }

    /// Matched depth per slot only (no Python objects per block): `[(slot, depth), ...]`.
    fn match_depths(&mut self, hashes: Vec<u64>) -> Vec<(u32, u32)> {
        self.inner.find_matches(&hashes, &mut self.matches);
        self.matches.out.iter().map(|m| (m.slot, m.depth)).collect()
    }

    /// Per slot number, its `WorkerRank` (None for a free slot): the objects `find_matches`
    /// answers with.
    fn _ranks<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let this = &mut *self;
        let objs = this.objs.as_mut().ok_or_else(|| {
            pyo3::exceptions::PyRuntimeError::new_err("NativeIndex._bind() was not called")
        })?;
        objs.refresh_ranks(py, &this.inner)?;
        PyList::new(py, objs.ranks.iter().map(|r| r.as_ref().map(|(_, _, o)| o.clone_ref(py))))
    }

    fn _stale_slots(&self) -> Vec<u32> {
        self.inner.stale_slots()
    }

    fn _live_slots(&self) -> Vec<u32> {
        self.inner.live_slots()
    }

    fn _slot_counts(&self, slot: u32) -> [u64; N_TIERS] {
        self.inner.slot_counts(slot)
    }

    fn _is_stale(&self, worker_id: &str, dp_rank: i64) -> bool {
        self.inner.is_stale(worker_id, dp_rank)
    }

    fn epoch_of(&self, worker_id: &str) -> Option<i64> {
        self.inner.epoch_of(worker_id)
    }

    fn _worker_states(&self) -> Vec<(String, i64, bool, i64, i64)> {
        self.inner.worker_states().into_iter().map(|(w, e, d, l, r)| (w.to_string(), e, d, l, r)).collect()
    }

    fn position(&self, producer: &str, stream: &str) -> Option<(i64, i64)> {
        self.inner.position(producer, stream)
    }

    fn _positions(&self) -> Vec<(String, String, i64, i64)> {
        self.inner
            .positions()
            .into_iter()
            .map(|(p, s, e, l)| (p.to_string(), s.to_string(), e, l))
            .collect()
    }

    /// `[(slot, tier index, [hashes...]), ...]` for every non-empty (slot, tier).
    fn _residency(&self) -> Vec<(u32, usize, Vec<u64>)> {
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

    fn _counters(&self) -> Vec<(&'static str, u64)> {
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
        let mut m = crate::index::Matches::default();
        for (i, r) in records.iter().enumerate() {
            while qi < queries.len() && queries[qi].0 <= i {
                let t0 = std::time::Instant::now();
                self.inner.find_matches(&queries[qi].1, &mut m);
                match_ns += t0.elapsed().as_nanos() as u64;
                matched += m.out.len() as u64;
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
        let mut m = crate::index::Matches::default();
        queries
            .iter()
            .map(|q| {
                let t0 = std::time::Instant::now();
                self.inner.find_matches(q, &mut m);
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
    let wire = ds.iter().map(crate::blockhash::wire).collect();
    (PyBytes::new(py, ds.as_flattened()), wire)
}

/// The wire hashes of `sha256_block_chain(parent, tokens, block_size)` for a list or tuple of
/// token ids, without a Python type check first: None unless every item is exactly an `int`
/// (a bool, an int subclass or a numpy scalar pickles differently) within 64 bits, or when a
/// block is too big for one pickle frame (the caller hashes in Python). The GIL is kept: the
/// router calls this per request, and a release would let another thread take the event
/// loop's GIL for a whole switch interval.
#[pyfunction]
fn sha256_ids_chain(parent: &[u8], tokens: &Bound<'_, PyAny>, block_size: usize) -> PyResult<Option<Vec<u64>>> {
    let p = digest32(parent, "parent")?;
    fn exact(item: Bound<'_, PyAny>) -> Option<i64> {
        if !item.is_exact_instance_of::<pyo3::types::PyInt>() {
            return None;
        }
        item.extract::<i64>().ok()
    }
    let ids: Option<Vec<i64>> = if let Ok(list) = tokens.cast::<PyList>() {
        list.iter().map(exact).collect()
    } else if let Ok(tuple) = tokens.cast::<PyTuple>() {
        tuple.iter().map(exact).collect()
    } else {
        None
    };
    Ok(ids.and_then(|ids| crate::blockhash::chain_digests(&p, &ids, block_size))
        .map(|ds| ds.iter().map(crate::blockhash::wire).collect()))
}

/// A prompt of token ids as the client sent it (`json`: the JSON array's bytes) read and hashed
/// in one call, no Python int made per id: (how many ids, the wire hashes of its full blocks as
/// `sha256_block_chain` gives them). None when `json` is not an array of plain integers below
/// `vocab` (`blockhash::json_token_ids`) or a block is too big for one pickle frame: the caller
/// then reads the prompt the general way. The GIL is kept (see `sha256_ids_chain`).
#[pyfunction]
fn sha256_json_ids_chain(
    parent: &[u8],
    json: &[u8],
    vocab: u64,
    block_size: usize,
) -> PyResult<Option<(usize, Vec<u64>)>> {
    let p = digest32(parent, "parent")?;
    let mut ids = Vec::with_capacity(json.len() / 4);
    if !crate::blockhash::json_token_ids(json, vocab, &mut ids) {
        return Ok(None);
    }
    Ok(crate::blockhash::chain_digests(&p, &ids, block_size)
        .map(|ds| (ids.len(), ds.iter().map(crate::blockhash::wire).collect())))
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
    m.add_class::<PyMatches>()?;
    m.add_class::<PyVerifier>()?;
    m.add_function(wrap_pyfunction!(sha256_block_chain, m)?)?;
    m.add_function(wrap_pyfunction!(sha256_ids_chain, m)?)?;
    m.add_function(wrap_pyfunction!(sha256_json_ids_chain, m)?)?;
    m.add_function(wrap_pyfunction!(mooncake_block_chain, m)?)?;
    m.add_function(wrap_pyfunction!(pseudo_tokens, m)?)?;
    m.add_class::<PyMooncakeHasher>()?;
    m.add_function(wrap_pyfunction!(trace_tokens, m)?)?;
    m.add_function(wrap_pyfunction!(sha256_generated_chain, m)?)?;
    crate::py_router::register(m)?;
    crate::py_calls::register(m)?;
    crate::py_front::register(m)?;
    crate::py_produce::register(m)?;
    crate::tokenize::py::register(m)?;
    crate::ttft_fit::py::register(m)?;
    Ok(())
}
