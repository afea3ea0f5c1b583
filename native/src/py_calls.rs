//! PyO3 bindings of [`crate::calls`]: the client `control_plane/router/worker_calls.py` wraps
//! into the router's `WorkerCalls`. Nothing here blocks: Python waits on its event loop, woken
//! through `fileno()`, and takes what is ready.

use bytes::Bytes;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};
use std::time::Duration;

use crate::calls::{Call, Client, Config, Failure, Head, Relayed, Take};
use crate::sse::{mono_now, Event, Reader, Relay, RelayEnd};

#[pyclass(module = "switchyard_native", name = "WorkerClient")]
struct PyClient {
    inner: Client,
}

fn failed<'py>(py: Python<'py>, f: &Failure) -> PyResult<Bound<'py, PyAny>> {
    Ok(PyTuple::new(py, [f.code, f.detail.as_str()])?.into_any())
}

#[pymethods]
impl PyClient {
    #[new]
    fn new(connect_timeout_s: f64, read_timeout_s: f64, keep_alive_s: f64, drain_s: f64, max_connections: usize) -> PyResult<Self> {
        let cfg = Config {
            connect_timeout: Duration::from_secs_f64(connect_timeout_s),
            read_timeout: Duration::from_secs_f64(read_timeout_s),
            keep_alive: Duration::from_secs_f64(keep_alive_s),
            drain: Duration::from_secs_f64(drain_s),
            max_connections,
        };
        Ok(PyClient { inner: Client::new(cfg).map_err(|e| PyRuntimeError::new_err(e.to_string()))? })
    }

    /// The descriptor that becomes readable when calls are ready.
    fn fileno(&self) -> i32 {
        self.inner.wake_fd()
    }

    /// The ids of the calls that changed since they were last found pending.
    fn take_ready(&self) -> Vec<u64> {
        self.inner.take_ready()
    }

    /// (calls in flight, calls ready and not taken, connections busy, connections idle).
    fn load(&self) -> (usize, usize, usize, usize) {
        let l = self.inner.load();
        (l.calls, l.ready, l.busy, l.idle)
    }

    /// POST ``body`` to ``url`` with ``headers``; ``relay``: a 2xx answer is read to its end by
    /// the crate (``WorkerCall.relayed``). ValueError when it cannot be put on the wire.
    #[pyo3(signature = (url, body, headers, relay=false))]
    fn post(&mut self, url: &str, body: &[u8], headers: Vec<(String, String)>, relay: bool) -> PyResult<PyCall> {
        let call = self.inner.post(url, Bytes::copy_from_slice(body), &headers, relay).map_err(PyValueError::new_err)?;
        Ok(PyCall { call })
    }

    /// Ends every call and closes every connection.
    fn close(&mut self) {
        self.inner.shutdown();
    }
}

#[pyclass(module = "switchyard_native", name = "WorkerCall")]
struct PyCall {
    call: Call,
}

#[pymethods]
impl PyCall {
    #[getter]
    fn id(&self) -> u64 {
        self.call.id()
    }

    /// The status (int), None while pending (the call is then made ready when it changes), or
    /// the failure as ``(code, detail)``.
    fn head<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        match self.call.head() {
            Head::Pending => Ok(py.None().into_bound(py)),
            Head::Status(s) => Ok(s.into_pyobject(py)?.into_any()),
            Head::Failed(f) => failed(py, &f),
        }
    }

    /// What arrived since the last take, as one bytes (non-empty); ``b""`` at the end; None while
    /// pending (the call is then made ready when it changes); the failure as ``(code, detail)``.
    fn take<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        match self.call.take() {
            Take::Pending => Ok(py.None().into_bound(py)),
            Take::Data(chunks) => {
                if chunks.len() == 1 {
                    return Ok(PyBytes::new(py, &chunks[0]).into_any());
                }
                let len = chunks.iter().map(|c| c.len()).sum();
                Ok(PyBytes::new_with(py, len, |buf| {
                    let mut at = 0;
                    for c in &chunks {
                        buf[at..at + c.len()].copy_from_slice(c);
                        at += c.len();
                    }
                    Ok(())
                })?
                .into_any())
            }
            Take::End => Ok(PyBytes::new(py, b"").into_any()),
            Take::Failed(f) => failed(py, &f),
        }
    }

    /// A relayed call's answer (a 2xx head): None while pending (the call is then made ready when
    /// there is news: its first token, its end), the first token's time (``time.monotonic()``'s
    /// clock) unless ``first_known``, or the whole answer (:class:`RelayedAnswer`, given once).
    fn relayed<'py>(&self, py: Python<'py>, first_known: bool) -> PyResult<Bound<'py, PyAny>> {
        match self.call.relayed(first_known) {
            Relayed::Pending => Ok(py.None().into_bound(py)),
            Relayed::First(t) => Ok(t.into_pyobject(py)?.into_any()),
            Relayed::Over(r) => Ok(Bound::new(py, answer(py, *r))?.into_any()),
        }
    }

    /// Done with the answer: True when the rest is being drained (the call is made ready once
    /// that is over).
    fn finish(&self) -> bool {
        self.call.finish()
    }

    /// Gives the answer up: its connection is closed.
    fn abort(&self) {
        self.call.abort();
    }

    fn is_over(&self) -> bool {
        self.call.is_over()
    }
}

