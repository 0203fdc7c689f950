//! The wire protocol: length-prefixed JSON frames over a Unix stream socket.
//!
//! A frame is a 4-byte little-endian length followed by that many bytes of one JSON object.
//! Frames larger than [`MAX_FRAME`] are refused before anything is read into memory. Every
//! request carries an `id` the reply echoes; messages the broker sends unasked
//! ([`Reply::Reclaim`], [`Reply::Shutdown`]) carry no id.

use std::io::{self, Read, Write};

use serde::{Deserialize, Serialize};

/// The protocol version a client announces in [`Request::Hello`].
pub const PROTOCOL_VERSION: u32 = 2;

/// The largest frame either side accepts, in bytes: a publish with the most [`MAX_META`] and
/// its 64 sizes.
pub const MAX_FRAME: usize = 20 * 1024;

/// The longest tenant name, in bytes.
pub const MAX_TENANT: usize = 64;

/// The longest token, in bytes.
pub const MAX_TOKEN: usize = 256;

/// The longest prefix key, in bytes.
pub const MAX_KEY: usize = 128;

/// The most bytes of a prefix's `meta` (what its readers need besides the descriptors: where
/// each handle lies, and what they must agree with to read the bytes, an FP8 prefix's scales
/// among them: those of 80 layers x 2 x 8 KV heads take 6828 bytes in base64; the frame that
/// carries it holds at most [`MAX_FRAME`]).
pub const MAX_META: usize = 16 * 1024;

/// A message from a client to the broker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// The first message of a connection: who the client is.
    Hello {
        /// Echoed in the reply.
        id: u64,
        /// The tenant the client bills to.
        tenant: String,
        /// The tenant's token, when the broker requires one.
        token: Option<String>,
        /// [`PROTOCOL_VERSION`].
        version: u32,
    },
    /// After a reconnect: bytes on `device` the client already holds (granted by a previous
    /// broker). Accepted once per device, before any [`Request::Acquire`] on it.
    Claim {
        /// Echoed in the reply.
        id: u64,
        /// The device index.
        device: u32,
        /// Bytes held.
        bytes: u64,
    },
    /// Asks for at least `need` and at most `want` more bytes on `device`.
    Acquire {
        /// Echoed in the reply.
        id: u64,
        /// The device index.
        device: u32,
        /// The least that is of any use.
        need: u64,
        /// The most wanted (a batch).
        want: u64,
    },
    /// Gives `bytes` on `device` back to the node.
    Return {
        /// Echoed in the reply.
        id: u64,
        /// The device index.
        device: u32,
        /// Bytes given back (at most what the client holds there).
        bytes: u64,
    },
    /// Publishes a prefix: one descriptor per handle of its physical memory (exported) rides
    /// on this frame. Its bytes (the sum of `sizes`) move from the client's holding to the
    /// prefix, billed once.
    Publish {
        /// Echoed in the reply.
        id: u64,
        /// The device index.
        device: u32,
        /// The prefix's name within the tenant.
        key: String,
        /// The size of each handle, in the order of the descriptors (1 to 64 of them).
        sizes: Vec<u64>,
        /// What the prefix's readers need besides the descriptors (the KV layer's encoded
        /// descriptor: where each handle lies, the tokens it holds), carried as is: at most
        /// [`MAX_META`] bytes of printable ASCII.
        #[serde(default)]
        meta: String,
    },
    /// Opens a prefix of the client's tenant: the answer carries its descriptors.
    Open {
        /// Echoed in the reply.
        id: u64,
        /// The prefix's name within the tenant.
        key: String,
    },
    /// Lets go of a prefix opened (or published) once.
    Close {
        /// Echoed in the reply.
        id: u64,
        /// The prefix's name within the tenant.
        key: String,
    },
    /// After a reconnect: the client used its tenant's prefix `key` (`bytes` on `device`)
    /// `uses` times under a previous broker. It is a user again; a prefix nobody claimed
    /// yet is billed again to the tenant (without descriptors: it cannot be opened until
    /// published again).
    ClaimPrefix {
        /// Echoed in the reply.
        id: u64,
        /// The prefix's name within the tenant.
        key: String,
        /// The device index.
        device: u32,
        /// The prefix's bytes (the sum of its handles' sizes).
        bytes: u64,
        /// Times the client opened (or published) it and has not closed it.
        uses: u32,
    },
    /// Nothing but an answer: a client's sign of life when it has nothing to ask, and a
    /// barrier (every message sent before it has been served when its answer comes).
    Ping {
        /// Echoed in the reply.
        id: u64,
    },
}

impl Request {
    /// The request's id.
    pub fn id(&self) -> u64 {
        match self {
            Request::Hello { id, .. }
            | Request::Claim { id, .. }
            | Request::Acquire { id, .. }
            | Request::Return { id, .. }
            | Request::Publish { id, .. }
            | Request::Open { id, .. }
            | Request::Close { id, .. }
            | Request::ClaimPrefix { id, .. }
            | Request::Ping { id } => *id,
        }
    }
}

