//! PyO3 bindings of the router's decision core: the kv decision's numbers
//! ([`crate::decide`]) and the in-flight accounts ([`crate::inflight`]), for
//! `control_plane/router/decision.py` and `control_plane/router/ledger.py`.
//!
//! Both decline, never guess: whatever the core cannot reproduce exactly (an integer beyond
//! `i64` or the range where `f64` is exact, a block hash that is not a `u64`, a worker listed
//! twice) comes back as `None` / `False` with nothing changed, and the caller runs the Python
//! specification instead.

use pyo3::exceptions::{PyOverflowError, PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString, PyTuple};

use crate::decide;
use crate::inflight::{matched_depth, Accounts};

/// `ok(None)` for the errors that mean "not a plain integer": the specification copes or raises.
fn declined<T>(py: Python<'_>, r: PyResult<Option<T>>) -> PyResult<Option<T>> {
    match r {
        Err(e) if e.is_instance_of::<PyTypeError>(py) || e.is_instance_of::<PyOverflowError>(py) => Ok(None),
        r => r,
    }
}

/// The kv decision's numbers for every candidate (`decision.py`'s `_score` loop, then the
/// capacity guard, the imbalance guard and the argmin of `decide` / `_choose_kv`).
///
/// `ordered`: the `WorkerLoad`s in id order; `overlaps`: worker id -> `WorkerOverlap`; `mine`:
/// worker id -> `InflightLoad` (both dicts). `imbalance`: `(abs, rel)` thresholds when the kv
/// mode's imbalance guard is on, else None; `argmin`: kv mode at temperature 0.
///
/// Returns `(queued, active, in_flight, shared, overlap_w, prefill, decode, cost, matched,
/// ineligible, pick)`: the `_Scored` lists, the overlap object per candidate (None when
/// unmatched), the positions whose role, drain or registration excludes them (the caller words
/// why), and `pick` = `(over, capacity, eligible, imbalance, competing, tied, runner_up)` (see
/// [`decide::Pick`]; `capacity` 0 unchanged, 1 excluded, 2 ignored; None when nothing is
/// eligible). None when the specification must decide instead.
#[pyfunction]
#[pyo3(signature = (ordered, overlaps, mine, serving_role, n_hash, block_size, prompt_tokens, request_blocks, does_prefill, weights, stale_factor, use_max, prefill_load_scale, capacity_guard, imbalance, argmin))]
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
fn decide_kv<'py>(
    py: Python<'py>,
    ordered: &Bound<'py, PyList>,
    overlaps: &Bound<'py, PyDict>,
    mine: &Bound<'py, PyDict>,
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
) -> PyResult<Option<Bound<'py, PyTuple>>> {
    let mut w = [0.0f64; decide::N_TIERS];
    if weights.len() != decide::N_TIERS {
        return Err(PyValueError::new_err(format!("{} tier weights, expected {}", weights.len(), decide::N_TIERS)));
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
    let r = (|| {
        let (abs, rel) = match imbalance {
            Some((abs, rel)) => (Some(abs.extract::<i64>()?), rel),
            None => (None, 0.0),
        };
        let guards = decide::PickParams {
            capacity_guard,
            imbalance_guard: abs.is_some(),
            imbalance_abs: abs.unwrap_or(0),
            imbalance_rel: rel,
            argmin,
        };
        decide_all(py, ordered, overlaps, mine, serving_role, &p, &guards)
    })();
    declined(py, r)
}

