//! The public stager: [`PinnedStager<T>`], a ring of pinned slots for values of one element
//! type, and its copy builder [`StagedCopy`].

use std::marker::PhantomData;

use super::mirror::H2DMirror;
use super::stager::{CopyOutcome, PinnedStagerStats, RawCopy, RawStager, RawStagerBuilder, WaitFn};
use crate::cuda::StreamHandle;
use crate::dlpack::{DeviceView, Element};
use crate::error::Result;

/// A ring of pinned slots for small host-to-device copies of `T` values (one non-blocking copy
/// per call, each slot guarded by its event):
/// `PinnedStager::<i32>::builder().device(0).numel(256).depth(8).build()`.
pub struct PinnedStager<T: Element> {
    raw: RawStager,
    _t: PhantomData<fn() -> T>,
}

impl<T: Element> std::fmt::Debug for PinnedStager<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.raw.fmt(f)
    }
}

/// Builds a [`PinnedStager`].
#[derive(Clone, Copy, Debug)]
#[must_use]
pub struct PinnedStagerBuilder<T: Element> {
    raw: RawStagerBuilder,
    _t: PhantomData<fn() -> T>,
}

impl<T: Element> PinnedStagerBuilder<T> {
    /// The CUDA device ordinal served (default 0).
    pub fn device(self, ordinal: i32) -> Self {
        self.map(|b| b.device(ordinal))
    }

    /// Initial slot capacity in elements (default [`super::DEFAULT_NUMEL`]); a larger copy
    /// grows its slot.
    pub fn numel(self, numel: usize) -> Self {
        self.map(|b| b.numel(numel))
    }

    /// Number of slots (default [`super::DEFAULT_DEPTH`]; 1 to [`super::MAX_DEPTH`]).
    pub fn depth(self, depth: usize) -> Self {
        self.map(|b| b.depth(depth))
    }

    fn map(self, f: impl FnOnce(RawStagerBuilder) -> RawStagerBuilder) -> Self {
        Self {
            raw: f(self.raw),
            _t: PhantomData,
        }
    }

    /// Builds the stager. Without a driver this succeeds and serves host destinations only; a
    /// device destination then gets [`Error::CudaUnavailable`](crate::Error::CudaUnavailable).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a depth outside
    /// 1..=[`super::MAX_DEPTH`] or a negative device, [`Error::OutOfMemory`](crate::Error::OutOfMemory)
    /// when the slots' bytes overflow, [`Error::NoSuchDevice`](crate::Error::NoSuchDevice) for an
    /// ordinal the driver does not report, [`Error::Driver`](crate::Error::Driver) when pinned
    /// memory or events cannot be had. Nothing is allocated before the arguments are checked.
    pub fn build(self) -> Result<PinnedStager<T>> {
        Ok(PinnedStager {
            raw: self.raw.build()?,
            _t: PhantomData,
        })
    }
}

impl<T: Element> PinnedStager<T> {
    /// A builder: device 0, [`crate::h2d::DEFAULT_NUMEL`] elements per slot, [`crate::h2d::DEFAULT_DEPTH`] slots.
    pub fn builder() -> PinnedStagerBuilder<T> {
        PinnedStagerBuilder {
            raw: RawStager::builder(T::DTYPE),
            _t: PhantomData,
        }
    }

    /// `dst[..values.len()] = values` on the legacy default stream: `self.to(dst).copy(values)`.
    ///
    /// # Errors
    /// As [`StagedCopy::copy`].
    pub fn copy_(&self, dst: &DeviceView<'_>, values: &[T]) -> Result<CopyOutcome> {
        self.raw
            .copy_bytes(self.raw.to(dst), None, bytemuck::cast_slice(values))
    }

    /// A copy into `dst`, configured by the returned builder, issued by [`StagedCopy::copy`]:
    /// `dst[..values.len()] = values` and, with a pad, the rest of `dst` = pad, as ONE
    /// non-blocking host-to-device copy from a pinned ring slot.
    ///
    /// - Without a pad only `values.len()` elements change; a 0-element copy issues nothing.
    /// - A host destination is written directly, padding too.
    /// - With a mirror that already records these values for `dst`, nothing is copied.
    /// - `values` may be overwritten as soon as the copy returns.
    pub fn to<'a>(&'a self, dst: &'a DeviceView<'a>) -> StagedCopy<'a, T> {
        StagedCopy {
            raw: self.raw.to(dst),
            pad: None,
        }
    }

    /// Counters.
    pub fn stats(&self) -> PinnedStagerStats {
        self.raw.stats()
    }

    /// The device ordinal served.
    pub fn ordinal(&self) -> i32 {
        self.raw.ordinal()
    }

    /// Number of slots.
    pub fn depth(&self) -> usize {
        self.raw.depth()
    }

    /// Whether device destinations can be served (a driver and the device were found).
    pub fn has_cuda(&self) -> bool {
        self.raw.has_cuda()
    }

    /// The untyped stager (tests check its byte-level errors).
    #[cfg(feature = "testing")]
    pub fn raw(&self) -> &RawStager {
        &self.raw
    }
}

/// A typed copy being configured: [`PinnedStager::to`], then options, then [`StagedCopy::copy`].
#[must_use = "a copy does nothing until `.copy(values)`"]
pub struct StagedCopy<'a, T: Element> {
    raw: RawCopy<'a>,
    pad: Option<T>,
}

impl<'a, T: Element> StagedCopy<'a, T> {
    /// Fill the rest of the destination with `pad`.
    pub fn pad(mut self, pad: T) -> Self {
        self.pad = Some(pad);
        self
    }

    /// Skip the copy when `mirror` shows the destination already holds the values; a mirror
    /// binds to the first destination it is used with.
    pub fn mirror(mut self, mirror: &'a mut H2DMirror) -> Self {
        self.raw = self.raw.mirror(mirror);
        self
    }

    /// The stream to copy on (default: the legacy default stream).
    pub fn stream(mut self, stream: StreamHandle<'a>) -> Self {
        self.raw = self.raw.stream(stream);
        self
    }

    /// How to wait when the claimed slot's last copy is still running: `wait(event)` should
    /// return once the event completed (default: [`crate::cuda::SlotEvent::synchronize`]); the event is
    /// asked again after it returns (and waited for if still running), so a function that
    /// returns early costs time, not data. A panic in it leaves the slot as it was.
    pub fn wait_with(mut self, wait: &'a mut WaitFn<'a>) -> Self {
        self.raw = self.raw.wait_with(wait);
        self
    }

    /// Issues the copy.
    ///
    /// # Errors
    /// Before anything is written: [`Error::DtypeMismatch`](crate::Error::DtypeMismatch) (dst not of `T`'s dtype),
    /// [`Error::TooManyValues`](crate::Error::TooManyValues), [`Error::ReadOnly`](crate::Error::ReadOnly), [`Error::WrongDevice`](crate::Error::WrongDevice),
    /// [`Error::CudaUnavailable`](crate::Error::CudaUnavailable) (a device destination without a driver),
    /// [`Error::MirrorReused`](crate::Error::MirrorReused), [`Error::StreamCapturing`](crate::Error::StreamCapturing) (a stream capturing a CUDA graph).
    /// [`Error::Driver`](crate::Error::Driver) if the driver refuses the copy.
    pub fn copy(self, values: &[T]) -> Result<CopyOutcome> {
        let pad = self.pad;
        let pad = pad.as_ref().map(bytemuck::bytes_of);
        let stager = self.raw.stager;
        stager.copy_bytes(self.raw, pad, bytemuck::cast_slice(values))
    }
}
