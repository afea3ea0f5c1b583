//! The router's HTTP/1.1 server: hyper on a tokio runtime of its own threads, never holding
//! Python's GIL (`common/native_http.py` is the Python side, through `py_front.rs`, and runs the
//! router's ASGI app on each request).
//!
//! * Connections are bounded as `common/http_server.py`'s `ConnectionLimits` say, with the same
//!   rules: `max_connections` requests served at once (past it: 503 and the connection closed);
//!   idle connections (headers not complete yet, or kept alive between requests) do not count;
//!   `max_open` connections open at once and `max_per_ip` from one address, where a new one
//!   closes the oldest idle one first and is refused (503) only when none is idle. Each request's
//!   headers must be complete within a deadline drawn in [1/2, 1] x `request_timeout` from the
//!   connection's start or the end of the previous response (slowloris), and an idle keep-alive
//!   connection is closed after `keep_alive`. TCP_NODELAY on every connection.
//! * A request whose headers are complete is handed over with its body when the body is read
//!   (or [`HANDOFF_BYTES`] of it, or after [`HANDOFF_WAIT`]: a slow body is the app's to bound);
//!   the rest of the body follows as it arrives. Handed-over requests, and ids of requests that
//!   changed (more body, room for more answer, client gone), go on one ready list; one byte
//!   written to a socket pair (only when the list was empty) wakes the event loop for the batch.
//! * The answer comes back as its head, then body pieces, each one call, no thread hop: a piece
//!   is queued and the connection's task woken; the caller is told to wait when
//!   [`BUFFER`] bytes are queued, and woken when the client took them.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, Incoming};
use hyper::header::{HeaderName, HeaderValue, CONNECTION, CONTENT_TYPE};
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::wake::Wake;

/// Answer bytes queued for a client before the caller is told to wait.
pub const BUFFER: usize = 256 * 1024;
/// Body bytes read before a request is handed over without the rest of its body.
pub const HANDOFF_BYTES: usize = 256 * 1024;
/// How long a request waits for its body before it is handed over without it.
pub const HANDOFF_WAIT: Duration = Duration::from_millis(20);

#[derive(Clone, Debug)]
pub struct Limits {
    pub max_connections: usize,
    pub max_open: usize,
    pub max_per_ip: usize,
    pub request_timeout: Duration,
    pub keep_alive: Duration,
}

/// A connection as the bookkeeping sees it: what closes it.
struct ConnHandle {
    close: Arc<Notify>,
    ip: String,
}

/// The open connections (`common/http_server.py`'s `Connections`, the same rules): how many
/// serve a request, and which are idle, oldest first (idle order: a sequence number taken when
/// the connection became idle).
#[derive(Default)]
struct Conns {
    open: HashMap<String, usize>,
    total: usize,
    busy: usize,
    seq: u64,
    /// Connection id -> (its idle sequence number, address).
    idle_of: HashMap<u64, (u64, String)>,
    idle: BTreeMap<u64, u64>,
    idle_by_ip: HashMap<String, BTreeMap<u64, u64>>,
    handles: HashMap<u64, ConnHandle>,
    evicted: u64,
    refused: u64,
}

impl Conns {
    fn make_idle(&mut self, id: u64, ip: &str) {
        self.seq += 1;
        self.idle_of.insert(id, (self.seq, ip.to_string()));
        self.idle.insert(self.seq, id);
        self.idle_by_ip.entry(ip.to_string()).or_default().insert(self.seq, id);
    }

    fn not_idle(&mut self, id: u64) -> bool {
        let Some((seq, ip)) = self.idle_of.remove(&id) else { return false };
        self.idle.remove(&seq);
        if let Some(m) = self.idle_by_ip.get_mut(&ip) {
            m.remove(&seq);
            if m.is_empty() {
                self.idle_by_ip.remove(&ip);
            }
        }
        true
    }

