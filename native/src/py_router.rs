//! PyO3 bindings of the router's decision core: the kv decision's numbers
//! ([`crate::decide`]) and the in-flight accounts ([`crate::inflight`]), for
//! `control_plane/router/decision.py` and `control_plane/router/ledger.py`.
//!
//! Both decline, never guess: whatever the core cannot reproduce exactly (an integer beyond
//! `i64` or the range where `f64` is exact, a block hash that is not a `u64`, a worker listed
//! twice) comes back as `None` / `False` with nothing changed, and the caller refuses the input
//! (`InvalidRoutingInput`). The pure-Python specifications they are tested against are the
//! differential oracles in `tests/oracles/`.

use pyo3::exceptions::{PyKeyError, PyOverflowError, PyTypeError, PyUnicodeEncodeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyIterator, PyList, PyString, PyTuple};

use std::sync::Arc;

use crate::decide;
use crate::index::TIER_NAMES;
use crate::inflight::{matched_depth, Accounts};

/// `o.<name>`: `PyObject_GetAttr` without PyO3's generic argument conversion (a name
/// reference count round trip per call; this runs ~11 times per candidate per decision).
#[inline]
fn attr<'py>(o: &Bound<'py, PyAny>, name: &Bound<'py, PyString>) -> PyResult<Bound<'py, PyAny>> {
    // SAFETY: both pointers are live for 'py; PyObject_GetAttr returns a new reference or NULL
    // with an exception set, which from_owned_ptr_or_err turns into the error.
    unsafe { Bound::from_owned_ptr_or_err(o.py(), pyo3::ffi::PyObject_GetAttr(o.as_ptr(), name.as_ptr())) }
}

/// `ok(None)` for the errors that mean "not a plain integer" (or a worker id that is not valid
/// UTF-8): the caller refuses the input.
fn declined<T>(py: Python<'_>, r: PyResult<Option<T>>) -> PyResult<Option<T>> {
    match r {
        Err(e)
            if e.is_instance_of::<PyTypeError>(py)
                || e.is_instance_of::<PyOverflowError>(py)
                || e.is_instance_of::<PyUnicodeEncodeError>(py) =>
        {
            Ok(None)
        }
        r => r,
    }
}