/// Why the broker refused an [`Request::Acquire`]: the local governor's two kinds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum WireRefusal {
    /// Not enough free on the node now; retry after `retry_after_ms`.
    Backpressure {
        /// Bytes asked for.
        needed: u64,
        /// Bytes the client could have been granted.
        available: u64,
        /// When a retry is likely to succeed.
        retry_after_ms: u64,
    },
    /// The client would hold more than a limit allows, whatever anybody frees.
    NeverFits {
        /// Bytes the client would hold.
        needed: u64,
        /// `"tenant_ceiling"` or `"node_budget"`.
        limit: String,
        /// The most that limit allows.
        limit_bytes: u64,
    },
}

/// Why the broker answered a request with an error (the connection is closed after each,
/// except [`ErrorCode::RateLimited`], [`ErrorCode::NotHeld`] and
/// [`ErrorCode::BadDescriptor`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// A frame that is not a request, or a request out of order.
    Invalid,
    /// The tenant is unknown, or its token is wrong.
    Unauthorized,
    /// More clients than the broker serves.
    TooManyClients,
    /// More messages per second than a client may send; this one was dropped.
    RateLimited,
    /// A return of more than the client holds, or a second claim: nothing changed.
    NotHeld,
    /// A published descriptor that is not a driver's exported memory of the size claimed
    /// (a socket, a pipe, a file, ...): nothing changed.
    BadDescriptor,
}

/// A message from the broker to a client.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Reply {
    /// The answer to [`Request::Hello`].
    Welcome {
        /// The request's id.
        id: u64,
        /// The client's number at this broker.
        client: u64,
        /// The tenant's guaranteed bytes per device.
        floor: u64,
        /// The most the tenant may hold per device (at most the node's budget).
        ceiling: u64,
        /// The node's budget per device.
        budget: u64,
        /// The most the client may stay silent, in milliseconds, before it is dropped: it
        /// pings well within it (0: no limit).
        #[serde(default)]
        idle_ms: u64,
    },
    /// Bytes the client now holds on `device` (the answer to a claim, an acquire or a
    /// return); `granted` is what an acquire added (0 otherwise).
    Held {
        /// The request's id.
        id: u64,
        /// The device index.
        device: u32,
        /// Bytes added by this request.
        granted: u64,
        /// Bytes the client holds there now.
        held: u64,
    },
    /// An opened prefix: one descriptor per handle rides on this frame.
    Prefix {
        /// The request's id.
        id: u64,
        /// The device index.
        device: u32,
        /// The size of each handle, in the order of the descriptors.
        sizes: Vec<u64>,
        /// The publisher's `meta`, as published.
        #[serde(default)]
        meta: String,
    },
    /// The answer to [`Request::Ping`].
    Pong {
        /// The request's id.
        id: u64,
    },
    /// The users a prefix has left after a close (0: it was freed), or has after a claim.
    Users {
        /// The request's id.
        id: u64,
        /// Users left.
        users: u64,
    },
    /// An acquire that could not be granted.
    Refused {
        /// The request's id.
        id: u64,
        /// The device index.
        device: u32,
        /// Why.
        refusal: WireRefusal,
    },
    /// A request the broker would not serve.
    Error {
        /// The request's id (0 when the frame could not be read).
        id: u64,
        /// What went wrong.
        code: ErrorCode,
        /// Words for a person.
        message: String,
    },
    /// Unasked: the node needs `bytes` on `device`; give back what you can spare.
    Reclaim {
        /// The device index.
        device: u32,
        /// Bytes wanted back.
        bytes: u64,
    },
    /// Unasked: the broker is stopping; nothing more will be granted on this connection.
    Shutdown {
        /// Why.
        reason: String,
    },
}

/// Writes `msg` as one frame.
pub fn write_frame<T: Serialize>(w: &mut impl Write, msg: &T) -> io::Result<()> {
    w.write_all(&encode_frame(msg)?)?;
    w.flush()
}

/// `msg` as the bytes of one frame.
pub fn encode_frame<T: Serialize>(msg: &T) -> io::Result<Vec<u8>> {
    let body = serde_json::to_vec(msg).map_err(io::Error::other)?;
    if body.len() > MAX_FRAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "frame too large",
        ));
    }
    let len = u32::try_from(body.len()).map_err(io::Error::other)?;
    let mut buf = Vec::with_capacity(body.len() + 4);
    buf.extend_from_slice(&len.to_le_bytes());
    buf.extend_from_slice(&body);
    Ok(buf)
}