fn decide_all<'py>(
    py: Python<'py>,
    ordered: &Bound<'py, PyList>,
    overlaps: &Bound<'py, PyDict>,
    mine: &Bound<'py, PyDict>,
    serving_role: &str,
    p: &decide::Params,
    guards: &decide::PickParams,
) -> PyResult<Option<Bound<'py, PyTuple>>> {
    let n = ordered.len();
    let mut terms: Vec<decide::Terms> = Vec::with_capacity(n);
    let mut capacity: Vec<i64> = Vec::with_capacity(if guards.capacity_guard { n } else { 0 });
    let matched = PyList::empty(py);
    let mut ineligible: Vec<usize> = Vec::new();
    let mut eligible: Vec<usize> = Vec::with_capacity(n);
    let mut previous: Option<Bound<'py, PyString>> = None;
    let mut tiers = [0i64; decide::N_TIERS];
    let none = py.None().into_bound(py);
    for (i, worker) in ordered.iter().enumerate() {
        let wid = worker.getattr(intern!(py, "worker_id"))?.cast_into::<PyString>().map_err(PyErr::from)?;
        if let Some(prev) = &previous {
            if prev.to_str()? == wid.to_str()? {
                return Ok(None);
            }
        }
        let load = decide::Load {
            queued_prefill_tokens: worker.getattr(intern!(py, "queued_prefill_tokens"))?.extract()?,
            active_decode_blocks: worker.getattr(intern!(py, "active_decode_blocks"))?.extract()?,
            inflight_requests: worker.getattr(intern!(py, "inflight_requests"))?.extract()?,
        };
        let m = match mine.get_item(&wid)? {
            None => None,
            Some(m) if m.is_none() => None,
            Some(m) => Some(decide::Mine {
                prefill_tokens: m.getattr(intern!(py, "prefill_tokens"))?.extract()?,
                decode_blocks: m.getattr(intern!(py, "decode_blocks"))?.extract()?,
                requests: m.getattr(intern!(py, "requests"))?.extract()?,
                shared_blocks: m.getattr(intern!(py, "shared_blocks"))?.extract()?,
            }),
        };
        let ov = overlaps.get_item(&wid)?.filter(|o| !o.is_none());
        let scored = match &ov {
            None => decide::score(p, load, m, None),
            Some(o) => {
                let t = o.getattr(intern!(py, "tiers"))?.cast_into::<PyTuple>().map_err(PyErr::from)?;
                if t.len() > decide::N_TIERS {
                    return Ok(None);
                }
                for (k, c) in t.iter().enumerate() {
                    tiers[k] = c.extract()?;
                }
                let stale = o.getattr(intern!(py, "stale"))?.is_truthy()?;
                decide::score(p, load, m, Some(decide::Overlap { tiers: &tiers[..t.len()], stale }))
            }
        };
        let Some(scored) = scored else { return Ok(None) };
        matched.append(ov.as_ref().unwrap_or(&none))?;
        let role = worker.getattr(intern!(py, "role"))?;
        let serves = match role.cast::<PyString>() {
            Ok(r) => r.to_str()? == serving_role,
            Err(_) => return Ok(None),
        };
        if !serves
            || worker.getattr(intern!(py, "draining"))?.is_truthy()?
            || !worker.getattr(intern!(py, "registered"))?.is_truthy()?
        {
            ineligible.push(i);
        } else {
            eligible.push(i);
        }
        if guards.capacity_guard {
            capacity.push(worker.getattr(intern!(py, "kv_capacity_blocks"))?.extract()?);
        }
        terms.push(scored);
        previous = Some(wid);
    }
    let pick = if eligible.is_empty() {
        None
    } else {
        if !guards.capacity_guard {
            capacity.resize(n, 0);
        }
        let Some(pk) = decide::pick(&terms, &capacity, eligible, guards) else { return Ok(None) };
        Some((
            PyList::new(py, pk.over)?,
            pk.capacity as u8,
            PyList::new(py, pk.eligible)?,
            pk.imbalance,
            PyList::new(py, pk.competing)?,
            PyList::new(py, pk.tied)?,
            pk.runner_up,
        ))
    };
    let col = |f: fn(&decide::Terms) -> i64| PyList::new(py, terms.iter().map(f));
    let fcol = |f: fn(&decide::Terms) -> f64| PyList::new(py, terms.iter().map(f));
    let out = (
        col(|t| t.queued)?,
        col(|t| t.active)?,
        col(|t| t.in_flight)?,
        col(|t| t.shared)?,
        fcol(|t| t.overlap_w)?,
        fcol(|t| t.prefill)?,
        col(|t| t.decode)?,
        fcol(|t| t.cost)?,
        matched,
        PyList::new(py, ineligible)?,
        pick,
    );
    Ok(Some(out.into_pyobject(py)?))
}

