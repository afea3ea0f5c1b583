//! PyO3 bindings of [`crate::calls`]: the client `control_plane/router/worker_calls.py` wraps
//! into the router's `WorkerCalls`. Nothing here blocks: Python waits on its event loop, woken
//! through `fileno()`, and takes what is ready.

use bytes::Bytes;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};
use std::time::Duration;

use crate::calls::{Call, Client, Config, Failure, Head, Take};
use crate::sse::{Event, Reader};

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

    /// POST ``body`` to ``url`` with ``headers``; ValueError when it cannot be put on the wire.
    fn post(&mut self, url: &str, body: &[u8], headers: Vec<(String, String)>) -> PyResult<PyCall> {
        let call = self.inner.post(url, Bytes::copy_from_slice(body), &headers).map_err(PyValueError::new_err)?;
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
    Ok(())
}
