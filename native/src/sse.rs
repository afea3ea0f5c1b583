//! A worker's streamed answer (`text/event-stream` of OpenAI completion chunks) read into the
//! events the router's relay needs, as the pieces of its body arrive: lines split at LF (a line
//! may span pieces), only `data:` lines read, `[DONE]` the end; each chunk's text, token ids,
//! finish reason and usage taken out of its JSON, or the worker's `error`, or why the data is not
//! what a worker sends. The one reading of a worker's stream: `control_plane/router/worker_calls.py`
//! (`sse_events`) feeds it every piece, whichever adapter carried them.
//!
//! [`Relay`] folds those events into the whole answer as the router records it (its text, token
//! counts, the time of its first token and between tokens, finish reason, usage, how it ended):
//! what `calls.rs` keeps for a call whose answer the crate reads to its end (a non-streaming
//! request), and what the in-memory adapter feeds in process.

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::value::RawValue;

#[derive(Debug, PartialEq)]
pub enum Event {
    /// A choice: its text, token ids, finish reason, and the usage sent with it (JSON).
    Chunk { text: String, token_ids: Vec<i64>, finish_reason: Option<String>, usage: Option<Vec<u8>> },
    /// A chunk without a choice that carries usage (the `include_usage` record), as JSON.
    Usage(Vec<u8>),
    /// `data: [DONE]`: the answer is complete.
    Done,
    /// The worker's `error` (its JSON).
    Error(Vec<u8>),
    /// Data that is not what a worker sends, and why.
    Bad(String),
}

/// Reads one answer; nothing more is read after its end (`Done`, `Error`, `Bad`).
#[derive(Default, Debug)]
pub struct Reader {
    rest: Vec<u8>,
    over: bool,
}

impl Reader {
    /// The events of the lines `piece` completes.
    pub fn feed(&mut self, piece: &[u8], out: &mut Vec<Event>) {
        let mut start = 0;
        while !self.over {
            let Some(at) = memchr(piece, start) else { break };
            if self.rest.is_empty() {
                self.line(&piece[start..at], out);
            } else {
                let mut whole = std::mem::take(&mut self.rest);
                whole.extend_from_slice(&piece[start..at]);
                self.line(&whole, out);
            }
            start = at + 1;
        }
        if !self.over {
            self.rest.extend_from_slice(&piece[start..]);
        }
    }

    /// The events of a last line without LF, once the body ended.
    pub fn end(&mut self, out: &mut Vec<Event>) {
        if !self.over && !self.rest.is_empty() {
            let last = std::mem::take(&mut self.rest);
            self.line(&last, out);
        }
    }

    fn line(&mut self, line: &[u8], out: &mut Vec<Event>) {
        let Some(data) = line.strip_prefix(b"data:") else { return };
        let data = data.trim_ascii();
        if data == b"[DONE]" {
            self.over = true;
            out.push(Event::Done);
            return;
        }
        match read(data) {
            Ok(Some(ev)) => {
                self.over = matches!(ev, Event::Error(_));
                out.push(ev);
            }
            Ok(None) => {}
            Err(why) => {
                self.over = true;
                out.push(Event::Bad(why));
            }
        }
    }
}

/// How a relayed answer ended.
#[derive(Clone, Debug, PartialEq)]
pub enum RelayEnd {
    /// `[DONE]`: complete.
    Done,
    /// The worker's `error` (its JSON).
    Error(Vec<u8>),
    /// Data that is not what a worker sends, and why.
    Bad(String),
    /// The body ended without `[DONE]`.
    Cut,
    /// The transport failed (the router's code, what happened).
    Failed(String, String),
}

