//! PyO3 bindings of [`crate::front`]: the server `common/native_http.py` runs the router's ASGI
//! app behind. Nothing here blocks: Python waits on its event loop, woken through `fileno()`,
//! and takes the requests that are ready.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use pyo3::exceptions::{PyOSError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};

use crate::front::{BodyTake, Exchange, Limits, Server};

#[pyclass(module = "switchyard_native", name = "FrontServer")]
struct PyServer {
    inner: Server,
}

#[pymethods]
impl PyServer {
    /// Listens on ``host:port`` (0: a free port) and serves at once on ``threads`` threads of
    /// its own, with ``ConnectionLimits``' values.
    #[new]
    #[allow(clippy::too_many_arguments)]
    fn new(host: &str, port: u16, max_connections: usize, max_open: usize, max_per_ip: usize, request_timeout_s: f64,
           keep_alive_s: f64, threads: usize) -> PyResult<Self> {
        let limits = Limits { max_connections, max_open, max_per_ip, request_timeout: Duration::from_secs_f64(request_timeout_s),
                              keep_alive: Duration::from_secs_f64(keep_alive_s) };
        let inner = Server::bind(host, port, limits, threads).map_err(|e| PyOSError::new_err(format!("cannot serve on {host}:{port}: {e}")))?;
        Ok(PyServer { inner })
    }

    #[getter]
    fn port(&self) -> u16 {
        self.inner.local.port()
    }

    /// The descriptor that becomes readable when requests are ready.
    fn fileno(&self) -> i32 {
        self.inner.wake_fd()
    }

    /// ``(new requests, ids of requests that changed)`` since the last call.
    fn take_ready(&self) -> (Vec<PyRequest>, Vec<u64>) {
        let (new, changed) = self.inner.take_ready();
        (new.into_iter().map(|ex| PyRequest { ex }).collect(), changed)
    }

    /// Connections open and serving, and how many were evicted, refused, closed at their deadline.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.stats();
        let d = PyDict::new(py);
        d.set_item("open", s.open)?;
        d.set_item("busy", s.busy)?;
        d.set_item("evicted", s.evicted)?;
        d.set_item("refused", s.refused)?;
        d.set_item("closed_stalled", s.closed_stalled)?;
        Ok(d)
    }

    /// Stops listening and closes every connection.
    fn close(&mut self) {
        self.inner.shutdown();
    }
}

#[pyclass(module = "switchyard_native", name = "FrontRequest")]
struct PyRequest {
    ex: Arc<Exchange>,
}

#[pymethods]
impl PyRequest {
    #[getter]
    fn id(&self) -> u64 {
        self.ex.id
    }

    #[getter]
    fn method(&self) -> &str {
        self.ex.method.as_str()
    }

    /// The path as sent (not percent-decoded).
    #[getter]
    fn path(&self) -> &str {
        self.ex.path.as_str()
    }

    /// The first value of header ``name`` (lowercase), latin-1 decoded as Starlette does; None
    /// when absent. What a route served without the ASGI scope reads its headers with.
    fn header(&self, name: &str) -> Option<String> {
        let name = name.as_bytes();
        self.ex.headers.iter().find(|(k, _)| k.as_ref() == name).map(|(_, v)| v.iter().map(|&b| b as char).collect())
    }

    /// ``(method, path, query string bytes, http version, [(name, value) bytes], (client host,
    /// port), (server host, port))``: what the ASGI scope is made of, in one call.
    fn head<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let ex = &self.ex;
        let headers = PyList::empty(py);
        for (k, v) in &ex.headers {
            headers.append(PyTuple::new(py, [PyBytes::new(py, k), PyBytes::new(py, v)])?)?;
        }
        let client = (ex.client.ip().to_string(), ex.client.port()).into_pyobject(py)?;
        let server = (ex.server.ip().to_string(), ex.server.port()).into_pyobject(py)?;
        PyTuple::new(py, [
            ex.method.as_str().into_pyobject(py)?.into_any(),
            ex.path.as_str().into_pyobject(py)?.into_any(),
            PyBytes::new(py, &ex.query).into_any(),
            ex.http_version.into_pyobject(py)?.into_any(),
            headers.into_any(),
            client.into_any(),
            server.into_any(),
        ])
    }

    /// The body that arrived since the last call, as ``(bytes, end)``; None while pending (the
    /// request is then made ready when more comes); False: the client is gone.
    fn take_body<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        match self.ex.take_body() {
            BodyTake::Pending => Ok(py.None().into_bound(py)),
            BodyTake::Gone => Ok(false.into_pyobject(py)?.to_owned().into_any()),
            BodyTake::Data(chunks, end) => {
                let data = if chunks.len() == 1 {
                    PyBytes::new(py, &chunks[0])
                } else {
                    let len = chunks.iter().map(|c| c.len()).sum();
                    PyBytes::new_with(py, len, |buf| {
                        let mut at = 0;
                        for c in &chunks {
                            buf[at..at + c.len()].copy_from_slice(c);
                            at += c.len();
                        }
                        Ok(())
                    })?
                };
                Ok(PyTuple::new(py, [data.into_any(), end.into_pyobject(py)?.to_owned().into_any()])?.into_any())
            }
        }
    }

    /// Whether the answer is over (sent, or the client gone); if not, the request is made ready
    /// when it is.
    fn over(&self) -> bool {
        self.ex.over()
    }

    /// The answer's status, headers (``[(bytes, bytes)]``) and first body piece (``end``: the
    /// whole body); False when the client is gone.
    fn start(&self, status: u16, headers: &Bound<'_, PyAny>, first: &[u8], end: bool) -> PyResult<bool> {
        let mut hs = Vec::new();
        for item in headers.try_iter()? {
            let item = item?;
            let pair = item.cast::<PyTuple>().map_err(|_| PyTypeError::new_err("a header is a (name, value) tuple"))?;
            let k = pair.get_item(0)?;
            let v = pair.get_item(1)?;
            let k = k.cast::<PyBytes>().map_err(|_| PyTypeError::new_err("a header name is bytes"))?;
            let v = v.cast::<PyBytes>().map_err(|_| PyTypeError::new_err("a header value is bytes"))?;
            hs.push((Bytes::copy_from_slice(k.as_bytes()), Bytes::copy_from_slice(v.as_bytes())));
        }
        Ok(self.ex.start(status, hs, Bytes::copy_from_slice(first), end))
    }

    /// A piece of the answer's body (``end``: the last): 0 sent, 1 sent and the caller should
    /// wait for room (``has_room``), -1 the client is gone.
    fn send(&self, data: &[u8], end: bool) -> i32 {
        match self.ex.send(Bytes::copy_from_slice(data), end) {
            Ok(false) => 0,
            Ok(true) => 1,
            Err(()) => -1,
        }
    }

    /// Whether there is room for more answer (if not, the request is made ready when there is).
    fn has_room(&self) -> bool {
        self.ex.has_room()
    }

    /// Gives the answer up: the connection is closed.
    fn abort(&self) {
        self.ex.abort();
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyServer>()?;
    m.add_class::<PyRequest>()?;
    Ok(())
}
