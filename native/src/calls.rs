//! The router's HTTP/1.1 calls to workers: hyper on a tokio runtime of its own thread, never
//! holding Python's GIL (`control_plane/router/worker_calls.py` is the Python side, through
//! `py_calls.rs`).
//!
//! * A pool of keep-alive connections per (host, port), TCP_NODELAY, taken newest first; an idle
//!   one is kept for `keep_alive` (less than the workers' own), and one that was reused but broke
//!   before its answer's head (the worker closed it as it was taken) is replaced once by a new one.
//! * Timeouts: `connect` for the TCP connect; `read` for the answer's head and between body
//!   frames; `connect + read` to get a connection at all when `max_connections` are in use.
//! * Every failure is a [`Failure`] with the router's code: `connect_timeout`,
//!   `worker_unreachable` (never reached the worker), `timeout` (no byte for `read`),
//!   `worker_lost` (reset, closed early, not HTTP).
//! * Each call's body is read by its own task into a bounded buffer; the caller takes what has
//!   arrived, all of it at once. A caller that waits says so (`Head::Pending`, `Take::Pending`),
//!   and the call's id is put on the ready list when something changes: one byte written to a
//!   socket pair (only when the list was empty) wakes the event loop for a whole batch of calls.
//! * A call may be relayed ([`Client::post`]'s `relay`): a 2xx answer is then read to its end
//!   here, folded by [`crate::sse::Relay`] as it arrives (nothing buffered for the caller), and
//!   the caller is woken twice: at the first token and at the end (`[DONE]`, the worker's error,
//!   bad data, a cut or failed body); after `[DONE]` the rest is drained as below.
//! * An answer the caller is done with before its end is drained (for at most `drain`), so its
//!   connection returns to the pool; one the caller gives up on is dropped, which closes it (the
//!   worker sees it and stops generating).

use std::collections::HashMap;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::future::Future;
use std::task::Poll;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper::header::{HeaderName, HeaderValue, CONTENT_TYPE, HOST};
use hyper::{Method, Uri};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio::task::AbortHandle;
use tokio::time::{timeout, timeout_at};

use crate::sse::{mono_now, Relay, RelayEnd};
use crate::wake::Wake;

/// Bytes a call buffers before its reader waits for the caller to take them.
const BUFFER: usize = 256 * 1024;

#[derive(Clone, Debug)]
pub struct Config {
    pub connect_timeout: Duration,
    pub read_timeout: Duration,
    pub keep_alive: Duration,
    pub drain: Duration,
    pub max_connections: usize,
}

/// A call that failed at the transport: the router's code and what happened.
#[derive(Clone, Debug, PartialEq)]
pub struct Failure {
    pub code: &'static str,
    pub detail: String,
}

fn failure(code: &'static str, detail: String) -> Failure {
    Failure { code, detail }
}

/// One connection: its request sender and the task driving it (aborted when it is dropped,
/// which closes the socket).
struct Conn {
    sender: SendRequest<Full<Bytes>>,
    task: AbortHandle,
    reused: bool,
    idle_since: Instant,
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.task.abort();
    }
}

type Key = (String, u16);

struct Inner {
    cfg: Config,
    idle: Mutex<HashMap<Key, Vec<Conn>>>,
    permits: Arc<Semaphore>,
    wake: Wake<Vec<u64>>,
    /// Calls begun and not over (their task not yet ended or dropped).
    calls: AtomicUsize,
}

/// Counts one call while its task lives: dropped when the task ends, is aborted, or is dropped
/// with the runtime.
struct Counted(Arc<Inner>);

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.calls.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The calls' queue at one instant (`Client::load`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Load {
    /// Calls begun and not over: waiting for a connection or an answer, read or drained.
    pub calls: usize,
    /// Calls on the ready list: news the caller has not taken yet.
    pub ready: usize,
    /// Connections carrying a call (a permit held).
    pub busy: usize,
    /// Connections in the pool for the next call (one the worker closed is found out when taken).
    pub idle: usize,
}