/// A worker's answer folded as it arrives (module docstring); times are the caller's clock
/// ([`mono_now`]: the one Python's `time.monotonic()` reads), in seconds.
#[derive(Default, Debug)]
pub struct Relay {
    reader: Reader,
    events: Vec<Event>,
    /// Every chunk's text, in order.
    pub text: String,
    /// Chunks read (with a choice, or a usage record alone).
    pub chunks: u64,
    /// Chunks that carried a token (text or token ids).
    pub token_chunks: u64,
    /// Tokens: each token chunk's ids, at least one.
    pub tokens: u64,
    /// `tokens` when the last usage record came (0: none came).
    pub tokens_at_usage: u64,
    pub first_at: Option<f64>,
    last_at: f64,
    /// Between one token chunk and the next, in ms.
    pub itls_ms: Vec<f64>,
    /// The last non-empty finish reason.
    pub finish_reason: Option<String>,
    /// The last usage record (JSON), when one was not empty.
    pub usage: Option<Vec<u8>>,
    pub end: Option<RelayEnd>,
    pub end_at: f64,
}

impl Relay {
    /// Folds the events of the lines `piece` completes, read at `now`; true when the answer's
    /// first token came in it.
    pub fn feed(&mut self, piece: &[u8], now: f64) -> bool {
        if self.end.is_some() {
            return false;
        }
        let had = self.first_at.is_some();
        let mut evs = std::mem::take(&mut self.events);
        self.reader.feed(piece, &mut evs);
        self.fold(&mut evs, now);
        self.events = evs;
        !had && self.first_at.is_some()
    }

    /// The body ended at `now`: a last line without LF is read; no `[DONE]` is a cut answer.
    /// True when the first token came in that last line.
    pub fn body_end(&mut self, now: f64) -> bool {
        if self.end.is_some() {
            return false;
        }
        let had = self.first_at.is_some();
        let mut evs = std::mem::take(&mut self.events);
        self.reader.end(&mut evs);
        self.fold(&mut evs, now);
        self.events = evs;
        if self.end.is_none() {
            self.end = Some(RelayEnd::Cut);
            self.end_at = now;
        }
        !had && self.first_at.is_some()
    }

    /// The transport failed at `now` (nothing more comes).
    pub fn fail(&mut self, code: &str, detail: &str, now: f64) {
        if self.end.is_none() {
            self.end = Some(RelayEnd::Failed(code.to_string(), detail.to_string()));
            self.end_at = now;
        }
    }

    fn fold(&mut self, evs: &mut Vec<Event>, now: f64) {
        for ev in evs.drain(..) {
            match ev {
                Event::Chunk { text, token_ids, finish_reason, usage } => {
                    self.chunks += 1;
                    if !text.is_empty() || !token_ids.is_empty() {
                        self.token_chunks += 1;
                        match self.first_at {
                            None => self.first_at = Some(now),
                            Some(_) => self.itls_ms.push((now - self.last_at) * 1000.0),
                        }
                        self.last_at = now;
                        self.tokens += token_ids.len().max(1) as u64;
                    }
                    self.text.push_str(&text);
                    if let Some(f) = finish_reason.filter(|f| !f.is_empty()) {
                        self.finish_reason = Some(f);
                    }
                    if let Some(u) = usage {
                        self.usage = Some(u);
                        self.tokens_at_usage = self.tokens;
                    }
                }
                Event::Usage(u) => {
                    self.chunks += 1;
                    self.usage = Some(u);
                    self.tokens_at_usage = self.tokens;
                }
                Event::Done => self.end = Some(RelayEnd::Done),
                Event::Error(e) => self.end = Some(RelayEnd::Error(e)),
                Event::Bad(why) => self.end = Some(RelayEnd::Bad(why)),
            }
            if self.end.is_some() {
                self.end_at = now;
            }
        }
    }
}

/// Seconds on `CLOCK_MONOTONIC`: the clock of Python's `time.monotonic()` (Linux).
pub fn mono_now() -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid pointer to a timespec; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

fn memchr(s: &[u8], from: usize) -> Option<usize> {
    s[from..].iter().position(|&b| b == b'\n').map(|i| i + from)
}