    /// Counts connection `id` (idle), closing the oldest idle connection of its address, then of
    /// the server, while either is over its cap. False: none was idle (refuse `id`).
    fn add(&mut self, id: u64, ip: &str, handle: ConnHandle, limits: &Limits) -> bool {
        self.total += 1;
        *self.open.entry(ip.to_string()).or_default() += 1;
        self.handles.insert(id, handle);
        self.make_idle(id, ip);
        let mut ok = true;
        while ok && self.open.get(ip).copied().unwrap_or(0) > limits.max_per_ip {
            let victim = self.idle_by_ip.get(ip).and_then(|m| m.values().find(|&&c| c != id).copied());
            ok = self.evict(victim);
        }
        while ok && self.total > limits.max_open {
            let victim = self.idle.values().find(|&&c| c != id).copied();
            ok = self.evict(victim);
        }
        if !ok {
            self.refused += 1;
        }
        ok
    }

    fn evict(&mut self, victim: Option<u64>) -> bool {
        let Some(v) = victim else { return false };
        self.evicted += 1;
        self.remove(v, true);
        true
    }

    /// Connection `id` serves a request now; false when `max_connections` already do.
    fn start_request(&mut self, id: u64, limits: &Limits) -> bool {
        self.not_idle(id);
        self.busy += 1;
        if self.busy > limits.max_connections {
            self.refused += 1;
            return false;
        }
        true
    }

    fn end_request(&mut self, id: u64, ip: &str) {
        if self.handles.contains_key(&id) {
            self.busy -= 1;
            self.make_idle(id, ip);
        }
    }

    /// Forgets connection `id`; `close`: and closes it now (a refused one is closed by its 503).
    fn remove(&mut self, id: u64, close: bool) {
        let Some(h) = self.handles.remove(&id) else { return };
        if close {
            h.close.notify_one();
        }
        if !self.not_idle(id) {
            self.busy -= 1; // it was serving a request
        }
        self.dec_open(&h.ip);
        self.total -= 1;
    }

    fn dec_open(&mut self, ip: &str) {
        if let Some(n) = self.open.get_mut(ip) {
            *n -= 1;
            if *n == 0 {
                self.open.remove(ip);
            }
        }
    }
}

/// A request's state, shared by the connection's task and the caller.
#[derive(Default)]
struct ExState {
    body: Vec<Bytes>,
    body_bytes: usize,
    body_end: bool,
    head: Option<(u16, Vec<(Bytes, Bytes)>)>,
    out: VecDeque<Bytes>,
    out_bytes: usize,
    out_end: bool,
    /// The answer is over: sent to its end, or the client went away (connection closed).
    over: bool,
    /// The caller waits for a change.
    waiting: bool,
    /// The connection's task waits for the answer (its head, more of its body).
    out_waker: Option<Waker>,
}

/// One request and its answer.
pub struct Exchange {
    pub id: u64,
    pub method: String,
    pub path: String,
    pub query: Bytes,
    pub http_version: &'static str,
    pub headers: Vec<(Bytes, Bytes)>,
    pub client: SocketAddr,
    pub server: SocketAddr,
    state: Mutex<ExState>,
    /// The caller took body bytes: the body's reader may go on.
    room: Notify,
    /// The answer's head came.
    head_ready: Notify,
    wake: Arc<Wake<Ready>>,
}

/// The request's body, as the caller sees it now.
#[derive(Debug, PartialEq)]
pub enum BodyTake {
    Pending,
    /// Everything that arrived since the last take, and whether that was the end.
    Data(Vec<Bytes>, bool),
    /// The connection is gone before the body ended.
    Gone,
}

impl Exchange {
    fn update(&self, f: impl FnOnce(&mut ExState)) {
        let wake = {
            let mut st = self.state.lock().unwrap();
            f(&mut st);
            std::mem::take(&mut st.waiting)
        };
        if wake {
            self.wake.push(|r| r.1.push(self.id));
        }
    }

    /// The body that arrived since the last take (the caller is woken when more comes).
    pub fn take_body(&self) -> BodyTake {
        let mut st = self.state.lock().unwrap();
        if !st.body.is_empty() || st.body_end {
            let full = st.body_bytes >= HANDOFF_BYTES;
            st.body_bytes = 0;
            let data = std::mem::take(&mut st.body);
            let end = st.body_end;
            drop(st);
            if full {
                self.room.notify_one();
            }
            return BodyTake::Data(data, end);
        }
        if st.over {
            return BodyTake::Gone;
        }
        st.waiting = true;
        BodyTake::Pending
    }

