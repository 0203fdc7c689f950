//! [`CopyEvent`]: an event recorded after copies queued on a stream, and the fence a sequence
//! keeps while copies read or write its windows.

use std::sync::{Arc, Mutex, MutexGuard};

use kvvm_hal::{BackendError, DeviceId, EventHandle, StreamHandle, VirtualMemoryBackend};

/// An event recorded on a stream after copies: done once they are. Destroyed on drop (a wait
/// queued on it still holds); dropping one not waited for waits for it first (best effort), so
/// that what the copies touch is never handed on under them.
pub(crate) struct CopyEvent {
    backend: Arc<dyn VirtualMemoryBackend>,
    device: DeviceId,
    event: Option<EventHandle>,
    done: bool,
}

impl std::fmt::Debug for CopyEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CopyEvent")
            .field("event", &self.event)
            .field("done", &self.done)
            .finish()
    }
}

impl CopyEvent {
    /// Records an event on `stream` of `device`.
    pub(crate) fn record(
        backend: &Arc<dyn VirtualMemoryBackend>,
        device: DeviceId,
        stream: StreamHandle,
    ) -> Result<CopyEvent, BackendError> {
        let event = backend.event_record(device, stream)?;
        Ok(CopyEvent {
            backend: Arc::clone(backend),
            device,
            event: Some(event),
            done: false,
        })
    }

    /// Whether the copies are done, without waiting. An error is their failure.
    pub(crate) fn query(&mut self) -> Result<bool, BackendError> {
        if self.done {
            return Ok(true);
        }
        if let Some(e) = self.event {
            self.done = self.backend.event_query(e)?;
        }
        Ok(self.done)
    }

    /// Waits until the copies are done. An error is their failure (their bytes cannot be
    /// trusted); the event then still counts as not waited for.
    pub(crate) fn wait(&mut self) -> Result<(), BackendError> {
        if self.done {
            return Ok(());
        }
        if let Some(e) = self.event {
            self.backend.event_wait(e)?;
        }
        self.done = true;
        Ok(())
    }

    /// Makes the work queued on `stream` from now on wait, on the device, for the copies.
    pub(crate) fn order_before(&self, stream: StreamHandle) -> Result<(), BackendError> {
        match self.event {
            Some(e) if !self.done => self.backend.stream_wait_event(stream, e),
            _ => Ok(()),
        }
    }

    /// Destroys the event without waiting for it: its only use (a wait queued on a stream
    /// with [`order_before`](Self::order_before)) is made.
    pub(crate) fn forget(mut self) {
        self.done = true;
    }

    /// After a failed wait: whether the device is idle (synchronized), so that what the
    /// copies touched can be handed on. False when that fails too (the device is lost: the
    /// memory cannot be proven idle).
    pub(crate) fn settle_after_failure(&mut self) -> bool {
        match self.backend.synchronize(self.device) {
            Ok(()) => {
                self.done = true;
                true
            }
            Err(e) => {
                tracing::warn!(error = %e, "copies cannot be proven done");
                false
            }
        }
    }
}

impl Drop for CopyEvent {
    fn drop(&mut self) {
        if !self.done {
            if let Err(e) = self.wait() {
                tracing::warn!(error = %e, "waiting for copies at drop failed");
                self.settle_after_failure();
            }
        }
        if let Some(e) = self.event.take() {
            if let Err(err) = self.backend.event_destroy(e) {
                tracing::warn!(error = %err, "destroying an event failed");
            }
        }
    }
}

/// Copies in flight over a sequence's windows: what releasing or changing them waits for
/// first. Shared by the sequence and the swap that queued the copies.
#[derive(Debug, Default)]
pub(crate) struct Fence(Mutex<Option<CopyEvent>>);

impl Fence {
    /// A fence over `event`.
    pub(crate) fn over(event: CopyEvent) -> Arc<Fence> {
        Arc::new(Fence(Mutex::new(Some(event))))
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, Option<CopyEvent>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Waits for the copies (nothing when none or done). On an error the device is
    /// synchronized; the error is returned only when that fails too.
    pub(crate) fn wait(&self) -> Result<(), BackendError> {
        let mut guard = self.lock();
        let Some(event) = guard.as_mut() else {
            return Ok(());
        };
        match event.wait() {
            Ok(()) => Ok(()),
            Err(e) if event.settle_after_failure() => {
                tracing::warn!(error = %e, "a copy failed; the device is idle now");
                Ok(())
            }
            Err(e) => Err(e),
        }
    }
}
