//! What the engine reused, as an OpenAI-compatible response reports it: the cached tokens a
//! request's [`Sent::finish`](super::Sent::finish) is given.

/// The cached tokens of a whole response body: its `usage.prompt_tokens_details.cached_tokens`
/// (0 when the usage has no details, as an engine without prompt token details answers);
/// `None` when the body is not JSON or has no usage.
///
/// ```
/// use kvevent_fleet::route::cached_tokens;
/// let body = br#"{"usage": {"prompt_tokens": 48, "prompt_tokens_details": {"cached_tokens": 32}}}"#;
/// assert_eq!(cached_tokens(body), Some(32));
/// assert_eq!(cached_tokens(br#"{"usage": {"prompt_tokens": 48}}"#), Some(0));
/// assert_eq!(cached_tokens(br#"{"choices": []}"#), None);
/// ```
pub fn cached_tokens(body: &[u8]) -> Option<u32> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    let usage = v.get("usage").filter(|u| !u.is_null())?;
    let cached = usage["prompt_tokens_details"]["cached_tokens"].as_u64();
    Some(cached.map_or(0, |c| u32::try_from(c).unwrap_or(u32::MAX)))
}

/// The cached tokens of a streamed response (server-sent events), read from its bytes as they
/// pass, in pieces cut anywhere: the last `data: ` line with a usage (the usage chunk a request
/// with `stream_options.include_usage` gets). A line is kept up to 1 MiB.
///
/// ```
/// use kvevent_fleet::route::StreamUsage;
/// let mut usage = StreamUsage::default();
/// usage.feed(b"data: {\"choices\": [{\"text\": \"a\"}]}\n\ndata: {\"choices\": [], \"usage\": {\"prompt_tokens_de");
/// usage.feed(b"tails\": {\"cached_tokens\": 16}}}\n\ndata: [DONE]\n\n");
/// assert_eq!(usage.cached_tokens(), Some(16));
/// ```
#[derive(Debug, Default)]
pub struct StreamUsage {
    line: Vec<u8>,
    cached: Option<u32>,
}

impl StreamUsage {
    /// The next bytes of the stream.
    pub fn feed(&mut self, bytes: &[u8]) {
        for &b in bytes {
            if b == b'\n' {
                if let Some(c) = self.line.strip_prefix(b"data: ").and_then(cached_tokens) {
                    self.cached = Some(c);
                }
                self.line.clear();
            } else if self.line.len() < 1 << 20 {
                self.line.push(b);
            }
        }
    }

    /// The cached tokens of the last usage seen.
    pub fn cached_tokens(&self) -> Option<u32> {
        self.cached
    }
}