    /// Whether the answer is over (sent, or the client gone); if not, the caller is woken when it is.
    pub fn over(&self) -> bool {
        let mut st = self.state.lock().unwrap();
        if !st.over {
            st.waiting = true;
        }
        st.over
    }

    /// The answer's head with the first piece of its body (`end`: the whole body; the answer
    /// then says its length). False: the client is gone (or a head was already given).
    pub fn start(&self, status: u16, headers: Vec<(Bytes, Bytes)>, first: Bytes, end: bool) -> bool {
        let mut st = self.state.lock().unwrap();
        if st.over || st.head.is_some() {
            return false;
        }
        st.head = Some((status, headers));
        if !first.is_empty() {
            st.out_bytes += first.len();
            st.out.push_back(first);
        }
        st.out_end = end;
        if end {
            st.waiting = false; // the caller knows the answer is over: no wake-up for it
        }
        drop(st);
        self.head_ready.notify_one();
        true
    }

    /// A piece of the answer's body (`end`: the last). Err: the client is gone. Ok(true): the
    /// caller should wait before the next piece (it is woken when the client took some).
    pub fn send(&self, data: Bytes, end: bool) -> Result<bool, ()> {
        let mut st = self.state.lock().unwrap();
        if st.over || st.out_end {
            return Err(());
        }
        if !data.is_empty() {
            st.out_bytes += data.len();
            st.out.push_back(data);
        }
        st.out_end = end;
        let full = st.out_bytes >= BUFFER && !end;
        if full || end {
            st.waiting = full; // at the end the caller knows the answer is over: no wake-up for it
        }
        let w = st.out_waker.take();
        drop(st);
        if let Some(w) = w {
            w.wake();
        }
        Ok(full)
    }

    /// The caller gives the answer up before its end: the connection is closed.
    pub fn abort(&self) {
        let mut st = self.state.lock().unwrap();
        st.over = true;
        let w = st.out_waker.take();
        drop(st);
        self.head_ready.notify_one();
        if let Some(w) = w {
            w.wake();
        }
    }

    /// Whether the caller has room for more answer now (when it was told to wait).
    pub fn has_room(&self) -> bool {
        let mut st = self.state.lock().unwrap();
        let room = st.over || st.out_bytes < BUFFER;
        if !room {
            st.waiting = true;
        }
        room
    }
}

/// New requests, and ids of requests that changed.
type Ready = (Vec<Arc<Exchange>>, Vec<u64>);

struct Inner {
    limits: Limits,
    conns: Mutex<Conns>,
    wake: Arc<Wake<Ready>>,
    next_id: AtomicU64,
    closed_stalled: AtomicU64,
}

/// The answer's body: the pieces the caller sends, as the client takes them.
struct OutBody {
    ex: Arc<Exchange>,
    guard: Option<RequestGuard>,
}

impl Body for OutBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        let ex = self.ex.clone();
        let mut st = ex.state.lock().unwrap();
        if let Some(d) = st.out.pop_front() {
            let was_full = st.out_bytes >= BUFFER;
            st.out_bytes -= d.len();
            let wake = was_full && st.out_bytes < BUFFER && std::mem::take(&mut st.waiting);
            drop(st);
            if wake {
                ex.wake.push(|r| r.1.push(ex.id));
            }
            return Poll::Ready(Some(Ok(Frame::data(d))));
        }
        if st.out_end {
            drop(st);
            // Sent to its end: the request is over (`RequestGuard`), the connection idle again.
            self.guard.take();
            return Poll::Ready(None);
        }
        if st.over {
            // Given up mid-answer: an error closes the connection (the client sees it cut).
            return Poll::Ready(Some(Err(std::io::Error::other("the answer was given up"))));
        }
        st.out_waker = Some(cx.waker().clone());
        Poll::Pending
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        let st = self.ex.state.lock().unwrap();
        if st.out_end {
            hyper::body::SizeHint::with_exact(st.out_bytes as u64)
        } else {
            hyper::body::SizeHint::default()
        }
    }

    fn is_end_stream(&self) -> bool {
        let st = self.ex.state.lock().unwrap();
        st.out_end && st.out.is_empty()
    }
}