/// What the relay reads of a chunk, borrowed from its bytes (every other field is skipped):
/// typed, not a `serde_json::Value` tree (a 16-token answer read in 59 us against 95 with a tree
/// or Python's own loop; docs/benchmarks-peers.md).
#[derive(Deserialize)]
struct Data<'a> {
    #[serde(default, borrow)]
    error: Option<&'a RawValue>,
    #[serde(default, borrow)]
    usage: Option<&'a RawValue>,
    #[serde(default, borrow)]
    choices: Option<Vec<Choice<'a>>>,
    #[serde(default)]
    token_ids: Option<Vec<i64>>,
}

#[derive(Deserialize)]
struct Choice<'a> {
    #[serde(default, borrow)]
    text: Option<Cow<'a, str>>,
    #[serde(default)]
    token_ids: Option<Vec<i64>>,
    #[serde(default, borrow)]
    finish_reason: Option<Cow<'a, str>>,
}

/// Whether a JSON value is true as Python sees it (an empty object, list or string, 0 and false
/// are not; null is never here: serde reads it as `None`).
fn truthy(raw: &RawValue) -> bool {
    let t: Vec<u8> = raw.get().bytes().filter(|b| !b.is_ascii_whitespace()).collect();
    !matches!(&t[..], b"{}" | b"[]" | b"\"\"" | b"0" | b"false" | b"0.0")
}

