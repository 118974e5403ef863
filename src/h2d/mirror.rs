//! `H2DMirror`: remembers what a destination holds, so a repeated copy can be skipped.

use crate::error::{Error, Result};

/// The last `(key, values)` copied to one destination, compared exactly (never by hash).
///
/// Owned by whoever owns the destination; not a cache keyed by address (allocators reuse
/// addresses). Sound only when the stager is the destination's sole writer and later readers are
/// ordered after the copy's stream: call [`H2DMirror::invalidate`] when the destination was
/// written some other way. Used with a stager's `copy_`, a mirror binds to the first destination
/// it sees; using it for another destination is an [`Error::MirrorReused`] until `invalidate`.
#[derive(Debug, Default, Clone)]
pub struct H2DMirror {
    key: Vec<u8>,
    values: Vec<u8>,
    valid: bool,
    bound: Option<(u64, usize)>,
}

impl H2DMirror {
    /// An empty mirror: nothing matches.
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether the last recorded `(key, values)` equals these, byte for byte.
    #[inline]
    pub fn matches(&self, key: &[u8], values: &[u8]) -> bool {
        self.valid && self.key == key && self.values == values
    }

    /// Records that the destination now holds `values` under `key` (reuses capacity).
    pub fn record(&mut self, key: &[u8], values: &[u8]) {
        self.key.clear();
        self.key.extend_from_slice(key);
        self.values.clear();
        self.values.extend_from_slice(values);
        self.valid = true;
    }

    /// Forgets everything, including the destination it was bound to.
    pub fn invalidate(&mut self) {
        self.valid = false;
        self.bound = None;
    }

    /// Whether something is recorded.
    pub fn is_valid(&self) -> bool {
        self.valid
    }

    /// Binds to destination `(ptr, nbytes)`, or fails if bound to another one.
    ///
    /// # Errors
    /// [`Error::MirrorReused`] when bound to another destination.
    pub fn bind(&mut self, ptr: u64, nbytes: usize) -> Result<()> {
        match self.bound {
            Some(b) if b != (ptr, nbytes) => Err(Error::MirrorReused { bound: b.0 }),
            _ => {
                self.bound = Some((ptr, nbytes));
                Ok(())
            }
        }
    }
}

/// The key a stager uses: destination address and size, and the pad value if any.
pub struct CopyKey {
    buf: [u8; 33],
    len: usize,
}

impl CopyKey {
    /// The key of a copy into `(ptr, nbytes)` with `pad` (at most 16 bytes).
    pub fn new(ptr: u64, nbytes: usize, pad: Option<&[u8]>) -> Self {
        let mut buf = [0u8; 33];
        buf[..8].copy_from_slice(&ptr.to_le_bytes());
        buf[8..16].copy_from_slice(&(nbytes as u64).to_le_bytes());
        let len = match pad {
            Some(p) => {
                buf[16] = 1;
                buf[17..17 + p.len()].copy_from_slice(p);
                17 + p.len()
            }
            None => 17,
        };
        Self { buf, len }
    }

    /// The key's bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}