/// Ends a request when dropped (its answer sent, or given up): the connection is idle again and
/// its header deadline re-armed; the caller learns the answer is over.
struct RequestGuard {
    inner: Arc<Inner>,
    conn: Arc<ConnState>,
    ex: Option<Arc<Exchange>>,
}

impl Drop for RequestGuard {
    fn drop(&mut self) {
        self.inner.conns.lock().unwrap().end_request(self.conn.id, &self.conn.ip);
        self.conn.arm(&self.inner.limits, true);
        if let Some(ex) = &self.ex {
            ex.update(|st| st.over = true);
        }
    }
}

/// A connection's own state: its deadline, and what closes it.
struct ConnState {
    id: u64,
    ip: String,
    close: Arc<Notify>,
    deadline: Mutex<Option<Instant>>,
    rearm: Notify,
}

impl ConnState {
    /// The header deadline from now (after a response: no later than the keep-alive's end).
    fn arm(&self, limits: &Limits, after_response: bool) {
        let mut d = limits.request_timeout.mul_f64(0.5 + draw(self.id) / 2.0);
        if after_response {
            d = d.min(limits.keep_alive);
        }
        *self.deadline.lock().unwrap() = Some(Instant::now() + d);
        self.rearm.notify_one();
    }

    fn disarm(&self) {
        *self.deadline.lock().unwrap() = None;
    }
}

/// A number in [0, 1) (spreads the deadlines of connections opened together).
fn draw(salt: u64) -> f64 {
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
    let mut x = t ^ salt.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    (x >> 11) as f64 / (1u64 << 53) as f64
}

type Answer = Response<http_body_util::Either<OutBody, http_body_util::combinators::BoxBody<Bytes, std::io::Error>>>;

/// uvicorn's answer past its concurrency limit: 503, text, the connection closed.
fn unavailable() -> Answer {
    let body = http_body_util::Full::new(Bytes::from_static(b"Service Unavailable")).map_err(|e: Infallible| match e {}).boxed();
    let mut r = Response::new(http_body_util::Either::Right(body));
    *r.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
    r.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("text/plain; charset=utf-8"));
    r.headers_mut().insert(CONNECTION, HeaderValue::from_static("close"));
    r
}

fn version(v: hyper::Version) -> &'static str {
    match v {
        hyper::Version::HTTP_10 => "1.0",
        _ => "1.1",
    }
}