impl Inner {
    fn checkout(&self, key: &Key) -> Option<Conn> {
        let mut idle = self.idle.lock().unwrap();
        let conns = idle.get_mut(key)?;
        while let Some(mut c) = conns.pop() {
            if c.idle_since.elapsed() < self.cfg.keep_alive && c.sender.is_ready() {
                c.reused = true;
                return Some(c);
            }
        }
        None
    }

    fn checkin(&self, key: Key, mut conn: Conn) {
        if conn.sender.is_closed() {
            return;
        }
        conn.idle_since = Instant::now();
        let keep = self.cfg.keep_alive;
        let mut idle = self.idle.lock().unwrap();
        let conns = idle.entry(key).or_default();
        conns.retain(|c| c.idle_since.elapsed() < keep && !c.sender.is_closed());
        conns.push(conn);
    }

    async fn connect(&self, key: &Key) -> Result<Conn, Failure> {
        let (host, port) = (key.0.as_str(), key.1);
        let stream = match timeout(self.cfg.connect_timeout, TcpStream::connect((host, port))).await {
            Err(_) => {
                return Err(failure(
                    "connect_timeout",
                    format!("connecting to {host}:{port} took over {:?}", self.cfg.connect_timeout),
                ))
            }
            Ok(Err(e)) => return Err(failure("worker_unreachable", format!("cannot connect to {host}:{port}: {e}"))),
            Ok(Ok(s)) => s,
        };
        let _ = stream.set_nodelay(true);
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| failure("worker_unreachable", format!("handshake with {host}:{port}: {e}")))?;
        let task = tokio::spawn(async move {
            let _ = conn.await;
        })
        .abort_handle();
        Ok(Conn { sender, task, reused: false, idle_since: Instant::now() })
    }

    /// The answer's head, and the connection it came on.
    async fn send(&self, req: &Prepared) -> Result<(hyper::Response<Incoming>, Conn), Failure> {
        for attempt in 0..2 {
            let mut conn = match self.checkout(&req.key) {
                Some(c) => c,
                None => self.connect(&req.key).await?,
            };
            let mut r = hyper::Request::new(Full::new(req.body.clone()));
            *r.method_mut() = Method::POST;
            *r.uri_mut() = req.path.clone();
            let h = r.headers_mut();
            h.insert(HOST, req.host.clone());
            h.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
            for (k, v) in &req.headers {
                h.insert(k.clone(), v.clone());
            }
            match timeout(self.cfg.read_timeout, conn.sender.send_request(r)).await {
                Err(_) => {
                    return Err(failure(
                        "timeout",
                        format!("no answer from {}:{} within {:?}", req.key.0, req.key.1, self.cfg.read_timeout),
                    ))
                }
                Ok(Ok(resp)) => return Ok((resp, conn)),
                // A pooled connection the worker closed as it was taken: the request never
                // reached it; once more, on a new connection.
                Ok(Err(_)) if conn.reused && attempt == 0 => continue,
                Ok(Err(e)) => return Err(lost(&e)),
            }
        }
        unreachable!("the second attempt returns")
    }
}

fn lost(e: &hyper::Error) -> Failure {
    let mut detail = format!("connection lost: {e}");
    let mut src = std::error::Error::source(e);
    while let Some(s) = src {
        detail.push_str(&format!(": {s}"));
        src = s.source();
    }
    failure("worker_lost", detail)
}

/// A request checked and ready to send (any number of times).
struct Prepared {
    key: Key,
    host: HeaderValue,
    path: Uri,
    body: Bytes,
    headers: Vec<(HeaderName, HeaderValue)>,
    /// An https worker: this client has no TLS, so the worker cannot be reached (the worker's
    /// failure, retried elsewhere, not the request's).
    tls: bool,
}

