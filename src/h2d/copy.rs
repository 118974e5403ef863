//! The copy builders ([`RawCopy`], [`Copy`]) and the typed facade [`PinnedStager`].

use std::marker::PhantomData;

use super::mirror::H2DMirror;
use super::stager::{CopyOutcome, Stager, StagerBuilder, StagerStats};
use crate::cuda::{SlotEvent, StreamHandle};
use crate::error::Result;
use crate::view::{DeviceView, Element};

/// A copy being configured: [`Stager::to`], then options, then [`RawCopy::copy`].
#[must_use = "a copy does nothing until `.copy(values)`"]
pub struct RawCopy<'a> {
    pub(super) stager: &'a Stager,
    pub(super) dst: &'a DeviceView<'a>,
    pub(super) pad: Option<&'a [u8]>,
    pub(super) mirror: Option<&'a mut H2DMirror>,
    pub(super) stream: StreamHandle<'a>,
    pub(super) wait: Option<&'a mut WaitFn<'a>>,
}

/// How a copy waits for a busy slot's event ([`RawCopy::wait_with`]): shown as a
/// [`SlotEvent`], which can be waited for but not recorded.
pub type WaitFn<'a> = dyn FnMut(SlotEvent<'_>) -> Result<()> + 'a;

impl<'a> RawCopy<'a> {
    /// Fill the rest of the destination with this element (raw bytes of one element).
    pub fn pad(mut self, pad: &'a [u8]) -> Self {
        self.pad = Some(pad);
        self
    }

    /// Skip the copy when this mirror shows the destination already holds the values.
    pub fn mirror(mut self, mirror: &'a mut H2DMirror) -> Self {
        self.mirror = Some(mirror);
        self
    }

    /// The stream to copy on (default: the legacy default stream).
    pub fn stream(mut self, stream: StreamHandle<'a>) -> Self {
        self.stream = stream;
        self
    }

    /// How to wait when the claimed slot's last copy is still running: `wait(event)` should
    /// return once the event completed (default: `Event::synchronize`); the event is asked again
    /// after it returns (and waited for if still running), so a function that returns early
    /// costs time, not data. A panic in it leaves the slot as it was. The Python layer polls
    /// briefly, then waits with the GIL released and answers Ctrl-C.
    pub fn wait_with(mut self, wait: &'a mut WaitFn<'a>) -> Self {
        self.wait = Some(wait);
        self
    }

    /// Copies `values` (raw element bytes). See [`PinnedStager::to`] for the rules.
    ///
    /// # Errors
    /// As [`Copy::copy`], and [`Error::RaggedBytes`](crate::Error::RaggedBytes) / [`Error::PadSize`](crate::Error::PadSize) for bytes that are not
    /// whole elements.
    #[inline]
    pub fn copy(self, values: &[u8]) -> Result<CopyOutcome> {
        let pad = self.pad;
        self.stager.copy_bytes(self, pad, values)
    }
}

/// Typed facade over [`Stager`]:
/// `PinnedStager::<i32>::builder().device(0).numel(256).depth(8).build()`.
pub struct PinnedStager<T: Element> {
    raw: Stager,
    _t: PhantomData<fn() -> T>,
}

impl<T: Element> std::fmt::Debug for PinnedStager<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.raw.fmt(f)
    }
}

/// Builds a [`PinnedStager`]; see [`StagerBuilder`] for the options.
#[derive(Clone, Copy, Debug)]
#[must_use]
pub struct PinnedStagerBuilder<T: Element> {
    raw: StagerBuilder,
    _t: PhantomData<fn() -> T>,
}

impl<T: Element> PinnedStagerBuilder<T> {
    /// See [`StagerBuilder::device`].
    pub fn device(self, ordinal: i32) -> Self {
        self.map(|b| b.device(ordinal))
    }

    /// See [`StagerBuilder::numel`].
    pub fn numel(self, numel: usize) -> Self {
        self.map(|b| b.numel(numel))
    }

    /// See [`StagerBuilder::depth`].
    pub fn depth(self, depth: usize) -> Self {
        self.map(|b| b.depth(depth))
    }

    fn map(self, f: impl FnOnce(StagerBuilder) -> StagerBuilder) -> Self {
        Self {
            raw: f(self.raw),
            _t: PhantomData,
        }
    }

    /// Builds the stager; see [`StagerBuilder::build`].
    ///
    /// # Errors
    /// As [`StagerBuilder::build`].
    pub fn build(self) -> Result<PinnedStager<T>> {
        Ok(PinnedStager {
            raw: self.raw.build()?,
            _t: PhantomData,
        })
    }
}

impl<T: Element> PinnedStager<T> {
    /// A builder: device 0, [`crate::DEFAULT_NUMEL`] elements per slot, [`crate::DEFAULT_DEPTH`] slots.
    pub fn builder() -> PinnedStagerBuilder<T> {
        PinnedStagerBuilder {
            raw: Stager::builder(T::DTYPE),
            _t: PhantomData,
        }
    }

    /// `dst[..values.len()] = values` on the legacy default stream: `self.to(dst).copy(values)`.
    ///
    /// # Errors
    /// As [`Copy::copy`].
    pub fn copy_(&self, dst: &DeviceView<'_>, values: &[T]) -> Result<CopyOutcome> {
        self.raw
            .copy_bytes(self.raw.to(dst), None, bytemuck::cast_slice(values))
    }

    /// A copy into `dst`, configured by the returned builder, issued by [`Copy::copy`]:
    /// `dst[..values.len()] = values` and, with a pad, the rest of `dst` = pad, as ONE
    /// non-blocking host-to-device copy from a pinned ring slot.
    ///
    /// - Without a pad only `values.len()` elements change; a 0-element copy issues nothing.
    /// - A host destination is written directly, padding too.
    /// - With a mirror that already records these values for `dst`, nothing is copied.
    /// - `values` may be overwritten as soon as the copy returns.
    pub fn to<'a>(&'a self, dst: &'a DeviceView<'a>) -> Copy<'a, T> {
        Copy {
            raw: self.raw.to(dst),
            pad: None,
        }
    }

    /// Counters.
    pub fn stats(&self) -> StagerStats {
        self.raw.stats()
    }

    /// The untyped stager.
    pub fn raw(&self) -> &Stager {
        &self.raw
    }
}

/// A typed copy being configured: [`PinnedStager::to`], then options, then [`Copy::copy`].
#[must_use = "a copy does nothing until `.copy(values)`"]
pub struct Copy<'a, T: Element> {
    raw: RawCopy<'a>,
    pad: Option<T>,
}

impl<'a, T: Element> Copy<'a, T> {
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