async fn handle(inner: Arc<Inner>, conn: Arc<ConnState>, refused: bool, server: SocketAddr, client: SocketAddr,
                req: Request<Incoming>) -> Result<Answer, Infallible> {
    conn.disarm(); // the headers came in time
    let admitted = !refused && inner.conns.lock().unwrap().start_request(conn.id, &inner.limits);
    if !admitted {
        if !refused {
            inner.conns.lock().unwrap().remove(conn.id, false);
        }
        return Ok(unavailable());
    }
    let mut guard = RequestGuard { inner: inner.clone(), conn: conn.clone(), ex: None };
    let (parts, mut body) = req.into_parts();
    let id = inner.next_id.fetch_add(1, Ordering::Relaxed) + 1;
    let headers = parts.headers.iter().map(|(k, v)| (Bytes::copy_from_slice(k.as_str().as_bytes()), Bytes::copy_from_slice(v.as_bytes()))).collect();
    let ex = Arc::new(Exchange {
        id,
        method: parts.method.as_str().to_string(),
        path: parts.uri.path().to_string(),
        query: Bytes::copy_from_slice(parts.uri.query().unwrap_or("").as_bytes()),
        http_version: version(parts.version),
        headers,
        client,
        server,
        state: Mutex::new(ExState::default()),
        room: Notify::new(),
        head_ready: Notify::new(),
        wake: inner.wake.clone(),
    });
    guard.ex = Some(ex.clone());
    // The body as far as it is here (usually all of it: it came with the head), without a task.
    let mut whole = false;
    loop {
        let polled = std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut body).poll_frame(cx))).await;
        match polled {
            Poll::Ready(Some(Ok(f))) => {
                if let Ok(d) = f.into_data() {
                    let mut st = ex.state.lock().unwrap();
                    st.body_bytes += d.len();
                    st.body.push(d);
                    if st.body_bytes >= HANDOFF_BYTES {
                        break;
                    }
                }
            }
            Poll::Ready(Some(Err(_))) | Poll::Ready(None) => {
                ex.state.lock().unwrap().body_end = true;
                whole = true;
                break;
            }
            Poll::Pending => break,
        }
    }
    // The rest, read by its own task (bounded: it waits for the caller past HANDOFF_BYTES).
    let mut reader = None;
    if !whole {
        let (first_tx, first_rx) = tokio::sync::oneshot::channel::<()>();
        reader = Some({
            let ex = ex.clone();
            tokio::spawn(async move {
                let mut first = Some(first_tx);
                loop {
                    match body.frame().await {
                        Some(Ok(f)) => {
                            if let Ok(d) = f.into_data() {
                                if !d.is_empty() {
                                    let mut full = false;
                                    ex.update(|st| {
                                        st.body_bytes += d.len();
                                        st.body.push(d);
                                        full = st.body_bytes >= HANDOFF_BYTES;
                                    });
                                    if full {
                                        if let Some(t) = first.take() {
                                            let _ = t.send(());
                                        }
                                        loop {
                                            let notified = ex.room.notified();
                                            if ex.state.lock().unwrap().body_bytes < HANDOFF_BYTES {
                                                break;
                                            }
                                            notified.await;
                                        }
                                    }
                                }
                            }
                        }
                        // The end, or a broken body (the client's connection: the answer finds out).
                        Some(Err(_)) | None => {
                            ex.update(|st| st.body_end = true);
                            if let Some(t) = first.take() {
                                let _ = t.send(());
                            }
                            return;
                        }
                    }
                }
            })
            .abort_handle()
        });
        if ex.state.lock().unwrap().body_bytes < HANDOFF_BYTES {
            let _ = tokio::time::timeout(HANDOFF_WAIT, first_rx).await;
        }
    }
    inner.wake.push(|r| r.0.push(ex.clone()));
    // The answer's head.
    let head = loop {
        let notified = ex.head_ready.notified();
        {
            let mut st = ex.state.lock().unwrap();
            if let Some(h) = st.head.take() {
                break Some(h);
            }
            if st.over {
                break None;
            }
        }
        notified.await;
    };
    let Some((status, headers)) = head else {
        if let Some(r) = reader {
            r.abort();
        }
        // Given up before its head (the caller's failure): the connection is closed.
        conn.close.notify_one();
        return Ok(unavailable());
    };
    let mut r = Response::new(http_body_util::Either::Left(OutBody { ex: ex.clone(), guard: Some(guard) }));
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let h = r.headers_mut();
    for (k, v) in headers {
        if let (Ok(k), Ok(v)) = (HeaderName::from_bytes(&k), HeaderValue::from_bytes(&v)) {
            h.append(k, v);
        }
    }
    Ok(r)
}

