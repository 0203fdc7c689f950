//! What a connection did last: bytes read and requests in progress ([`Activity`]), seen
//! through the socket ([`Tracked`]), so that a keep-alive connection idle too long can be
//! closed and, at shutdown, a connection without a request in flight closed at once.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// A connection's activity.
#[derive(Debug)]
pub(crate) struct Activity {
    opened: Instant,
    /// Milliseconds after `opened` of the last byte read or response finished.
    last_ms: AtomicU64,
    /// Requests being handled.
    busy: AtomicU64,
}

/// A request in progress on a connection (see [`Activity::begin`]).
pub(crate) struct Busy(Arc<Activity>);

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.busy.fetch_sub(1, Ordering::Relaxed);
        self.0.touch();
    }
}

impl Activity {
    pub(crate) fn new() -> Self {
        Activity {
            opened: Instant::now(),
            last_ms: AtomicU64::new(0),
            busy: AtomicU64::new(0),
        }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.opened.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn touch(&self) {
        self.last_ms.store(self.now_ms(), Ordering::Relaxed);
    }

    /// Marks a request in progress until the returned guard drops.
    pub(crate) fn begin(self: &Arc<Self>) -> Busy {
        self.busy.fetch_add(1, Ordering::Relaxed);
        self.touch();
        Busy(self.clone())
    }

    /// Whether a request is being handled.
    pub(crate) fn is_busy(&self) -> bool {
        self.busy.load(Ordering::Relaxed) > 0
    }

    /// Whether nothing was read and no request handled for `idle`.
    pub(crate) fn is_idle_for(&self, idle: Duration) -> bool {
        let idle_ms = u64::try_from(idle.as_millis()).unwrap_or(u64::MAX);
        !self.is_busy()
            && self
                .now_ms()
                .saturating_sub(self.last_ms.load(Ordering::Relaxed))
                >= idle_ms
    }

    /// When the connection will have been idle for `idle` if nothing happens meanwhile.
    pub(crate) fn idle_deadline(&self, idle: Duration) -> Instant {
        let last = Duration::from_millis(self.last_ms.load(Ordering::Relaxed));
        let at = self.opened + last + idle;
        // A busy connection is checked again one period later.
        if self.is_busy() {
            Instant::now() + idle
        } else {
            at
        }
    }
}

/// A TCP stream that records reads in an [`Activity`].
#[derive(Debug)]
pub(crate) struct Tracked {
    stream: TcpStream,
    activity: Arc<Activity>,
}

impl Tracked {
    pub(crate) fn new(stream: TcpStream, activity: Arc<Activity>) -> Self {
        Tracked { stream, activity }
    }
}

impl AsyncRead for Tracked {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.stream).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.activity.touch();
        }
        r
    }
}

impl AsyncWrite for Tracked {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}