/// `ledger._Accounts` natively (see [`crate::inflight`]): per worker, the in-flight load and a
/// refcount per held prompt block hash. Mutations return False, changing nothing, for what
/// they cannot hold exactly (a hash that is not a `u64`, a counter beyond `i64`); queries
/// return None for a query hash that is not a `u64`. The ledger then moves to the Python
/// accounts (`export` gives their state) and carries on there.
#[pyclass(module = "switchyard_native", name = "InflightAccounts")]
struct PyAccounts {
    inner: Accounts,
    /// `InflightLoad`, the type `load` and `view` build.
    load_type: Py<PyAny>,
    chain: Vec<u64>,
}

impl PyAccounts {
    /// `hashes` into `self.chain`; false if one is not a `u64`.
    fn take_chain(&mut self, hashes: &Bound<'_, PyAny>) -> PyResult<bool> {
        self.chain.clear();
        for h in hashes.try_iter()? {
            match h?.extract::<u64>() {
                Ok(v) => self.chain.push(v),
                Err(_) => return Ok(false),
            }
        }
        Ok(true)
    }
}

fn int(o: &Bound<'_, PyAny>) -> Option<i64> {
    o.extract::<i64>().ok()
}

#[pymethods]
impl PyAccounts {
    #[new]
    fn new(load_type: Py<PyAny>) -> Self {
        PyAccounts { inner: Accounts::default(), load_type, chain: Vec::new() }
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
        let py = hashes.py();
        declined(py, (|| {
            let mut bad = None;
            let d = matched_depth(a, hashes.len(), |i| probed(hashes, i, &mut bad));
            bad.map_or(Ok(Some(d)), Err)
        })())
    }

    /// `{worker: InflightLoad(prefill_tokens, blocks, requests, speculative overlap)}` for every
    /// open account, in opening order; None for a hash that is not a `u64`.
    fn view<'py>(&self, py: Python<'py>, hashes: &Bound<'py, PyTuple>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let n = hashes.len();
        // Each worker's binary search probes its own positions; a probe converts once.
        let mut cache: Vec<Option<u64>> = vec![None; n];
        let mut bad: Option<PyErr> = None;
        let load_type = self.load_type.bind(py);
        let out = PyDict::new(py);
        for (worker, a) in self.inner.iter() {
            let depth = matched_depth(a, n, |i| match cache[i] {
                Some(h) => h,
                None => {
                    let h = probed(hashes, i, &mut bad);
                    cache[i] = Some(h);
                    h
                }
            });
            if bad.is_some() {
                break;
            }
            let blocks = a.blocks().ok_or_else(|| PyOverflowError::new_err("blocks beyond i64"))?;
            out.set_item(worker, load_type.call1((a.prefill_tokens, blocks, a.requests, depth))?)?;
        }
        match bad {
            None => Ok(Some(out)),
            Some(e) => declined(py, Err(e)),
        }
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

/// `hashes[i]` as a `u64`; the first failure is kept in `bad` (the search's answer is then
/// discarded) and 0 stands in for it.
fn probed(hashes: &Bound<'_, PyTuple>, i: usize, bad: &mut Option<PyErr>) -> u64 {
    match hashes.get_item(i).and_then(|h| h.extract::<u64>()) {
        Ok(v) => v,
        Err(e) => {
            bad.get_or_insert(e);
            0
        }
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(decide_kv, m)?)?;
    m.add_class::<PyAccounts>()?;
    Ok(())
}