/// Serves one connection until it ends, its deadline passes while idle, or it is closed
/// (evicted, or refused after its answer).
async fn serve_conn(inner: Arc<Inner>, stream: tokio::net::TcpStream, client: SocketAddr, server: SocketAddr) {
    let _ = stream.set_nodelay(true);
    let id = inner.next_id.fetch_add(1, Ordering::Relaxed) + 1;
    let ip = client.ip().to_string();
    let conn = Arc::new(ConnState { id, ip: ip.clone(), close: Arc::new(Notify::new()), deadline: Mutex::new(None), rearm: Notify::new() });
    let refused = !inner.conns.lock().unwrap().add(id, &ip, ConnHandle { close: conn.close.clone(), ip: ip.clone() }, &inner.limits);
    if refused {
        // Every connection is serving a request: this one's is answered 503 and it is closed.
        inner.conns.lock().unwrap().remove(id, false);
    }
    conn.arm(&inner.limits, false);
    let svc = {
        let (inner, conn) = (inner.clone(), conn.clone());
        service_fn(move |req| handle(inner.clone(), conn.clone(), refused, server, client, req))
    };
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder.keep_alive(!refused);
    let c = builder.serve_connection(TokioIo::new(stream), svc);
    tokio::pin!(c);
    enum Event {
        Ended,
        Closed,
        Rearmed,
        Deadline,
    }
    loop {
        let deadline = *conn.deadline.lock().unwrap();
        let sleep = async {
            match deadline {
                Some(d) => tokio::time::sleep_until(d).await,
                None => std::future::pending().await,
            }
        };
        let closed = conn.close.notified();
        let rearmed = conn.rearm.notified();
        tokio::pin!(sleep, closed, rearmed);
        let event = std::future::poll_fn(|cx| {
            if c.as_mut().poll(cx).is_ready() {
                return Poll::Ready(Event::Ended);
            }
            if closed.as_mut().poll(cx).is_ready() {
                return Poll::Ready(Event::Closed);
            }
            if rearmed.as_mut().poll(cx).is_ready() {
                return Poll::Ready(Event::Rearmed);
            }
            if sleep.as_mut().poll(cx).is_ready() {
                return Poll::Ready(Event::Deadline);
            }
            Poll::Pending
        })
        .await;
        match event {
            Event::Ended | Event::Closed => break,
            Event::Rearmed => continue,
            Event::Deadline => {
                if conn.deadline.lock().unwrap().is_some_and(|d| d <= Instant::now()) {
                    inner.closed_stalled.fetch_add(1, Ordering::Relaxed);
                    break;
                }
            }
        }
    }
    inner.conns.lock().unwrap().remove(id, false);
}

/// What the server counts (`Server::stats`).
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Stats {
    pub open: usize,
    pub busy: usize,
    pub evicted: u64,
    pub refused: u64,
    pub closed_stalled: u64,
}

pub struct Server {
    rt: Option<tokio::runtime::Runtime>,
    inner: Arc<Inner>,
    pub local: SocketAddr,
}