fn prepare(url: &str, body: Bytes, headers: &[(String, String)]) -> Result<Prepared, String> {
    let uri: Uri = url.parse().map_err(|e| format!("InvalidURL: {url:?}: {e}"))?;
    let tls = match uri.scheme_str() {
        Some("http") => false,
        Some("https") => true,
        _ => return Err(format!("not an http(s) URL: {url:?}")),
    };
    let auth = uri.authority().ok_or_else(|| format!("no host in {url:?}"))?;
    let host = auth.host().trim_start_matches('[').trim_end_matches(']').to_string();
    let port = auth.port_u16().unwrap_or(if tls { 443 } else { 80 });
    let path: Uri = uri.path_and_query().map(|p| p.as_str()).unwrap_or("/").parse().map_err(|e| format!("InvalidURL: {url:?}: {e}"))?;
    let mut hs = Vec::with_capacity(headers.len());
    for (k, v) in headers {
        let name = HeaderName::from_bytes(k.as_bytes()).map_err(|_| format!("illegal header name {k:?}"))?;
        let value = HeaderValue::from_str(v).map_err(|_| format!("illegal header value {k}={v:?}"))?;
        hs.push((name, value));
    }
    let host_value = HeaderValue::from_str(auth.as_str()).map_err(|_| format!("illegal host in {url:?}"))?;
    Ok(Prepared { key: (host, port), host: host_value, path, body, headers: hs, tls })
}

#[derive(Clone, Copy, PartialEq, Debug)]
enum Mode {
    Read,
    Drain,
}

#[derive(Default)]
struct State {
    status: Option<u16>,
    chunks: Vec<Bytes>,
    buffered: usize,
    /// The body's end: `Ok` read to the end, `Err` failed (the head too, when `status` is None).
    end: Option<Result<(), Failure>>,
    /// The caller waits for a change.
    waiting: bool,
    draining: bool,
    /// The answer read to its end here (relayed calls with a 2xx head), until the caller takes it.
    relay: Option<Relay>,
    relay_wanted: bool,
}

struct Shared {
    id: u64,
    state: Mutex<State>,
    /// The caller took what was buffered (or stopped reading): the reader may go on.
    room: Notify,
}

impl Shared {
    fn update(&self, inner: &Inner, f: impl FnOnce(&mut State)) {
        let wake = {
            let mut st = self.state.lock().unwrap();
            f(&mut st);
            std::mem::take(&mut st.waiting)
        };
        if wake {
            inner.wake.push(|r| r.push(self.id));
        }
    }

    /// A relayed piece: folded (unless draining); the caller is woken only at the first token and
    /// at the end. The answer's end, when it came now.
    fn relay(&self, inner: &Inner, data: &[u8]) -> Option<RelayEnd> {
        let (wake, end) = {
            let mut st = self.state.lock().unwrap();
            if st.draining {
                return None;
            }
            let Some(r) = st.relay.as_mut() else { return None };
            let first = r.feed(data, mono_now());
            let end = r.end.clone();
            if matches!(end, Some(RelayEnd::Done)) {
                st.draining = true; // the rest is not the caller's: read to the end, then pooled
            }
            let news = first || end.is_some();
            (news && std::mem::take(&mut st.waiting), end)
        };
        if wake {
            inner.wake.push(|r| r.push(self.id));
        }
        end
    }

    fn mode(&self) -> Mode {
        if self.state.lock().unwrap().draining {
            Mode::Drain
        } else {
            Mode::Read
        }
    }
}

/// The answer's head, as the caller sees it now.
#[derive(Debug, PartialEq)]
pub enum Head {
    Pending,
    Status(u16),
    Failed(Failure),
}

/// A relayed answer, as the caller sees it now.
#[derive(Debug)]
pub enum Relayed {
    Pending,
    /// Its first token came, at this time ([`mono_now`]); the end has not.
    First(f64),
    /// The whole answer (taken: given once).
    Over(Box<Relay>),
}

/// The answer's body, as the caller sees it now.
#[derive(Debug, PartialEq)]
pub enum Take {
    Pending,
    /// Everything that arrived since the last take, in order (never empty).
    Data(Vec<Bytes>),
    End,
    Failed(Failure),
}

pub struct Client {
    rt: Option<tokio::runtime::Runtime>,
    inner: Arc<Inner>,
    next_id: u64,
}