/// The kv decision's numbers for every candidate (the oracle `tests/oracles/scoring.py`'s `score`
/// loop, then its `pick`: the capacity guard, the imbalance guard and the kv argmin).
///
/// `loads`: the `WorkerLoad`s in id order as `msgspec.structs.astuple` gives them, and
/// `load_at` the positions of `(worker_id, role, registered, draining, queued_prefill_tokens,
/// active_decode_blocks, inflight_requests, kv_capacity_blocks)` in those tuples (one C call
/// per worker in Python instead of eight attribute lookups here); `overlaps`: worker id ->
/// `WorkerOverlap` (a dict); `mine`: worker id -> `InflightLoad`, an `InflightView` (read
/// without a Python object per worker) or a dict. `imbalance`: `(abs, rel)` thresholds when the kv mode's imbalance guard
/// is on, else None; `argmin`: kv mode at temperature 0.
///
/// `rows`: `(CandidateScore, row_at)` to build the score rows here (kv argmin: every row's
/// cost is its kv cost and no row has a probability), `row_at` being the positions of
/// `(worker_id, overlap_blocks, overlap_by_tier, queued_prefill_tokens, active_decode_blocks,
/// inflight_requests, stale, prefill_blocks, decode_blocks, cost, probability, eligible,
/// speculative_overlap, excluded, kv_capacity_blocks)` among its fields (the first 15, called
/// positionally: no keyword matching per row). Excluded rows get `excluded=""`; the caller
/// words them.
///
/// Returns `((queued, active, in_flight, shared, overlap_w, prefill, decode, cost),
/// shared_by_worker, matched, ineligible, pick, rows, row_columns)`: the `scoring.Scored` lists, the
/// non-zero speculative overlaps by worker id (`Decision.speculative_overlap`), the overlap
/// object per candidate (None when unmatched), the positions whose role, drain or registration
/// excludes them (the caller words why), `pick` = `(over, capacity, eligible, imbalance,
/// competing, tied, runner_up)` (see [`decide::Pick`]; `capacity` 0 unchanged, 1 excluded, 2
/// ignored; None when nothing is eligible), and either the score rows (a tuple, when asked for
/// and something is eligible) or the rows' columns `(overlap_blocks, overlap_by_tier, stale,
/// decode_blocks as floats)` for the caller to build them; neither when an overlap has a peer reach
/// (its row also names the source: the caller builds those rows). A peer reach is weighed after
/// the four tiers with the fifth weight (`WorkerOverlap.slots`). None when the inputs leave the
/// exact range or a worker is listed twice.
#[pyfunction]
#[pyo3(signature = (loads, load_at, overlaps, mine, serving_role, n_hash, block_size, prompt_tokens, request_blocks, does_prefill, weights, stale_factor, use_max, prefill_load_scale, capacity_guard, imbalance, argmin, rows))]
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
fn decide_kv<'py>(
    py: Python<'py>,
    loads: &Bound<'py, PyList>,
    load_at: [usize; 8],
    overlaps: &Bound<'py, PyDict>,
    mine: &Bound<'py, PyAny>,
    serving_role: &str,
    n_hash: i64,
    block_size: i64,
    prompt_tokens: i64,
    request_blocks: i64,
    does_prefill: bool,
    weights: Vec<f64>,
    stale_factor: f64,
    use_max: bool,
    prefill_load_scale: f64,
    capacity_guard: bool,
    imbalance: Option<(Bound<'py, PyAny>, f64)>,
    argmin: bool,
    rows: Option<(Bound<'py, PyAny>, [usize; ROW_FIELDS])>,
) -> PyResult<Option<Bound<'py, PyTuple>>> {
    let mut w = [0.0f64; decide::N_SLOTS];
    if weights.len() != decide::N_SLOTS {
        return Err(PyValueError::new_err(format!("{} tier weights, expected {} (the tiers, then peer)", weights.len(), decide::N_SLOTS)));
    }
    w.copy_from_slice(&weights);
    let p = decide::Params {
        n_hash,
        block_size,
        prompt_tokens,
        request_blocks,
        does_prefill,
        weights: w,
        stale_factor,
        use_max,
        prefill_load_scale,
    };
    if let Some((_, at)) = &rows {
        let mut seen = [false; ROW_FIELDS];
        for &k in at {
            if k >= ROW_FIELDS || std::mem::replace(&mut seen[k], true) {
                return Err(PyValueError::new_err("row_at must order CandidateScore's first 15 fields"));
            }
        }
    }
    let r = (|| {
        let guards = pick_params(capacity_guard, imbalance, argmin)?;
        let rows = rows.as_ref().map(|(t, at)| (t, *at));
        decide_all(py, loads, &load_at, overlaps, mine, serving_role, &p, &guards, rows)
    })();
    declined(py, r)
}

/// Where a candidate's in-flight load comes from.
enum Held<'a, 'py> {
    /// A native view: its rows are in worker id order, like the candidates, so one cursor
    /// walks both.
    View(&'a PyInflightView, usize),
    Dict(Bound<'py, PyDict>),
}

impl<'py> Held<'_, 'py> {
    fn of(&mut self, wid: &Bound<'py, PyString>, id: &str) -> PyResult<Option<decide::Mine>> {
        match self {
            Held::View(v, at) => {
                while *at < v.rows.len() && &*v.rows[*at].0 < id {
                    *at += 1;
                }
                Ok(match v.rows.get(*at) {
                    Some((w, m)) if &**w == id => Some(*m),
                    _ => None,
                })
            }
            Held::Dict(d) => match d.get_item(wid)? {
                None => Ok(None),
                Some(m) if m.is_none() => Ok(None),
                Some(m) => {
                    let py = m.py();
                    Ok(Some(decide::Mine {
                        prefill_tokens: attr(&m, intern!(py, "prefill_tokens"))?.extract()?,
                        decode_blocks: attr(&m, intern!(py, "decode_blocks"))?.extract()?,
                        requests: attr(&m, intern!(py, "requests"))?.extract()?,
                        shared_blocks: attr(&m, intern!(py, "shared_blocks"))?.extract()?,
                    }))
                }
            },
        }
    }
}

/// One candidate's Python objects the score row reuses.
struct Row<'py> {
    wid: Bound<'py, PyString>,
    capacity: Bound<'py, PyAny>,
    by_tier: Bound<'py, PyDict>,
    depth: i64,
    stale: bool,
    eligible: bool,
}