impl Server {
    /// Listens on `host:port` (port 0: any free one) and serves at once, on `threads` threads.
    pub fn bind(host: &str, port: u16, limits: Limits, threads: usize) -> std::io::Result<Server> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads.max(1))
            .thread_name("switchyard-front")
            .enable_io()
            .enable_time()
            .build()?;
        let wake = Arc::new(Wake::new()?);
        let inner = Arc::new(Inner { limits, conns: Mutex::new(Conns::default()), wake, next_id: AtomicU64::new(0),
                                     closed_stalled: AtomicU64::new(0) });
        let listener = rt.block_on(async { TcpListener::bind((host, port)).await })?;
        let local = listener.local_addr()?;
        let acc = inner.clone();
        rt.spawn(async move {
            loop {
                match listener.accept().await {
                    Ok((stream, client)) => {
                        tokio::spawn(serve_conn(acc.clone(), stream, client, local));
                    }
                    // Out of descriptors or the like: a moment, then on (a client retries).
                    Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
                }
            }
        });
        Ok(Server { rt: Some(rt), inner, local })
    }

    /// The descriptor that becomes readable when requests are ready ([`Server::take_ready`]).
    pub fn wake_fd(&self) -> RawFd {
        self.inner.wake.fd()
    }

    /// New requests, and ids of requests that changed since the caller last waited on them.
    pub fn take_ready(&self) -> (Vec<Arc<Exchange>>, Vec<u64>) {
        self.inner.wake.take()
    }

    pub fn stats(&self) -> Stats {
        let c = self.inner.conns.lock().unwrap();
        Stats { open: c.total, busy: c.busy, evicted: c.evicted, refused: c.refused,
                closed_stalled: self.inner.closed_stalled.load(Ordering::Relaxed) }
    }

    /// Stops listening and closes every connection.
    pub fn shutdown(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.shutdown();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufRead, BufReader, Read, Write};
    use std::net::TcpStream;
    use std::time::Instant as StdInstant;

    fn limits() -> Limits {
        Limits { max_connections: 2, max_open: 3, max_per_ip: 3, request_timeout: Duration::from_millis(600),
                 keep_alive: Duration::from_secs(5) }
    }

    /// Answers every request on a thread of its own, as the event loop would: echo of the body
    /// with the path in a header, streamed in two pieces.
    fn echo(server: Server) -> (Arc<Server>, std::thread::JoinHandle<()>) {
        let s = Arc::new(server);
        let s2 = s.clone();
        let h = std::thread::spawn(move || {
            let mut live: Vec<Arc<Exchange>> = Vec::new();
            let deadline = StdInstant::now() + Duration::from_secs(20);
            while StdInstant::now() < deadline && Arc::strong_count(&s2) > 1 {
                let (new, _) = s2.take_ready();
                live.extend(new);
                live.retain(|ex| {
                    let mut body = Vec::new();
                    match ex.take_body() {
                        BodyTake::Data(d, true) => d.iter().for_each(|b| body.extend_from_slice(b)),
                        _ => return true,
                    }
                    if ex.path == "/hold" {
                        return false; // never answered
                    }
                    ex.start(200, vec![(Bytes::from_static(b"x-path"), Bytes::from(ex.path.clone()))], Bytes::from_static(b"got:"), false);
                    let _ = ex.send(Bytes::from(body), true);
                    false
                });
                std::thread::sleep(Duration::from_millis(2));
            }
        });
        (s, h)
    }

    fn request(port: u16, path: &str, body: &str) -> String {
        let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        write!(s, "POST {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}", body.len()).unwrap();
        let mut out = String::new();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let _ = s.read_to_string(&mut out);
        out
    }

    #[test]
    fn requests_are_handed_over_and_answered_chunk_by_chunk() {
        let server = Server::bind("127.0.0.1", 0, limits(), 1).unwrap();
        let port = server.local.port();
        let (s, _h) = echo(server);
        let out = request(port, "/a?b=1", "hello");
        assert!(out.starts_with("HTTP/1.1 200 OK"), "{out}");
        assert!(out.contains("x-path: /a"), "{out}");
        assert!(out.contains("got:") && out.contains("hello"), "{out}");
        drop(s);
    }

    #[test]
    fn a_silent_connection_is_closed_at_its_header_deadline() {
        let server = Server::bind("127.0.0.1", 0, limits(), 1).unwrap();
        let port = server.local.port();
        let mut c = TcpStream::connect(("127.0.0.1", port)).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let t = StdInstant::now();
        let n = c.read(&mut [0u8; 16]).unwrap_or(0);
        assert_eq!(n, 0);
        let took = t.elapsed();
        assert!(took >= Duration::from_millis(250) && took < Duration::from_secs(3), "{took:?}");
        assert_eq!(server.stats().closed_stalled, 1);
    }

    #[test]
    fn idle_connections_make_room_and_busy_ones_refuse() {
        let server = Server::bind("127.0.0.1", 0, Limits { request_timeout: Duration::from_secs(10), ..limits() }, 1).unwrap();
        let port = server.local.port();
        let (s, _h) = echo(server);
        // Three idle connections fill max_open; a fourth closes the oldest one.
        let idle: Vec<TcpStream> = (0..3).map(|_| TcpStream::connect(("127.0.0.1", port)).unwrap()).collect();
        std::thread::sleep(Duration::from_millis(100));
        assert!(request(port, "/x", "1").starts_with("HTTP/1.1 200"));
        let mut first = idle[0].try_clone().unwrap();
        first.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        assert_eq!(first.read(&mut [0u8; 4]).unwrap_or(0), 0);
        assert!(s.stats().evicted >= 1);
        // Two requests held unanswered fill max_connections: a third is 503.
        let mut held = Vec::new();
        for _ in 0..2 {
            let mut c = TcpStream::connect(("127.0.0.1", port)).unwrap();
            write!(c, "POST /hold HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n").unwrap();
            held.push(c);
        }
        let t = StdInstant::now();
        while s.stats().busy < 2 && t.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(10));
        }
        let out = request(port, "/y", "1");
        assert!(out.starts_with("HTTP/1.1 503"), "{out}");
        let mut r = BufReader::new(out.as_bytes());
        let mut line = String::new();
        r.read_line(&mut line).unwrap();
        assert!(out.to_ascii_lowercase().contains("connection: close"), "{out}");
        drop(held);
    }
}