/// A worker's streamed answer read as it arrives ([`crate::sse`]): each call gives the events of
/// the lines completed so far, as tuples: ``(0, text, token_ids, finish_reason, usage JSON bytes
/// or None)`` a choice, ``(1, usage JSON bytes)``, ``(2,)`` the end (``[DONE]``), ``(3, error
/// JSON bytes)`` the worker's error, ``(4, why)`` data that is not what a worker sends.
#[pyclass(module = "switchyard_native", name = "SseReader")]
struct PySse {
    inner: Reader,
}

#[pymethods]
impl PySse {
    #[new]
    fn new() -> Self {
        PySse { inner: Reader::default() }
    }

    /// The events of the lines ``piece`` completes.
    fn feed<'py>(&mut self, py: Python<'py>, piece: &[u8]) -> PyResult<Bound<'py, PyList>> {
        let mut out = Vec::new();
        self.inner.feed(piece, &mut out);
        events(py, out)
    }

    /// The events of a last line without LF, once the body ended.
    fn end<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let mut out = Vec::new();
        self.inner.end(&mut out);
        events(py, out)
    }
}

/// A worker's answer read to its end by the crate ([`crate::sse::Relay`]). ``end``: 0 ``[DONE]``,
/// 1 the worker's error (``detail``: its JSON), 2 data a worker does not send (``detail``: why),
/// 3 the body ended without ``[DONE]``, 4 the transport failed (``code``, ``detail``).
#[pyclass(module = "switchyard_native", name = "RelayedAnswer", frozen, get_all)]
struct PyRelayed {
    text: String,
    chunks: u64,
    token_chunks: u64,
    tokens: u64,
    tokens_at_usage: u64,
    first_at: Option<f64>,
    itls_ms: Vec<f64>,
    finish_reason: Option<String>,
    usage: Option<Py<PyBytes>>,
    end: u8,
    code: String,
    detail: Option<Py<PyAny>>,
    end_at: f64,
}

fn answer(py: Python<'_>, r: Relay) -> PyRelayed {
    {
        let (end, code, detail): (u8, String, Option<Py<PyAny>>) = match r.end {
            Some(RelayEnd::Done) => (0, String::new(), None),
            Some(RelayEnd::Error(e)) => (1, String::new(), Some(PyBytes::new(py, &e).into_any().unbind())),
            Some(RelayEnd::Bad(why)) => (2, String::new(), Some(why.into_pyobject(py).unwrap().into_any().unbind())),
            Some(RelayEnd::Cut) | None => (3, String::new(), None),
            Some(RelayEnd::Failed(c, d)) => (4, c, Some(d.into_pyobject(py).unwrap().into_any().unbind())),
        };
        PyRelayed { text: r.text, chunks: r.chunks, token_chunks: r.token_chunks, tokens: r.tokens,
                    tokens_at_usage: r.tokens_at_usage, first_at: r.first_at, itls_ms: r.itls_ms,
                    finish_reason: r.finish_reason, usage: r.usage.map(|u| PyBytes::new(py, &u).unbind()), end, code,
                    detail, end_at: r.end_at }
    }
}

/// The same fold fed from Python (the in-memory worker calls): ``feed(piece)`` True when the
/// first token came in it; ``body_end()``; ``fail(code, detail)``; ``over``; ``first_at``;
/// ``take()`` the whole answer once over.
#[pyclass(module = "switchyard_native", name = "SseRelay")]
struct PyRelay {
    inner: Option<Relay>,
}

#[pymethods]
impl PyRelay {
    #[new]
    fn new() -> Self {
        PyRelay { inner: Some(Relay::default()) }
    }

    fn feed(&mut self, piece: &[u8]) -> bool {
        self.inner.as_mut().is_some_and(|r| r.feed(piece, mono_now()))
    }

    fn body_end(&mut self) -> bool {
        self.inner.as_mut().is_some_and(|r| r.body_end(mono_now()))
    }

    fn fail(&mut self, code: &str, detail: &str) {
        if let Some(r) = self.inner.as_mut() {
            r.fail(code, detail, mono_now());
        }
    }

    #[getter]
    fn over(&self) -> bool {
        self.inner.as_ref().is_none_or(|r| r.end.is_some())
    }

    #[getter]
    fn first_at(&self) -> Option<f64> {
        self.inner.as_ref().and_then(|r| r.first_at)
    }

    fn take(&mut self, py: Python<'_>) -> PyResult<PyRelayed> {
        match self.inner.take() {
            Some(r) if r.end.is_some() => Ok(answer(py, r)),
            other => {
                self.inner = other;
                Err(PyValueError::new_err("the answer is not over (or was taken)"))
            }
        }
    }
}

fn events<'py>(py: Python<'py>, evs: Vec<Event>) -> PyResult<Bound<'py, PyList>> {
    let list = PyList::empty(py);
    for ev in evs {
        let item = match ev {
            Event::Chunk { text, token_ids, finish_reason, usage } => {
                (0u8, text, token_ids, finish_reason, usage.map(|u| PyBytes::new(py, &u))).into_pyobject(py)?.into_any()
            }
            Event::Usage(u) => (1u8, PyBytes::new(py, &u)).into_pyobject(py)?.into_any(),
            Event::Done => (2u8,).into_pyobject(py)?.into_any(),
            Event::Error(e) => (3u8, PyBytes::new(py, &e)).into_pyobject(py)?.into_any(),
            Event::Bad(why) => (4u8, why).into_pyobject(py)?.into_any(),
        };
        list.append(item)?;
    }
    Ok(list)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyClient>()?;
    m.add_class::<PyCall>()?;
    m.add_class::<PySse>()?;
    m.add_class::<PyRelay>()?;
    m.add_class::<PyRelayed>()?;
    Ok(())
}