/// What [`read_frame`] found.
#[derive(Debug)]
pub enum Frame<T> {
    /// A message.
    Message(T),
    /// The peer closed the stream between frames.
    Closed,
    /// A frame of the right size that is not a valid message (the stream stays in step).
    Malformed(String),
}

/// Reads one frame. A length over [`MAX_FRAME`] or a stream cut inside a frame is an error
/// (the stream cannot be resynchronised).
pub fn read_frame<T: for<'de> Deserialize<'de>>(r: &mut impl Read) -> io::Result<Frame<T>> {
    let mut len = [0u8; 4];
    let mut got = 0;
    while got < len.len() {
        match r.read(&mut len[got..]) {
            Ok(0) if got == 0 => return Ok(Frame::Closed),
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    let len = usize::try_from(u32::from_le_bytes(len)).map_err(io::Error::other)?;
    if len > MAX_FRAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("frame of {len} bytes (most {MAX_FRAME})"),
        ));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)?;
    Ok(match serde_json::from_slice(&body) {
        Ok(m) => Frame::Message(m),
        Err(e) => Frame::Malformed(e.to_string()),
    })
}

/// Whether `name` is a valid tenant name: 1 to [`MAX_TENANT`] bytes of ASCII letters, digits,
/// `-`, `_` and `.`.
pub fn valid_tenant(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_TENANT
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

/// Whether `meta` may ride with a published prefix: at most [`MAX_META`] bytes of printable
/// ASCII (spaces included).
pub fn valid_meta(meta: &str) -> bool {
    meta.len() <= MAX_META && meta.bytes().all(|b| b == b' ' || b.is_ascii_graphic())
}

/// Whether `key` is a valid prefix key: 1 to [`MAX_KEY`] bytes of ASCII letters, digits, `-`,
/// `_`, `.` and `:`.
pub fn valid_key(key: &str) -> bool {
    !key.is_empty()
        && key.len() <= MAX_KEY
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':'))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_oversize_is_refused() {
        let msg = Request::Acquire {
            id: 7,
            device: 0,
            need: 1,
            want: 2,
        };
        let mut buf = Vec::new();
        write_frame(&mut buf, &msg).unwrap();
        let got: Frame<Request> = read_frame(&mut buf.as_slice()).unwrap();
        assert!(matches!(got, Frame::Message(m) if m == msg));
        let mut huge = u32::MAX.to_le_bytes().to_vec();
        huge.extend_from_slice(b"{}");
        assert!(read_frame::<Request>(&mut huge.as_slice()).is_err());
        let mut bad = 2u32.to_le_bytes().to_vec();
        bad.extend_from_slice(b"{}");
        let got: Frame<Request> = read_frame(&mut bad.as_slice()).unwrap();
        assert!(matches!(got, Frame::Malformed(_)));
        let extra = br#"{"op":"return","id":1,"device":0,"bytes":1,"other":2}"#;
        let mut framed = u32::try_from(extra.len()).unwrap().to_le_bytes().to_vec();
        framed.extend_from_slice(extra);
        let got: Frame<Request> = read_frame(&mut framed.as_slice()).unwrap();
        assert!(
            matches!(got, Frame::Malformed(_)),
            "unknown fields are refused"
        );
    }

    /// A reader interrupted once before every read it serves.
    struct Interrupted<'a>(&'a [u8], bool);

    impl Read for Interrupted<'_> {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            self.1 = !self.1;
            if self.1 {
                return Err(io::ErrorKind::Interrupted.into());
            }
            self.0.read(buf)
        }
    }

    #[test]
    fn an_interrupted_read_is_tried_again() {
        let mut buf = Vec::new();
        write_frame(&mut buf, &Request::Ping { id: 3 }).unwrap();
        let got = read_frame::<Request>(&mut Interrupted(&buf, false)).unwrap();
        assert!(matches!(got, Frame::Message(Request::Ping { id: 3 })));
    }

    #[test]
    fn keys_and_meta() {
        assert!(valid_key("system-prompt:v1.2_x"));
        assert!(valid_key(&"k".repeat(MAX_KEY)));
        assert!(!valid_key(""));
        assert!(!valid_key("a b"));
        assert!(!valid_key("a/b"));
        assert!(!valid_key(&"k".repeat(MAX_KEY + 1)));
        assert!(valid_meta(""));
        assert!(valid_meta("kvvm-prefix/1 64 0 2 0:1"));
        assert!(valid_meta(&"m".repeat(MAX_META)));
        assert!(!valid_meta("a\nb"));
        assert!(!valid_meta("\u{e9}"));
        assert!(!valid_meta(&"m".repeat(MAX_META + 1)));
    }

    #[test]
    fn tenant_names() {
        assert!(valid_tenant("engine-a.1_x"));
        assert!(!valid_tenant(""));
        assert!(!valid_tenant("../etc"));
        assert!(!valid_tenant(&"a".repeat(MAX_TENANT + 1)));
    }
}
