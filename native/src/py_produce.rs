//! The router's event producer: each envelope written and signed here ([`crate::emit`]) and
//! produced through librdkafka (the `rdkafka` crate), its delivery reports served by rdkafka's
//! own polling thread, never holding the GIL. `common/log/native_producer.py` is its Python
//! side: sequence numbers, partitions, the payload's bytes, the signing key, the ack ledger.
//!
//! A delivery report reaches Python only when someone needs it: every one with an ack ledger
//! (`report_all`), else only failures and acknowledgements without an offset (logged there).
//! Python takes them (`reports`) after each produce and in `flush`, where the confluent_kafka
//! producer served its callbacks (`poll(0)` after each produce, `flush`); librdkafka's warnings
//! (`logs`) the same way, for its `switchyard.rdkafka` logger.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use pyo3::exceptions::{PyConnectionError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use rdkafka::config::{ClientConfig, RDKafkaLogLevel};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, Message, OwnedHeaders};
use rdkafka::producer::{BaseRecord, DeliveryResult, Producer, ProducerContext, ThreadedProducer};
use rdkafka::ClientContext;

use crate::emit::{envelope, Head};
use crate::signing::HmacKey;

/// What a delivery report names of its event.
struct Pending {
    event_id: String,
    ty: String,
    key: String,
    seq: i64,
}

/// (event id, type, key, topic, partition, offset (-1: acknowledged without one), seq, error).
type Report = (String, String, String, String, i32, i64, i64, Option<String>);

/// librdkafka's log lines kept for Python between two takes; past it they are counted only.
const MAX_LOGS: usize = 1000;

/// A librdkafka log line: (syslog level, facility, message).
type LogLine = (i32, String, String);

struct Ctx {
    /// Every report kept for Python (an ack ledger records them), else only the ones it logs.
    all: bool,
    reports: Mutex<Vec<Report>>,
    /// Warnings and worse, for Python's `switchyard.rdkafka` logger (taken with the reports:
    /// never the GIL from librdkafka's threads, which may hold its locks while they log).
    logs: Mutex<Vec<LogLine>>,
    logs_dropped: AtomicU64,
    /// (statistics reports so far, the newest one's JSON): `statistics.interval.ms`.
    stats: Mutex<(u64, Option<String>)>,
    waiting: AtomicBool,
    acked: AtomicU64,
    unconfirmed: AtomicU64,
    failed: AtomicU64,
}

impl Ctx {
    fn keep_log(&self, level: i32, fac: &str, msg: &str) {
        let mut logs = self.logs.lock().unwrap();
        if logs.len() < MAX_LOGS {
            logs.push((level, fac.to_owned(), msg.to_owned()));
        } else {
            self.logs_dropped.fetch_add(1, Ordering::Relaxed);
        }
        drop(logs);
        self.waiting.store(true, Ordering::Release);
    }
}

impl ClientContext for Ctx {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, msg: &str) {
        // As the Python clients' `switchyard.rdkafka` logger shows them: warnings and worse.
        if (level as i32) <= RDKafkaLogLevel::Warning as i32 {
            self.keep_log(level as i32, fac, msg);
        }
    }

    fn error(&self, error: KafkaError, reason: &str) {
        self.keep_log(RDKafkaLogLevel::Error as i32, "ERROR", &format!("{error}: {reason}"));
    }

    fn stats_raw(&self, statistics: &[u8]) {
        let mut s = self.stats.lock().unwrap();
        s.0 += 1;
        s.1 = Some(String::from_utf8_lossy(statistics).into_owned());
    }
}

impl ProducerContext for Ctx {
    type DeliveryOpaque = Box<Pending>;

    fn delivery(&self, result: &DeliveryResult<'_>, p: Box<Pending>) {
        let (m, error) = match result {
            Ok(m) => (m, None),
            Err((e, m)) => (m, Some(e.to_string())),
        };
        let offset = m.offset().max(-1);
        let keep = if error.is_some() {
            self.failed.fetch_add(1, Ordering::Relaxed);
            true
        } else {
            self.acked.fetch_add(1, Ordering::Relaxed);
            if offset < 0 {
                // "Implicitly acked": a later batch of its partition was, not this one.
                self.unconfirmed.fetch_add(1, Ordering::Relaxed);
            }
            self.all || offset < 0
        };
        if keep {
            let Pending { event_id, ty, key, seq } = *p;
            let r = (event_id, ty, key, m.topic().to_owned(), m.partition(), offset, seq, error);
            self.reports.lock().unwrap().push(r);
            self.waiting.store(true, Ordering::Release);
        }
    }
}