impl Client {
    pub fn new(cfg: Config) -> std::io::Result<Client> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("switchyard-worker-calls")
            .enable_io()
            .enable_time()
            .build()?;
        let permits = Arc::new(Semaphore::new(cfg.max_connections.max(1)));
        let wake = Wake::new()?;
        Ok(Client { rt: Some(rt), inner: Arc::new(Inner { cfg, idle: Mutex::new(HashMap::new()), permits, wake, calls: AtomicUsize::new(0) }), next_id: 0 })
    }

    /// The descriptor that becomes readable when calls are ready (see [`Client::take_ready`]).
    pub fn wake_fd(&self) -> RawFd {
        self.inner.wake.fd()
    }

    /// The ids of the calls that changed since the caller last waited on them.
    pub fn take_ready(&self) -> Vec<u64> {
        self.inner.wake.take()
    }

    /// POST `body` to `url`; the call runs at once. `relay`: a 2xx answer is read to its end
    /// here ([`Call::relayed`]). Err: the request cannot be put on the wire.
    pub fn post(&mut self, url: &str, body: Bytes, headers: &[(String, String)], relay: bool) -> Result<Call, String> {
        let req = prepare(url, body, headers)?;
        let rt = self.rt.as_ref().ok_or("the client is closed")?;
        self.next_id += 1;
        let state = State { relay_wanted: relay, ..State::default() };
        let shared = Arc::new(Shared { id: self.next_id, state: Mutex::new(state), room: Notify::new() });
        self.inner.calls.fetch_add(1, Ordering::Relaxed);
        let counted = Counted(self.inner.clone());
        let call = run(self.inner.clone(), shared.clone(), req);
        let task = rt
            .spawn(async move {
                let _counted = counted;
                call.await
            })
            .abort_handle();
        Ok(Call { shared, task })
    }

    /// The calls' queue now.
    pub fn load(&self) -> Load {
        let inner = &self.inner;
        Load {
            calls: inner.calls.load(Ordering::Relaxed),
            ready: inner.wake.peek(Vec::len),
            busy: inner.cfg.max_connections.max(1) - inner.permits.available_permits(),
            idle: inner.idle.lock().unwrap().values().map(Vec::len).sum(),
        }
    }

    /// Ends every call and closes every connection.
    pub fn shutdown(&mut self) {
        self.inner.idle.lock().unwrap().clear();
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// One call: the caller's handle. Dropping it gives the call up (as [`Call::abort`]) unless
/// [`Call::finish`] was called.
pub struct Call {
    shared: Arc<Shared>,
    task: AbortHandle,
}

impl Call {
    pub fn id(&self) -> u64 {
        self.shared.id
    }

    pub fn head(&self) -> Head {
        let mut st = self.shared.state.lock().unwrap();
        if let Some(s) = st.status {
            return Head::Status(s);
        }
        match &st.end {
            Some(Err(f)) => Head::Failed(f.clone()),
            Some(Ok(())) => unreachable!("a body ends after its head"),
            None => {
                st.waiting = true;
                Head::Pending
            }
        }
    }

    pub fn take(&self) -> Take {
        let mut st = self.shared.state.lock().unwrap();
        if !st.chunks.is_empty() {
            let full = st.buffered >= BUFFER;
            st.buffered = 0;
            let data = std::mem::take(&mut st.chunks);
            drop(st);
            if full {
                self.shared.room.notify_one();
            }
            return Take::Data(data);
        }
        match &st.end {
            Some(Ok(())) => Take::End,
            Some(Err(f)) => Take::Failed(f.clone()),
            None => {
                st.waiting = true;
                Take::Pending
            }
        }
    }

    /// A relayed call's answer (its head 2xx): `first_known`: the caller has seen its first
    /// token already (only the end is news then). Pending: the call is made ready when there is news.
    pub fn relayed(&self, first_known: bool) -> Relayed {
        let mut st = self.shared.state.lock().unwrap();
        if let Some(r) = &st.relay {
            if r.end.is_some() {
                return Relayed::Over(Box::new(st.relay.take().unwrap()));
            }
            if let (false, Some(t)) = (first_known, r.first_at) {
                return Relayed::First(t);
            }
        }
        st.waiting = true;
        Relayed::Pending
    }

    /// The caller is done with the answer. If it has not ended, the rest is drained (the
    /// connection pooled after); true then, and the call's id is made ready when that is over.
    pub fn finish(&self) -> bool {
        let mut st = self.shared.state.lock().unwrap();
        st.chunks.clear();
        st.buffered = 0;
        if st.end.is_some() {
            return false;
        }
        st.draining = true;
        st.waiting = true;
        drop(st);
        self.shared.room.notify_one();
        true
    }

    /// The caller gives the answer up: its connection is closed.
    pub fn abort(&self) {
        self.task.abort();
    }

    /// Whether the call is over (answer read, drained, failed or aborted).
    pub fn is_over(&self) -> bool {
        self.task.is_finished()
    }
}

impl Drop for Call {
    fn drop(&mut self) {
        if !self.shared.state.lock().unwrap().draining {
            self.task.abort();
        }
    }
}

async fn run(inner: Arc<Inner>, shared: Arc<Shared>, req: Prepared) {
    let cfg = &inner.cfg;
    if req.tls {
        let f = failure("worker_unreachable", format!("{}:{} is an https worker; the worker client speaks plain HTTP/1.1", req.key.0, req.key.1));
        shared.update(&inner, |st| st.end = Some(Err(f)));
        return;
    }
    let _permit: OwnedSemaphorePermit = match timeout(cfg.connect_timeout + cfg.read_timeout, inner.permits.clone().acquire_owned()).await {
        Ok(Ok(p)) => p,
        _ => {
            let f = failure("connect_timeout", format!("no connection free among {} within {:?}", cfg.max_connections, cfg.connect_timeout + cfg.read_timeout));
            shared.update(&inner, |st| st.end = Some(Err(f)));
            return;
        }
    };
    let (resp, conn) = match inner.send(&req).await {
        Ok(x) => x,
        Err(f) => {
            shared.update(&inner, |st| st.end = Some(Err(f)));
            return;
        }
    };
    let status = resp.status().as_u16();
    let mut relaying = false;
    shared.update(&inner, |st| {
        st.status = Some(status);
        if st.relay_wanted && (200..300).contains(&status) {
            st.relay = Some(Relay::default());
            relaying = true;
        }
    });
    let mut body = resp.into_body();
    let mut drain_until: Option<Instant> = None;
    // The read timeout counts from the last frame (time spent waiting for room is not the
    // worker's).
    let mut last = Instant::now();
    loop {
        // Wait for room (the caller takes what is buffered), unless draining.
        loop {
            let room = shared.room.notified();
            tokio::pin!(room);
            room.as_mut().enable();
            let go = {
                let st = shared.state.lock().unwrap();
                st.draining || st.buffered < BUFFER
            };
            if go {
                break;
            }
            room.await;
            last = Instant::now();
        }
        // Registered before the mode is read: a `finish` from now on wakes the wait below, so
        // a drain is bounded by `drain` from the moment the caller stopped reading.
        let room = shared.room.notified();
        tokio::pin!(room);
        room.as_mut().enable();
        let mode = shared.mode();
        let deadline = match mode {
            Mode::Read => last + cfg.read_timeout,
            Mode::Drain => *drain_until.get_or_insert_with(|| Instant::now() + cfg.drain),
        };
        let frame = body.frame();
        tokio::pin!(frame);
        let next = std::future::poll_fn(|cx| {
            if let Poll::Ready(f) = frame.as_mut().poll(cx) {
                return Poll::Ready(Some(f));
            }
            if mode == Mode::Read && room.as_mut().poll(cx).is_ready() {
                return Poll::Ready(None); // the caller finished: drain from now on
            }
            Poll::Pending
        });
        let got = timeout_at(deadline.into(), next).await;
        match got {
            Ok(None) => continue,
            Err(_) => {
                let f = match mode {
                    Mode::Read => failure("timeout", format!("no data from the worker for {:?}", cfg.read_timeout)),
                    Mode::Drain => failure("timeout", format!("the answer did not end within {:?} of the router's last read", cfg.drain)),
                };
                drop(conn); // closed: the worker stops
                shared.update(&inner, |st| {
                    if let Some(r) = st.relay.as_mut() {
                        r.fail(f.code, &f.detail, mono_now());
                    }
                    st.end = Some(Err(f));
                });
                return;
            }
            Ok(Some(None)) => {
                drop(body);
                // The connection is ready for another request once hyper has seen the end.
                let mut conn = conn;
                if relaying {
                    // The answer's end, before the connection's: the caller is woken now.
                    shared.update(&inner, |st| {
                        if let Some(r) = st.relay.as_mut() {
                            r.body_end(mono_now());
                        }
                    });
                }
                if timeout(Duration::from_millis(100), conn.sender.ready()).await.is_ok_and(|r| r.is_ok()) {
                    inner.checkin(req.key.clone(), conn);
                }
                shared.update(&inner, |st| st.end = Some(Ok(())));
                return;
            }
            Ok(Some(Some(Err(e)))) => {
                drop(conn);
                let f = lost(&e);
                shared.update(&inner, |st| {
                    if let Some(r) = st.relay.as_mut() {
                        r.fail(f.code, &f.detail, mono_now());
                    }
                    st.end = Some(Err(f));
                });
                return;
            }
            Ok(Some(Some(Ok(frame)))) => {
                last = Instant::now();
                if let Ok(data) = frame.into_data() {
                    if !data.is_empty() && relaying {
                        match shared.relay(&inner, &data) {
                            Some(RelayEnd::Done) => {} // drained from now on (the caller finishes the call)
                            Some(_) => {
                                // The worker's error or bad data: the connection is closed (the worker stops).
                                drop(conn);
                                shared.update(&inner, |st| st.end = Some(Ok(())));
                                return;
                            }
                            None => {}
                        }
                    } else if !data.is_empty() {
                        shared.update(&inner, |st| {
                            if !st.draining {
                                st.buffered += data.len();
                                st.chunks.push(data);
                            }
                        });
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufRead, BufReader, Read, Write};
    use std::net::{TcpListener, TcpStream as StdStream};
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn cfg(read_ms: u64) -> Config {
        Config {
            connect_timeout: Duration::from_secs(1),
            read_timeout: Duration::from_millis(read_ms),
            keep_alive: Duration::from_secs(4),
            drain: Duration::from_secs(5),
            max_connections: 64,
        }
    }

    /// Reads one request (head and content-length body); false at EOF.
    fn read_request(r: &mut BufReader<StdStream>) -> bool {
        let mut len = 0;
        let mut first = true;
        loop {
            let mut line = String::new();
            if r.read_line(&mut line).unwrap_or(0) == 0 {
                return false;
            }
            if first && line.trim().is_empty() {
                continue;
            }
            first = false;
            if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                len = v.trim().parse().unwrap();
            }
            if line == "\r\n" {
                break;
            }
        }
        let mut body = vec![0; len];
        r.read_exact(&mut body).is_ok()
    }

    /// A worker on a thread: `answer` writes each answer; returns its port and the number of
    /// connections it accepted.
    fn serve(answer: fn(&mut StdStream) -> bool) -> (u16, Arc<AtomicUsize>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let conns = Arc::new(AtomicUsize::new(0));
        let n = conns.clone();
        std::thread::spawn(move || {
            for s in l.incoming() {
                let mut s = s.unwrap();
                n.fetch_add(1, Ordering::SeqCst);
                std::thread::spawn(move || {
                    let mut r = BufReader::new(s.try_clone().unwrap());
                    while read_request(&mut r) {
                        if !answer(&mut s) {
                            break;
                        }
                    }
                });
            }
        });
        (port, conns)
    }

    /// Waits (on the wake descriptor, as the event loop does) until `f` answers.
    fn wait<T>(c: &Client, mut f: impl FnMut() -> Option<T>) -> T {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(x) = f() {
                return x;
            }
            assert!(Instant::now() < deadline, "no answer in time");
            // Blocks until a wake-up (or 50 ms: conditions nobody is woken for, `is_over`).
            let rx = c.inner.wake.reader();
            rx.set_nonblocking(false).unwrap();
            rx.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
            let _ = (&rx).read(&mut [0u8; 1]);
            rx.set_nonblocking(true).unwrap();
            c.take_ready();
        }
    }

    fn body(c: &Client, call: &Call) -> Result<Vec<u8>, Failure> {
        let mut out = Vec::new();
        loop {
            match wait(c, || match call.take() {
                Take::Pending => None,
                t => Some(t),
            }) {
                Take::Data(d) => d.iter().for_each(|b| out.extend_from_slice(b)),
                Take::End => return Ok(out),
                Take::Failed(f) => return Err(f),
                Take::Pending => unreachable!(),
            }
        }
    }

    fn head(c: &Client, call: &Call) -> Result<u16, Failure> {
        match wait(c, || match call.head() {
            Head::Pending => None,
            h => Some(h),
        }) {
            Head::Status(s) => Ok(s),
            Head::Failed(f) => Err(f),
            Head::Pending => unreachable!(),
        }
    }

    fn sse(s: &mut StdStream) -> bool {
        let body = b"data: {\"a\": 1}\n\ndata: [DONE]\n\n";
        write!(s, "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n", body.len()).unwrap();
        s.write_all(body).unwrap();
        s.write_all(b"\r\n").unwrap();
        std::thread::sleep(Duration::from_millis(20));
        s.write_all(b"0\r\n\r\n").is_ok()
    }

    #[test]
    fn answers_are_read_and_connections_reused_after_a_drain() {
        let (port, conns) = serve(sse);
        let mut c = Client::new(cfg(2000)).unwrap();
        let url = format!("http://127.0.0.1:{port}/v1/completions");
        let call = c.post(&url, Bytes::from_static(b"{}"), &[("x-request-id".into(), "r1".into())], false).unwrap();
        assert_eq!(head(&c, &call), Ok(200));
        assert_eq!(body(&c, &call).unwrap(), b"data: {\"a\": 1}\n\ndata: [DONE]\n\n");
        for i in 0..3 {
            // Read the head and the first data only; the rest is drained.
            let call = c.post(&url, Bytes::from_static(b"{}"), &[("x-request-id".into(), format!("r{i}"))], false).unwrap();
            assert_eq!(head(&c, &call), Ok(200));
            wait(&c, || matches!(call.take(), Take::Data(_)).then_some(()));
            // Drained (usually: the last chunk comes 20 ms later) or already ended: pooled.
            call.finish();
            wait(&c, || call.is_over().then_some(()));
        }
        assert_eq!(conns.load(Ordering::SeqCst), 1);
    }

    /// Answers `tokens` began, and those whose rest the test let go (once it saw the first token).
    static BEGUN: AtomicUsize = AtomicUsize::new(0);
    static RELEASED: AtomicUsize = AtomicUsize::new(0);

    fn tokens(s: &mut StdStream) -> bool {
        let n = BEGUN.fetch_add(1, Ordering::SeqCst) + 1;
        let first = b"data: {\"choices\":[{\"text\":\"a\"}]}\n\n";
        let rest = b"data: {\"choices\":[{\"text\":\"b\",\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n";
        write!(s, "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n", first.len()).unwrap();
        s.write_all(first).unwrap();
        s.write_all(b"\r\n").unwrap();
        while RELEASED.load(Ordering::SeqCst) < n {
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(Duration::from_millis(5)); // a gap the inter-token time shows
        write!(s, "{:x}\r\n", rest.len()).unwrap();
        s.write_all(rest).unwrap();
        s.write_all(b"\r\n").unwrap();
        std::thread::sleep(Duration::from_millis(20));
        s.write_all(b"0\r\n\r\n").is_ok()
    }

    #[test]
    fn a_relayed_answer_wakes_at_its_first_token_and_its_end_and_is_pooled() {
        let (port, conns) = serve(tokens);
        let mut c = Client::new(cfg(2000)).unwrap();
        let url = format!("http://127.0.0.1:{port}/v1/completions");
        for _ in 0..2 {
            let call = c.post(&url, Bytes::from_static(b"{}"), &[], true).unwrap();
            assert_eq!(head(&c, &call), Ok(200));
            let first = wait(&c, || match call.relayed(false) {
                Relayed::First(t) => Some(t),
                Relayed::Over(_) => panic!("the end came with the first token"),
                Relayed::Pending => None,
            });
            RELEASED.fetch_add(1, Ordering::SeqCst);
            let r = wait(&c, || match call.relayed(true) {
                Relayed::Over(r) => Some(r),
                _ => None,
            });
            assert_eq!((r.text.as_str(), r.first_at, r.finish_reason.as_deref()), ("ab", Some(first), Some("stop")));
            assert!(r.itls_ms[0] >= 5.0 && r.end == Some(RelayEnd::Done), "{r:?}");
            call.finish();
            wait(&c, || call.is_over().then_some(()));
        }
        assert_eq!(conns.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn each_failure_has_its_code() {
        let refused = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let (stall, _) = serve(|_| {
            std::thread::sleep(Duration::from_secs(3));
            false
        });
        let (reset, _) = serve(|_| false);
        let (garbage, _) = serve(|s| {
            s.write_all(b"NOT HTTP\r\n\r\n").unwrap();
            false
        });
        let mut c = Client::new(cfg(300)).unwrap();
        for (port, code) in [(refused, "worker_unreachable"), (stall, "timeout"), (reset, "worker_lost"), (garbage, "worker_lost")] {
            let call = c.post(&format!("http://127.0.0.1:{port}/x"), Bytes::new(), &[], false).unwrap();
            assert_eq!(head(&c, &call).unwrap_err().code, code, "port {port}");
        }
        assert!(c.post("http://127.0.0.1:1/x", Bytes::new(), &[("x-request-id".into(), "a\nb".into())], false).is_err());
        assert!(c.post("ftp://127.0.0.1:1/x", Bytes::new(), &[], false).is_err());
        let call = c.post("https://127.0.0.1:1/x", Bytes::new(), &[], false).unwrap();
        assert_eq!(head(&c, &call).unwrap_err().code, "worker_unreachable");
    }

    #[test]
    fn a_body_that_stops_is_a_timeout_and_a_given_up_call_closes_its_connection() {
        let (port, _) = serve(|s| {
            s.write_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n").unwrap();
            // Until the router hangs up.
            let mut buf = [0u8; 16];
            let _ = s.read(&mut buf);
            false
        });
        let mut c = Client::new(cfg(300)).unwrap();
        let url = format!("http://127.0.0.1:{port}/x");
        let call = c.post(&url, Bytes::new(), &[], false).unwrap();
        assert_eq!(head(&c, &call), Ok(200));
        assert_eq!(body(&c, &call).unwrap_err().code, "timeout");
        let call = c.post(&url, Bytes::new(), &[], false).unwrap();
        assert_eq!(head(&c, &call), Ok(200));
        call.abort();
        wait(&c, || call.is_over().then_some(()));
    }

    #[test]
    fn a_drain_ends_within_its_bound_even_when_the_read_timeout_is_longer() {
        let (port, _) = serve(|s| {
            s.write_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n").unwrap();
            std::thread::sleep(Duration::from_secs(5));
            false
        });
        let mut c = Client::new(Config { drain: Duration::from_millis(200), ..cfg(10_000) }).unwrap();
        let call = c.post(&format!("http://127.0.0.1:{port}/x"), Bytes::new(), &[], false).unwrap();
        assert_eq!(head(&c, &call), Ok(200));
        wait(&c, || matches!(call.take(), Take::Data(_)).then_some(()));
        let t = Instant::now();
        assert!(call.finish());
        assert!(matches!(wait(&c, || match call.take() {
            Take::Pending => None,
            t => Some(t),
        }), Take::Failed(Failure { code: "timeout", .. })));
        assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    }
}
