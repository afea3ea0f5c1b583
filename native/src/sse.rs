//! A worker's streamed answer (`text/event-stream` of OpenAI completion chunks) read into the
//! events the router's relay needs, as the pieces of its body arrive: lines split at LF (a line
//! may span pieces), only `data:` lines read, `[DONE]` the end; each chunk's text, token ids,
//! finish reason and usage taken out of its JSON, or the worker's `error`, or why the data is not
//! what a worker sends. The one reading of a worker's stream: `control_plane/router/worker_calls.py`
//! (`sse_events`) feeds it every piece, whichever adapter carried them.

use serde_json::Value;

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
#[derive(Default)]
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

fn memchr(s: &[u8], from: usize) -> Option<usize> {
    s[from..].iter().position(|&b| b == b'\n').map(|i| i + from)
}

/// Python's truth of a JSON value (an empty object, list or string, 0, false and null are false).
fn truthy(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64() != Some(0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
    }
}

fn json(v: &Value) -> Vec<u8> {
    serde_json::to_vec(v).unwrap_or_default()
}

fn read(data: &[u8]) -> Result<Option<Event>, String> {
    let v: Value = serde_json::from_slice(data).map_err(|e| format!("JSON is malformed: {e}"))?;
    let Value::Object(obj) = v else { return Err("a chunk is not a JSON object".into()) };
    if let Some(e) = obj.get("error") {
        return Ok(Some(Event::Error(json(e))));
    }
    let usage = obj.get("usage").filter(|u| truthy(u));
    let choice = match obj.get("choices") {
        Some(Value::Array(a)) if !a.is_empty() => &a[0],
        Some(c) if truthy(c) => return Err("`choices` is not a list".into()),
        _ => return Ok(usage.map(|u| Event::Usage(json(u)))),
    };
    let Value::Object(c) = choice else { return Err("a choice is not a JSON object".into()) };
    let text = match c.get("text") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(_) => return Err("a choice's `text` is not a string".into()),
    };
    let ids = c.get("token_ids").filter(|v| truthy(v)).or_else(|| obj.get("token_ids").filter(|v| truthy(v)));
    let token_ids = match ids {
        None => Vec::new(),
        Some(Value::Array(a)) => a.iter().map(|x| x.as_i64()).collect::<Option<Vec<i64>>>()
            .ok_or_else(|| "`token_ids` holds a value that is not an integer".to_string())?,
        Some(_) => return Err("`token_ids` is not a list".into()),
    };
    let finish_reason = match c.get("finish_reason") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => return Err("a choice's `finish_reason` is not a string".into()),
    };
    Ok(Some(Event::Chunk { text, token_ids, finish_reason, usage: usage.map(json) }))
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
    fn data_a_worker_does_not_send_is_bad() {
        for (data, says) in [(&b"data: {nope\n"[..], "JSON is malformed"), (b"data: [1]\n", "not a JSON object"),
                             (b"data: {\"choices\":{\"a\":1}}\n", "not a list"),
                             (b"data: {\"choices\":[{\"text\":5}]}\n", "`text`"),
                             (b"data: {\"choices\":[{\"token_ids\":[\"a\"]}]}\n", "not an integer")] {
            let got = all(&[data, b"data: [DONE]\n"]);
            assert!(matches!(&got[..], [Event::Bad(why)] if why.contains(says)), "{got:?}");
        }
    }
}