#[pyclass(module = "switchyard_native", name = "EventProducer")]
struct PyEventProducer {
    p: ThreadedProducer<Ctx>,
    producer: String,
    epoch: i64,
    /// Header names: the type, the version, the producer (`common/log/kafka.py` `H_*`).
    headers: (String, String, String),
    /// Signing keys by their bytes, their padded blocks compressed once.
    keys: Mutex<HashMap<Vec<u8>, HmacKey>>,
}

#[pymethods]
impl PyEventProducer {
    #[new]
    #[pyo3(signature = (conf, producer, epoch, headers, report_all))]
    fn new(conf: Vec<(String, String)>, producer: String, epoch: i64, headers: (String, String, String),
           report_all: bool) -> PyResult<Self> {
        let mut c = ClientConfig::new();
        for (k, v) in conf {
            c.set(k, v);
        }
        let ctx = Ctx {
            all: report_all,
            reports: Mutex::new(Vec::new()),
            logs: Mutex::new(Vec::new()),
            logs_dropped: AtomicU64::new(0),
            stats: Mutex::new((0, None)),
            waiting: AtomicBool::new(false),
            acked: AtomicU64::new(0),
            unconfirmed: AtomicU64::new(0),
            failed: AtomicU64::new(0),
        };
        let p = c.create_with_context(ctx).map_err(|e| PyValueError::new_err(format!("librdkafka producer: {e}")))?;
        Ok(PyEventProducer { p, producer, epoch, headers, keys: Mutex::new(HashMap::new()) })
    }

