//! How the crate's tokio threads wake the caller's asyncio loop, once per batch: what became
//! ready goes into a list, and one byte goes on a socket pair only when the list was empty.
//! The loop watches the pair's other end (`add_reader`), takes the whole list in one call
//! and drains the bytes with it. Used by the worker calls ([`crate::calls`]) and the HTTP
//! server ([`crate::front`]).

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::Mutex;

/// What a [`Wake`] collects between two takes.
pub trait Batch: Default {
    fn is_empty(&self) -> bool;
}

impl<T> Batch for Vec<T> {
    fn is_empty(&self) -> bool {
        Vec::is_empty(self)
    }
}

impl<A, B> Batch for (Vec<A>, Vec<B>) {
    fn is_empty(&self) -> bool {
        self.0.is_empty() && self.1.is_empty()
    }
}

pub struct Wake<T: Batch> {
    ready: Mutex<T>,
    tx: UnixStream,
    rx: UnixStream,
}

impl<T: Batch> Wake<T> {
    pub fn new() -> std::io::Result<Self> {
        let (tx, rx) = UnixStream::pair()?;
        tx.set_nonblocking(true)?;
        rx.set_nonblocking(true)?;
        Ok(Wake { ready: Mutex::new(T::default()), tx, rx })
    }

    /// Adds to the batch (`f`), writing the wake-up byte if the batch was empty.
    pub fn push(&self, f: impl FnOnce(&mut T)) {
        let mut ready = self.ready.lock().unwrap();
        if ready.is_empty() {
            let _ = (&self.tx).write(&[1]); // WouldBlock: the pipe is full of wake-ups already
        }
        f(&mut ready);
    }

    /// The batch so far, and the wake-up bytes with it.
    pub fn take(&self) -> T {
        let mut ready = self.ready.lock().unwrap();
        let mut sink = [0u8; 64];
        while matches!((&self.rx).read(&mut sink), Ok(n) if n > 0) {}
        std::mem::take(&mut *ready)
    }

    /// Looks at the batch without taking it.
    pub fn peek<R>(&self, f: impl FnOnce(&T) -> R) -> R {
        f(&self.ready.lock().unwrap())
    }

    /// The descriptor that becomes readable when the batch is not empty.
    pub fn fd(&self) -> RawFd {
        self.rx.as_raw_fd()
    }

    /// A blocking clone of the readable end, for tests that wait as the loop does.
    #[cfg(test)]
    pub fn reader(&self) -> UnixStream {
        self.rx.try_clone().unwrap()
    }
}