/// The score row fields `decide_kv` fills, in this order; `row_at` gives their positions in
/// `CandidateScore`'s fields (the first 15, so a positional call fills them all).
const ROW_FIELDS: usize = 15;

#[allow(clippy::too_many_arguments)]
fn decide_all<'py>(
    py: Python<'py>,
    loads: &Bound<'py, PyList>,
    load_at: &[usize; 8],
    overlaps: &Bound<'py, PyDict>,
    mine: &Bound<'py, PyAny>,
    serving_role: &str,
    p: &decide::Params,
    guards: &decide::PickParams,
    row_type: Option<(&Bound<'py, PyAny>, [usize; ROW_FIELDS])>,
) -> PyResult<Option<Bound<'py, PyTuple>>> {
    let n = loads.len();
    let [at_id, at_role, at_registered, at_draining, at_queued, at_active, at_inflight, at_capacity] = *load_at;
    let mut held = match mine.cast::<PyInflightView>() {
        Ok(v) => Held::View(v.get(), 0),
        Err(_) => Held::Dict(match mine.cast::<PyDict>() {
            Ok(d) => d.clone(),
            Err(_) => {
                let d = PyDict::new(py);
                d.update(mine.cast::<pyo3::types::PyMapping>().map_err(PyErr::from)?)?;
                d
            }
        }),
    };
    let tier_names = TIER_NAMES.map(|t| PyString::intern(py, t));
    let mut terms: Vec<decide::Terms> = Vec::with_capacity(n);
    let mut capacity: Vec<i64> = Vec::with_capacity(n);
    let mut rows: Vec<Row<'py>> = Vec::with_capacity(n);
    let matched = PyList::empty(py);
    let mut ineligible: Vec<usize> = Vec::new();
    let mut eligible: Vec<usize> = Vec::with_capacity(n);
    let mut tiers = [0i64; decide::N_SLOTS];
    // A peer reach's row also names its source (`peer_from`): the caller builds those rows.
    let mut has_peer = false;
    let none = py.None().into_bound(py);
    for (i, worker) in loads.iter().enumerate() {
        let worker = worker.cast_into::<PyTuple>().map_err(PyErr::from)?;
        let field = |k: usize| worker.get_item(k);
        let wid = field(at_id)?.cast_into::<PyString>().map_err(PyErr::from)?;
        let id = wid.to_str()?;
        if let Some(prev) = rows.last() {
            let prev = prev.wid.to_str()?;
            if prev == id {
                return Ok(None); // listed twice: the caller words the error
            }
            if prev > id {
                return Err(PyValueError::new_err("candidates must be in worker id order"));
            }
        }
        let load = decide::Load {
            queued_prefill_tokens: field(at_queued)?.extract()?,
            active_decode_blocks: field(at_active)?.extract()?,
            inflight_requests: field(at_inflight)?.extract()?,
        };
        let m = held.of(&wid, id)?;
        let ov = overlaps.get_item(&wid)?.filter(|o| !o.is_none());
        let by_tier = PyDict::new(py);
        let (mut depth, mut stale) = (0i64, false);
        let scored = match &ov {
            None => decide::score(p, load, m, None),
            Some(o) => {
                let t = attr(o, intern!(py, "tiers"))?.cast_into::<PyTuple>().map_err(PyErr::from)?;
                if t.len() > decide::N_TIERS {
                    return Ok(None);
                }
                for (k, c) in t.iter().enumerate() {
                    tiers[k] = c.extract()?;
                    if tiers[k] != 0 {
                        by_tier.set_item(&tier_names[k], &c)?;
                        let Some(d) = depth.checked_add(tiers[k]) else { return Ok(None) };
                        depth = d;
                    }
                }
                let peer: i64 = attr(o, intern!(py, "peer"))?.extract()?;
                let used = if peer != 0 {
                    // `WorkerOverlap.slots()`: the tiers padded to N_TIERS, then the peer reach.
                    has_peer = true;
                    tiers[t.len()..decide::N_TIERS].fill(0);
                    tiers[decide::N_TIERS] = peer;
                    decide::N_SLOTS
                } else {
                    t.len()
                };
                stale = attr(o, intern!(py, "stale"))?.is_truthy()?;
                decide::score(p, load, m, Some(decide::Overlap { tiers: &tiers[..used], stale }))
            }
        };
        let Some(scored) = scored else { return Ok(None) };
        matched.append(ov.as_ref().unwrap_or(&none))?;
        let serves = match field(at_role)?.cast::<PyString>() {
            Ok(r) => r.to_str()? == serving_role,
            Err(_) => return Ok(None),
        };
        let is_eligible =
            serves && !field(at_draining)?.is_truthy()? && field(at_registered)?.is_truthy()?;
        if is_eligible {
            eligible.push(i);
        } else {
            ineligible.push(i);
        }
        let cap = field(at_capacity)?;
        capacity.push(if guards.capacity_guard { cap.extract()? } else { 0 });
        terms.push(scored);
        rows.push(Row { wid, capacity: cap, by_tier, depth, stale, eligible: is_eligible });
    }
    let pick = if eligible.is_empty() {
        None
    } else {
        let Some(pk) = decide::pick(&terms, &capacity, eligible, guards) else { return Ok(None) };
        if pk.capacity == decide::Capacity::Excluded {
            for &i in &pk.over {
                rows[i].eligible = false;
            }
        }
        Some(pk)
    };
    // Each term becomes one Python object, shared by its column and its score row.
    let int = |x: i64| x.into_pyobject(py).map(Bound::into_any);
    let float = |x: f64| Ok::<_, PyErr>(PyFloat::new(py, x).into_any());
    let mut cols: [Vec<Bound<'py, PyAny>>; 8] = Default::default();
    for c in cols.iter_mut() {
        c.reserve(n);
    }
    for t in &terms {
        cols[0].push(int(t.queued)?);
        cols[1].push(int(t.active)?);
        cols[2].push(int(t.in_flight)?);
        cols[3].push(int(t.shared)?);
        cols[4].push(float(t.overlap_w)?);
        cols[5].push(float(t.prefill)?);
        cols[6].push(int(t.decode)?);
        cols[7].push(float(t.cost)?);
    }
    let (score_rows, row_columns) = match (row_type, &pick) {
        _ if has_peer => (None, None),
        (Some((row_type, at)), Some(_)) => {
            let empty = PyString::intern(py, "");
            let mut out = Vec::with_capacity(n);
            for (i, (r, t)) in rows.iter().zip(&terms).enumerate() {
                let values: [Bound<'py, PyAny>; ROW_FIELDS] = [
                    r.wid.clone().into_any(),
                    int(r.depth)?,
                    r.by_tier.clone().into_any(),
                    cols[0][i].clone(),
                    cols[1][i].clone(),
                    cols[2][i].clone(),
                    PyBool::new(py, r.stale).to_owned().into_any(),
                    cols[5][i].clone(),
                    float(t.decode as f64)?,
                    cols[7][i].clone(),
                    none.clone(),
                    PyBool::new(py, r.eligible).to_owned().into_any(),
                    cols[3][i].clone(),
                    empty.clone().into_any(),
                    r.capacity.clone(),
                ];
                let mut args: [Option<Bound<'py, PyAny>>; ROW_FIELDS] = Default::default();
                for (k, v) in values.into_iter().enumerate() {
                    args[at[k]] = Some(v);
                }
                let args = PyTuple::new(py, args.into_iter().map(|a| a.expect("row_at is a permutation")))?;
                out.push(row_type.call1(args)?);
            }
            (Some(PyTuple::new(py, out)?), None)
        }
        _ => {
            let blocks = PyList::new(py, rows.iter().map(|r| r.depth))?;
            let named = PyList::new(py, rows.iter().map(|r| r.by_tier.clone()))?;
            let stale = PyList::new(py, rows.iter().map(|r| r.stale))?;
            let decode_f = PyList::new(py, terms.iter().map(|t| t.decode as f64))?;
            (None, Some((blocks, named, stale, decode_f)))
        }
    };
    let pick = match pick {
        None => None,
        Some(pk) => Some(pick_tuple(py, pk)?),
    };
    let shared_by_worker = PyDict::new(py);
    for ((r, t), s) in rows.iter().zip(&terms).zip(&cols[3]) {
        if t.shared != 0 {
            shared_by_worker.set_item(&r.wid, s)?;
        }
    }
    let [q, a, r, sh, ow, pf, d, c] = cols.map(|col| PyList::new(py, col));
    let out = (
        (q?, a?, r?, sh?, ow?, pf?, d?, c?),
        shared_by_worker,
        matched,
        PyList::new(py, ineligible)?,
        pick,
        score_rows,
        row_columns,
    );
    Ok(Some(out.into_pyobject(py)?))
}

/// A [`decide::Pick`] as `scoring.Pick`'s positional fields.
#[allow(clippy::type_complexity)]
/// The guards' and the argmin's parameters from the bindings' arguments: `imbalance` is the kv
/// mode's `(abs, rel)` thresholds, None when its guard is off.
fn pick_params(capacity_guard: bool, imbalance: Option<(Bound<'_, PyAny>, f64)>, argmin: bool) -> PyResult<decide::PickParams> {
    let (abs, rel) = match imbalance {
        Some((abs, rel)) => (Some(abs.extract::<i64>()?), rel),
        None => (None, 0.0),
    };
    Ok(decide::PickParams { capacity_guard, imbalance_guard: abs.is_some(), imbalance_abs: abs.unwrap_or(0), imbalance_rel: rel, argmin })
}

fn pick_tuple(
    py: Python<'_>,
    pk: decide::Pick,
) -> PyResult<(Bound<'_, PyList>, u8, Bound<'_, PyList>, Option<(i64, i64)>, Bound<'_, PyList>, Bound<'_, PyList>, Option<usize>)> {
    Ok((
        PyList::new(py, pk.over)?,
        pk.capacity as u8,
        PyList::new(py, pk.eligible)?,
        pk.imbalance,
        PyList::new(py, pk.competing)?,
        PyList::new(py, pk.tied)?,
        pk.runner_up,
    ))
}

/// The guards and the kv argmin ([`decide::pick`]) over costs the caller computed: the routing
/// decision's TTFT cost (`RouterConfig.cost == "ttft"`), whose costs are predictions made after
/// `decide_kv` scored the terms. `cost`, `in_flight`, `decode` and `capacity` are per candidate
/// (id order), `eligible` the positions role, drain and registration leave (not empty).
/// Returns `pick` as `decide_kv` does; None when an integer leaves the exact range.
#[pyfunction]
#[pyo3(signature = (cost, in_flight, decode, capacity, eligible, capacity_guard, imbalance, argmin))]
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
fn pick_kv<'py>(
    py: Python<'py>,
    cost: Vec<f64>,
    in_flight: Bound<'py, PyAny>,
    decode: Bound<'py, PyAny>,
    capacity: Bound<'py, PyAny>,
    eligible: Vec<usize>,
    capacity_guard: bool,
    imbalance: Option<(Bound<'py, PyAny>, f64)>,
    argmin: bool,
) -> PyResult<Option<Bound<'py, PyTuple>>> {
    let n = cost.len();
    let r = (|| {
        let in_flight: Vec<i64> = in_flight.extract()?;
        let decode: Vec<i64> = decode.extract()?;
        let capacity: Vec<i64> = capacity.extract()?;
        if in_flight.len() != n || decode.len() != n || capacity.len() != n || eligible.iter().any(|&i| i >= n) {
            return Err(PyValueError::new_err("pick_kv: one cost, in-flight, decode and capacity per candidate"));
        }
        if eligible.is_empty() {
            return Err(PyValueError::new_err("pick_kv: no eligible candidate"));
        }
        let guards = pick_params(capacity_guard, imbalance, argmin)?;
        let terms: Vec<decide::Terms> = (0..n)
            .map(|i| decide::Terms { cost: cost[i], in_flight: in_flight[i], decode: decode[i], ..decide::Terms::default() })
            .collect();
        match decide::pick(&terms, &capacity, eligible, &guards) {
            None => Ok(None),
            Some(pk) => Ok(Some(pick_tuple(py, pk)?.into_pyobject(py)?)),
        }
    })();
    declined(py, r)
}

/// The in-flight ledger's accounts (see [`crate::inflight`]): per worker, the in-flight load and a
/// refcount per held prompt block hash. Mutations return False, changing nothing, for what
/// they cannot hold exactly (a hash that is not a `u64`, a counter beyond `i64`); queries
/// return None for a query hash that is not a `u64`. The ledger then refuses the input.
#[pyclass(module = "switchyard_native", name = "InflightAccounts")]
struct PyAccounts {
    inner: Accounts,
    /// `InflightLoad`, the type `load` and `view` build.
    load_type: Py<PyAny>,
    chain: Vec<u64>,
    /// `view`'s converted query hashes: `probes[i]` is valid when `stamps[i] == stamp` (no
    /// clearing per query).
    probes: Vec<u64>,
    stamps: Vec<u32>,
    stamp: u32,
}

impl PyAccounts {
    /// `hashes` into `self.chain`; false if one is not a `u64`.
    fn take_chain(&mut self, hashes: &Bound<'_, PyAny>) -> PyResult<bool> {
        self.chain.clear();
        for h in hashes.try_iter()? {
            match hash_u64(&h?) {
                Ok(v) => self.chain.push(v),
                Err(_) => return Ok(false),
            }
        }
        Ok(true)
    }
}

/// A block hash as a `u64`, the error of `extract::<u64>` otherwise. Half of all hashes are
/// below 2^63, where `PyLong_AsLongLongAndOverflow` reads the digits directly; CPython 3.11's
/// `PyLong_AsUnsignedLongLong` always goes through a byte-array conversion.
#[inline]
fn hash_u64(h: &Bound<'_, PyAny>) -> PyResult<u64> {
    let mut overflow = 0;
    // SAFETY: a live object; the call raises (and returns -1) for a non-int.
    let v = unsafe { pyo3::ffi::PyLong_AsLongLongAndOverflow(h.as_ptr(), &mut overflow) };
    if overflow == 0 && v >= 0 {
        return Ok(v as u64);
    }
    if let Some(e) = PyErr::take(h.py()) {
        return Err(e);
    }
    h.extract::<u64>()
}

fn int(o: &Bound<'_, PyAny>) -> Option<i64> {
    o.extract::<i64>().ok()
}

#[pymethods]
impl PyAccounts {
    #[new]
    fn new(load_type: Py<PyAny>) -> Self {
        PyAccounts { inner: Accounts::default(), load_type, chain: Vec::new(), probes: Vec::new(), stamps: Vec::new(), stamp: 0 }
    }

    fn add(&mut self, worker: &str, hashes: &Bound<'_, PyAny>, prefill: &Bound<'_, PyAny>, extra: &Bound<'_, PyAny>) -> PyResult<bool> {
        let (Some(p), Some(e)) = (int(prefill), int(extra)) else { return Ok(false) };
        Ok(self.take_chain(hashes)? && self.inner.add(worker, &self.chain, p, e))
    }

    fn remove(&mut self, worker: &str, hashes: &Bound<'_, PyAny>, prefill: &Bound<'_, PyAny>, extra: &Bound<'_, PyAny>) -> PyResult<bool> {
        let (Some(p), Some(e)) = (int(prefill), int(extra)) else { return Ok(false) };
        Ok(self.take_chain(hashes)? && self.inner.remove(worker, &self.chain, p, e))
    }

    fn prefill_done(&mut self, worker: &str, tokens: &Bound<'_, PyAny>) -> bool {
        int(tokens).is_some_and(|t| self.inner.prefill_done(worker, t))
    }

    /// `InflightLoad(prefill_tokens, blocks, requests)`, or None when `worker` has no account.
    fn load<'py>(&self, py: Python<'py>, worker: &str) -> PyResult<Option<Bound<'py, PyAny>>> {
        let Some(a) = self.inner.get(worker) else { return Ok(None) };
        let blocks = a.blocks().ok_or_else(|| PyOverflowError::new_err("blocks beyond i64"))?;
        Ok(Some(self.load_type.bind(py).call1((a.prefill_tokens, blocks, a.requests))?))
    }

    /// The speculative overlap of `hashes` on `worker`; None for a hash that is not a `u64`.
    fn overlap(&self, worker: &str, hashes: &Bound<'_, PyTuple>) -> PyResult<Option<usize>> {
        let Some(a) = self.inner.get(worker) else { return Ok(Some(0)) };
        let mut bad = None;
        let d = matched_depth(a, hashes.len(), |i| probed(hashes, i, &mut bad));
        match bad {
            None => Ok(Some(d)),
            Some(e) => declined(hashes.py(), Err(e)),
        }
    }

    /// The `InflightView` of `hashes`: per open account, its load and the speculative overlap
    /// of `hashes`; None for a hash that is not a `u64`.
    fn view(&mut self, py: Python<'_>, hashes: &Bound<'_, PyTuple>) -> PyResult<Option<PyInflightView>> {
        let n = hashes.len();
        // Each worker's binary search probes its own positions; a probe converts once.
        if self.stamps.len() < n {
            self.probes.resize(n, 0);
            self.stamps.resize(n, 0);
        }
        self.stamp = self.stamp.wrapping_add(1);
        if self.stamp == 0 {
            self.stamps.fill(0);
            self.stamp = 1;
        }
        let (probes, stamps, stamp) = (&mut self.probes, &mut self.stamps, self.stamp);
        let mut bad: Option<PyErr> = None;
        let mut rows = Vec::with_capacity(self.inner.len());
        let mut slots = Vec::with_capacity(self.inner.len());
        for (worker, slot, a) in self.inner.iter_by_id() {
            let depth = matched_depth(a, n, |i| {
                if stamps[i] != stamp {
                    probes[i] = probed(hashes, i, &mut bad);
                    stamps[i] = stamp;
                }
                probes[i]
            });
            if let Some(e) = bad {
                return declined(py, Err(e));
            }
            let blocks = a.blocks().ok_or_else(|| PyOverflowError::new_err("blocks beyond i64"))?;
            let shared_blocks = depth as i64;
            slots.push((slot, rows.len()));
            rows.push((
                worker.clone(),
                decide::Mine { prefill_tokens: a.prefill_tokens, decode_blocks: blocks, requests: a.requests, shared_blocks },
            ));
        }
        slots.sort_unstable();
        let order = slots.into_iter().map(|(_, r)| r).collect();
        Ok(Some(PyInflightView { rows, order, load_type: self.load_type.clone_ref(py) }))
    }

    /// Every account as `(worker, [(hash, refcount), ...], prefill_tokens, extra_blocks,
    /// requests)`, in opening order (hashes in no particular order).
    #[allow(clippy::type_complexity)]
    fn export(&self) -> Vec<(String, Vec<(u64, u64)>, i64, i64, i64)> {
        self.inner
            .iter()
            .map(|(w, a)| (w.to_owned(), a.refs().collect(), a.prefill_tokens, a.extra_blocks, a.requests))
            .collect()
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }
}