fn read(data: &[u8]) -> Result<Option<Event>, String> {
    if data.first() != Some(&b'{') {
        // serde would read a list as the struct's fields in order
        return Err(match serde_json::from_slice::<serde::de::IgnoredAny>(data) {
            Ok(_) => "not a worker's chunk: not a JSON object".into(),
            Err(e) => format!("JSON is malformed: {e}"),
        });
    }
    let d: Data = serde_json::from_slice(data).map_err(|e| {
        if e.is_data() { format!("not a worker's chunk: {e}") } else { format!("JSON is malformed: {e}") }
    })?;
    if let Some(e) = d.error {
        return Ok(Some(Event::Error(e.get().as_bytes().to_vec())));
    }
    let usage = d.usage.filter(|u| truthy(u)).map(|u| u.get().as_bytes().to_vec());
    let Some(choice) = d.choices.and_then(|c| c.into_iter().next()) else {
        return Ok(usage.map(Event::Usage));
    };
    let token_ids = choice.token_ids.filter(|t| !t.is_empty()).or(d.token_ids).unwrap_or_default();
    Ok(Some(Event::Chunk { text: choice.text.map(Cow::into_owned).unwrap_or_default(), token_ids,
                           finish_reason: choice.finish_reason.map(Cow::into_owned), usage }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(pieces: &[&[u8]]) -> Vec<Event> {
        let mut r = Reader::default();
        let mut out = Vec::new();
        for p in pieces {
            r.feed(p, &mut out);
        }
        r.end(&mut out);
        out
    }

    fn chunk(text: &str, ids: &[i64], finish: Option<&str>, usage: Option<&str>) -> Event {
        Event::Chunk { text: text.into(), token_ids: ids.to_vec(), finish_reason: finish.map(Into::into),
                       usage: usage.map(|u| u.as_bytes().to_vec()) }
    }

    #[test]
    fn lines_span_pieces_and_only_data_lines_count() {
        let got = all(&[b": comment\r\ndata: {\"choices\":[{\"te", b"xt\":\" a\",\"token_ids\":[7]}]}\r\n\r\n",
                        b"event: x\ndata:{\"choices\":[{\"text\":\"\",\"finish_reason\":\"length\"}],\"usage\":{\"a\":1}}\n",
                        b"data: {\"choices\":[],\"usage\":{\"completion_tokens\":2}}\n\ndata: [DONE]\n\ndata: {}\n"]);
        assert_eq!(got, vec![chunk(" a", &[7], None, None), chunk("", &[], Some("length"), Some("{\"a\":1}")),
                             Event::Usage(b"{\"completion_tokens\":2}".to_vec()), Event::Done]);
    }

    #[test]
    fn token_ids_of_the_chunk_when_the_choice_has_none() {
        let got = all(&[b"data: {\"choices\":[{\"text\":\"x\",\"token_ids\":[]}],\"token_ids\":[1,2]}"]);
        assert_eq!(got, vec![chunk("x", &[1, 2], None, None)]);
    }

    #[test]
    fn nothing_without_choices_or_usage() {
        assert_eq!(all(&[b"data: {\"choices\":[],\"usage\":{}}\ndata: {\"id\":1}\n"]), vec![]);
    }

    #[test]
    fn the_workers_error_ends_the_answer() {
        let got = all(&[b"data: {\"error\":{\"message\":\"boom\"}}\ndata: [DONE]\n"]);
        assert_eq!(got, vec![Event::Error(b"{\"message\":\"boom\"}".to_vec())]);
    }

    #[test]
    fn a_relay_folds_the_whole_answer_and_times_its_tokens() {
        let mut r = Relay::default();
        assert!(!r.feed(b"data: {\"choices\":[{\"text\":\"\"}]}\n", 1.0));
        assert!(r.feed(b"data: {\"choices\":[{\"text\":\"a\",\"token_ids\":[1,2]}]}\ndata: {\"choices\":[{\"te", 1.5));
        assert!(!r.feed(b"xt\":\"b\",\"finish_reason\":\"stop\"}]}\n", 1.75));
        assert!(!r.feed(b"data: {\"choices\":[],\"usage\":{\"completion_tokens\":3}}\ndata: [DONE]\n", 2.0));
        assert_eq!((r.text.as_str(), r.chunks, r.token_chunks, r.tokens, r.tokens_at_usage), ("ab", 4, 2, 3, 3));
        assert_eq!((r.first_at, r.itls_ms.clone(), r.finish_reason.as_deref()), (Some(1.5), vec![250.0], Some("stop")));
        assert_eq!((r.end.clone(), r.end_at, r.usage.as_deref()), (Some(RelayEnd::Done), 2.0, Some(&b"{\"completion_tokens\":3}"[..])));
        assert!(!r.feed(b"data: {\"choices\":[{\"text\":\"c\"}]}\n", 3.0), "nothing after the end");
        assert_eq!(r.text, "ab");
    }

    #[test]
    fn a_relay_without_done_is_cut_and_a_failure_is_kept() {
        let mut r = Relay::default();
        assert!(!r.body_end(1.0) && r.end == Some(RelayEnd::Cut));
        let mut r = Relay::default();
        assert!(r.body_end_after(b"data: {\"choices\":[{\"text\":\"x\"}]}", 2.0));
        assert_eq!((r.text.as_str(), r.end.clone()), ("x", Some(RelayEnd::Cut)));
        let mut r = Relay::default();
        r.feed(b"data: {\"error\":{\"m\":1}}\n", 1.0);
        r.fail("timeout", "late", 2.0);
        assert_eq!(r.end, Some(RelayEnd::Error(b"{\"m\":1}".to_vec())));
        let mut r = Relay::default();
        r.fail("worker_lost", "reset", 2.0);
        assert_eq!(r.end, Some(RelayEnd::Failed("worker_lost".into(), "reset".into())));
    }

    impl Relay {
        fn body_end_after(&mut self, piece: &[u8], now: f64) -> bool {
            self.feed(piece, now) | self.body_end(now)
        }
    }

    #[test]
    fn data_a_worker_does_not_send_is_bad() {
        for (data, says) in [(&b"data: {nope\n"[..], "JSON is malformed"), (b"data: [1]\n", "not a worker's chunk"),
                             (b"data: {\"choices\":{\"a\":1}}\n", "not a worker's chunk"),
                             (b"data: {\"choices\":[{\"text\":5}]}\n", "not a worker's chunk"),
                             (b"data: {\"choices\":[{\"token_ids\":[\"a\"]}]}\n", "not a worker's chunk")] {
            let got = all(&[data, b"data: [DONE]\n"]);
            assert!(matches!(&got[..], [Event::Bad(why)] if why.contains(says)), "{got:?}");
        }
    }
}
