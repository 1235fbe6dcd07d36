//! ZMQ framing around the payload: live PUB messages and the replay protocol.
//!
//! Only byte slices here; sockets live in the transport crate.

use crate::error::{Error, ErrorKind, Result};

/// The sequence number that marks the end of a replay.
pub const END_OF_REPLAY: u64 = u64::MAX;

/// A live message from the PUB socket: `[topic, seq, payload]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LiveMessage<'a> {
    /// The topic frame (may be empty).
    pub topic: &'a [u8],
    /// The publisher's sequence number.
    pub seq: u64,
    /// The msgpack `EventBatch`.
    pub payload: &'a [u8],
}

/// One reply from the replay ROUTER.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplayReply<'a> {
    /// A buffered batch. `topic` is present in the 0.26+ format.
    Batch {
        /// The topic frame (0.26+ only).
        topic: Option<&'a [u8]>,
        /// The batch's sequence number.
        seq: u64,
        /// The msgpack `EventBatch`.
        payload: &'a [u8],
    },
    /// The end marker: nothing more follows for this request.
    End,
}

fn bad(reason: &'static str, frame: usize) -> Error {
    Error::new(ErrorKind::BadFrames { reason }, frame)
}

fn seq_of(frame: &[u8], index: usize) -> Result<u64> {
    let bytes: [u8; 8] = frame
        .try_into()
        .map_err(|_| bad("sequence frame is not 8 bytes", index))?;
    Ok(u64::from_be_bytes(bytes))
}

/// Parses a live message.
///
/// ```
/// use kvevent_wire::frames;
/// let seq = 7u64.to_be_bytes();
/// let frames: [&[u8]; 3] = [b"kv-events", &seq, b"\x90"];
/// let msg = frames::parse_live(&frames)?;
/// assert_eq!((msg.topic, msg.seq, msg.payload), (&b"kv-events"[..], 7, &b"\x90"[..]));
/// let short: [&[u8]; 2] = [b"kv-events", b"\x90"];
/// assert!(frames::parse_live(&short).is_err());
/// # Ok::<(), kvevent_wire::Error>(())
/// ```
pub fn parse_live<'a, F: AsRef<[u8]>>(frames: &'a [F]) -> Result<LiveMessage<'a>> {
    match frames {
        [topic, seq, payload] => Ok(LiveMessage {
            topic: topic.as_ref(),
            seq: seq_of(seq.as_ref(), 1)?,
            payload: payload.as_ref(),
        }),
        _ => Err(bad(
            "a live message has 3 frames: topic, seq, payload",
            frames.len(),
        )),
    }
}

/// Parses a reply from the replay socket, in either format: leading empty frames are
/// dropped, then `[seq, payload]` (before 0.26) or `[topic, seq, payload]` (0.26+); a seq of
/// [`END_OF_REPLAY`] is the end marker.
pub fn parse_replay<'a, F: AsRef<[u8]>>(frames: &'a [F]) -> Result<ReplayReply<'a>> {
    let skip = frames.iter().take_while(|f| f.as_ref().is_empty()).count();
    // The end marker's trailing payload frame is empty too: keep at least two frames.
    let skip = skip.min(frames.len().saturating_sub(2));
    let rest = &frames[skip..];
    let (topic, seq_index) = match rest.len() {
        2 => (None, skip),
        3 => (Some(rest[0].as_ref()), skip + 1),
        _ => {
            return Err(bad(
                "a replay reply has [seq, payload] or [topic, seq, payload] after empty frames",
                frames.len(),
            ));
        }
    };
    let seq = seq_of(frames[seq_index].as_ref(), seq_index)?;
    if seq == END_OF_REPLAY {
        return Ok(ReplayReply::End);
    }
    Ok(ReplayReply::Batch {
        topic,
        seq,
        payload: frames[seq_index + 1].as_ref(),
    })
}

/// The two frames a DEALER sends to ask for every buffered batch from `start`:
/// `["", start as 8 bytes big-endian]`.
pub fn replay_request(start: u64) -> [Vec<u8>; 2] {
    [Vec::new(), start.to_be_bytes().to_vec()]
}

/// The frames a publisher sends for a live batch.
pub fn live_frames(topic: &[u8], seq: u64, payload: &[u8]) -> [Vec<u8>; 3] {
    [topic.to_vec(), seq.to_be_bytes().to_vec(), payload.to_vec()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replay_formats() {
        let seq = 5u64.to_be_bytes();
        let end = END_OF_REPLAY.to_be_bytes();
        let old: [&[u8]; 3] = [b"", &seq, b"payload"];
        let new: [&[u8]; 4] = [b"", b"kv", &seq, b"payload"];
        assert_eq!(
            parse_replay(&old).expect("old"),
            ReplayReply::Batch {
                topic: None,
                seq: 5,
                payload: b"payload"
            }
        );
        assert_eq!(
            parse_replay(&new).expect("new"),
            ReplayReply::Batch {
                topic: Some(b"kv"),
                seq: 5,
                payload: b"payload"
            }
        );
        let old_end: [&[u8]; 3] = [b"", &end, b""];
        let new_end: [&[u8]; 4] = [b"", b"", &end, b""];
        assert_eq!(parse_replay(&old_end).expect("old end"), ReplayReply::End);
        assert_eq!(parse_replay(&new_end).expect("new end"), ReplayReply::End);
        // 0.26+ with the default empty topic: ["", "", seq, payload].
        let empty_topic: [&[u8]; 4] = [b"", b"", &seq, b"p"];
        assert_eq!(
            parse_replay(&empty_topic).expect("empty topic"),
            ReplayReply::Batch {
                topic: None,
                seq: 5,
                payload: b"p"
            }
        );
    }

    #[test]
    fn bad_frames_are_errors() {
        let seq = 5u64.to_be_bytes();
        let cases: [&[&[u8]]; 4] = [
            &[],
            &[b""],
            &[b"", b"abc", b"p"],
            &[b"a", b"b", &seq, b"p", b"x"],
        ];
        for frames in cases {
            let err = parse_replay(frames).expect_err("must fail");
            assert!(matches!(err.kind(), ErrorKind::BadFrames { .. }), "{err}");
        }
        let short: [&[u8]; 3] = [b"t", b"1234", b"p"];
        assert!(parse_live(&short).is_err());
    }
}