/// What `InflightAccounts.view` returns: worker id -> `InflightLoad(prefill_tokens, blocks,
/// requests, speculative overlap)` for every worker with requests in flight, a read-only
/// mapping (registered as a `collections.abc.Mapping`) that iterates like the specification's
/// dict, in the order the accounts opened. It holds plain numbers: `decide_kv` reads them
/// directly, and an `InflightLoad` is built only when Python asks for one.
#[pyclass(module = "switchyard_native", name = "InflightView", frozen)]
struct PyInflightView {
    /// (worker, load), in worker id order.
    rows: Vec<(Arc<str>, decide::Mine)>,
    /// Positions in `rows`, in the order the accounts opened.
    order: Vec<usize>,
    load_type: Py<PyAny>,
}

impl PyInflightView {
    fn find(&self, key: &Bound<'_, PyAny>) -> Option<&decide::Mine> {
        let key = key.cast::<PyString>().ok()?;
        let key = key.to_str().ok()?;
        self.rows.binary_search_by(|(w, _)| (**w).cmp(key)).ok().map(|i| &self.rows[i].1)
    }

    fn load<'py>(&self, py: Python<'py>, m: &decide::Mine) -> PyResult<Bound<'py, PyAny>> {
        self.load_type.bind(py).call1((m.prefill_tokens, m.decode_blocks, m.requests, m.shared_blocks))
    }

    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for &r in &self.order {
            let (w, m) = &self.rows[r];
            d.set_item(&**w, self.load(py, m)?)?;
        }
        Ok(d)
    }
}