    /// Write the envelope (signed with `sign_key` when given) and hand it to librdkafka for
    /// `topic`/`partition`, keyed by `key`, with the type, version and producer headers and
    /// the event's time in ms. Returns the value's size. Waits (without the GIL) while the
    /// local queue is full, as the Python producer did.
    #[pyo3(signature = (topic, partition, event_id, ty, v, key, seq, at_ns, corr, cause, data, sign_key))]
    #[allow(clippy::too_many_arguments)]
    fn produce(&self, py: Python<'_>, topic: &str, partition: i32, event_id: &str, ty: &str, v: i64, key: &str,
               seq: i64, at_ns: i64, corr: Option<&str>, cause: Option<&str>, data: &[u8],
               sign_key: Option<&[u8]>) -> PyResult<usize> {
        let head = Head { id: event_id, ty, v, key, producer: &self.producer, epoch: self.epoch, seq, at_ns, corr, cause };
        let value = match sign_key {
            None => envelope(&head, data, None),
            Some(k) => {
                let mut keys = self.keys.lock().unwrap();
                let hk = keys.entry(k.to_vec()).or_insert_with(|| HmacKey::new(k));
                envelope(&head, data, Some(hk))
            }
        };
        let version = v.to_string();
        let headers = OwnedHeaders::new_with_capacity(3)
            .insert(Header { key: &self.headers.0, value: Some(ty) })
            .insert(Header { key: &self.headers.1, value: Some(&version) })
            .insert(Header { key: &self.headers.2, value: Some(&self.producer) });
        let pending = Box::new(Pending { event_id: event_id.to_owned(), ty: ty.to_owned(), key: key.to_owned(), seq });
        let mut record = BaseRecord::with_opaque_to(topic, pending)
            .partition(partition)
            .key(key)
            .payload(&value)
            .timestamp(at_ns.div_euclid(1_000_000))
            .headers(headers);
        loop {
            match self.p.send(record) {
                Ok(()) => return Ok(value.len()),
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), r)) => {
                    // Backpressure: the polling thread serves delivery reports meanwhile.
                    record = r;
                    py.detach(|| std::thread::sleep(Duration::from_millis(5)));
                }
                Err((e, _)) => {
                    return Err(PyRuntimeError::new_err(format!("produce {ty} to {topic}[{partition}]: {e}")))
                }
            }
        }
    }

    /// True when reports are waiting for `reports`.
    #[getter]
    fn waiting(&self) -> bool {
        self.p.context().waiting.load(Ordering::Acquire)
    }

    /// The delivery reports kept since the last call.
    fn reports(&self) -> Vec<Report> {
        let ctx = self.p.context();
        ctx.waiting.store(false, Ordering::Release);
        std::mem::take(&mut *ctx.reports.lock().unwrap())
    }

    /// librdkafka's warnings and worse since the last call, as (syslog level, facility,
    /// message); lines past the buffer's room are counted in one more line.
    fn logs(&self) -> Vec<LogLine> {
        let ctx = self.p.context();
        let mut out = std::mem::take(&mut *ctx.logs.lock().unwrap());
        let dropped = ctx.logs_dropped.swap(0, Ordering::Relaxed);
        if dropped > 0 {
            out.push((RDKafkaLogLevel::Warning as i32, "LOG".to_owned(), format!("{dropped} more log lines dropped")));
        }
        out
    }

    /// (statistics reports so far, the newest one's JSON or None).
    fn statistics(&self) -> (u64, Option<String>) {
        self.p.context().stats.lock().unwrap().clone()
    }

    /// (acknowledged, of them without an offset, failed) so far.
    fn counts(&self) -> (u64, u64, u64) {
        let c = self.p.context();
        (c.acked.load(Ordering::Relaxed), c.unconfirmed.load(Ordering::Relaxed), c.failed.load(Ordering::Relaxed))
    }

    /// Wait up to `timeout_s` for every delivery report; returns how many are still outstanding.
    fn flush(&self, py: Python<'_>, timeout_s: f64) -> i32 {
        let _ = py.detach(|| self.p.flush(Duration::from_secs_f64(timeout_s.max(0.0))));
        self.p.in_flight_count()
    }

    /// Events handed to librdkafka whose delivery report has not been served yet.
    fn in_flight(&self) -> i32 {
        self.p.in_flight_count()
    }

    /// `topic`'s partitions, sorted, or none and why the broker does not list it; a transport
    /// error is a `ConnectionError` (`common/log/metadata.py` asks again within its deadline).
    fn partitions(&self, py: Python<'_>, topic: &str, timeout_s: f64) -> PyResult<(Vec<i32>, Option<String>)> {
        let md = py
            .detach(|| self.p.client().fetch_metadata(Some(topic), Duration::from_secs_f64(timeout_s.max(0.0))))
            .map_err(|e| PyConnectionError::new_err(format!("metadata for {topic}: {e}")))?;
        let why = |w: String| (Vec::new(), Some(w));
        Ok(match md.topics().iter().find(|t| t.name() == topic) {
            None => why("not listed".to_owned()),
            Some(t) => match t.error() {
                Some(e) => why(format!("{:?}", RDKafkaErrorCode::from(e))),
                None if t.partitions().is_empty() => why("no partitions".to_owned()),
                None => {
                    let mut ps: Vec<i32> = t.partitions().iter().map(|p| p.id()).collect();
                    ps.sort_unstable();
                    (ps, None)
                }
            },
        })
    }

    /// The linked librdkafka's version string.
    #[staticmethod]
    fn librdkafka_version() -> String {
        rdkafka::util::get_rdkafka_version().1
    }
}

/// The record value `EventProducer.produce` writes for these fields (the test of its bytes
/// against `EventCodec.encode` and `Signer.sign`: `tests/unit/test_native_producer.py`).
#[pyfunction]
#[pyo3(signature = (event_id, ty, v, key, producer, epoch, seq, at_ns, corr, cause, data, sign_key))]
#[allow(clippy::too_many_arguments)]
fn event_envelope<'py>(py: Python<'py>, event_id: &str, ty: &str, v: i64, key: &str, producer: &str, epoch: i64,
                       seq: i64, at_ns: i64, corr: Option<&str>, cause: Option<&str>, data: &[u8],
                       sign_key: Option<&[u8]>) -> Bound<'py, pyo3::types::PyBytes> {
    let head = Head { id: event_id, ty, v, key, producer, epoch, seq, at_ns, corr, cause };
    let hk = sign_key.map(HmacKey::new);
    pyo3::types::PyBytes::new(py, &envelope(&head, data, hk.as_ref()))
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(event_envelope, m)?)?;
    m.add_class::<PyEventProducer>()
}