#[pymethods]
impl PyInflightView {
    fn __len__(&self) -> usize {
        self.rows.len()
    }

    fn __getitem__<'py>(&self, py: Python<'py>, key: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        match self.find(key) {
            Some(m) => self.load(py, m),
            None => Err(PyKeyError::new_err(key.clone().unbind())),
        }
    }

    #[pyo3(signature = (key, default=None))]
    fn get<'py>(&self, py: Python<'py>, key: &Bound<'py, PyAny>, default: Option<Bound<'py, PyAny>>) -> PyResult<Bound<'py, PyAny>> {
        match self.find(key) {
            Some(m) => self.load(py, m),
            None => Ok(default.unwrap_or_else(|| py.None().into_bound(py))),
        }
    }

    fn __contains__(&self, key: &Bound<'_, PyAny>) -> bool {
        self.find(key).is_some()
    }

    fn keys<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.order.iter().map(|&r| &*self.rows[r].0))
    }

    fn values<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let out = PyList::empty(py);
        for &r in &self.order {
            out.append(self.load(py, &self.rows[r].1)?)?;
        }
        Ok(out)
    }

    fn items<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let out = PyList::empty(py);
        for &r in &self.order {
            let (w, m) = &self.rows[r];
            out.append((&**w, self.load(py, m)?))?;
        }
        Ok(out)
    }

    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyIterator>> {
        self.keys(py)?.try_iter()
    }

    /// Equal to another view or a dict with the same items (a dict's equality).
    fn __eq__<'py>(&self, py: Python<'py>, other: &Bound<'py, PyAny>) -> PyResult<Py<PyAny>> {
        let theirs = match other.cast::<PyInflightView>() {
            Ok(v) => v.get().to_dict(py)?.into_any(),
            Err(_) if other.is_instance_of::<PyDict>() => other.clone(),
            Err(_) => return Ok(py.NotImplemented()),
        };
        Ok(PyBool::new(py, self.to_dict(py)?.eq(theirs)?).to_owned().into_any().unbind())
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!("InflightView({})", self.to_dict(py)?.repr()?))
    }
}

/// `hashes[i]` as a `u64`; the first failure is kept in `bad` (the search's answer is then
/// discarded) and 0 stands in for it.
fn probed(hashes: &Bound<'_, PyTuple>, i: usize, bad: &mut Option<PyErr>) -> u64 {
    match hashes.get_item(i).and_then(|h| hash_u64(&h)) {
        Ok(v) => v,
        Err(e) => {
            bad.get_or_insert(e);
            0
        }
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(decide_kv, m)?)?;
    m.add_function(wrap_pyfunction!(pick_kv, m)?)?;
    m.add_class::<PyAccounts>()?;
    m.add_class::<PyInflightView>()?;
    Ok(())
}
